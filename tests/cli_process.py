"""Run the real `fedrl` command in a child process, as a user would."""

import json
import subprocess
import sys


def run_fedrl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedrl.cli", *args], capture_output=True, text=True, timeout=timeout
    )


HEAVY = ("torch", "transformers", "peft", "flwr")


def run_main_light(*args: str, timeout: float = 60) -> tuple[int, list[str], str]:
    """`fedrl ARGS` through `main()` in a fresh interpreter: its exit status, which of the heavy
    libraries it imported (a command that needs none should answer in a fraction of a second, not
    the seconds they take to import), and what it printed."""
    code = (
        "import json, sys; from fedrl.cli.main import main\n"
        f"try:\n    rc = main({list(args)!r})\nexcept SystemExit as exit:\n    rc = exit.code\n"
        f"print('::' + json.dumps([rc, sorted(m for m in {HEAVY!r} if m in sys.modules)]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    said, _, result = out.stdout.rpartition("::")
    if not result:
        raise AssertionError(f"`fedrl {' '.join(args)}` did not return: {out.stdout}{out.stderr}")
    rc, heavy = json.loads(result)
    return rc, heavy, said + out.stderr
