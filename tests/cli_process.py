"""Run the real `fedrl` command in a child process, as a user would."""

import subprocess
import sys


def run_fedrl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedrl.cli", *args], capture_output=True, text=True, timeout=timeout
    )
