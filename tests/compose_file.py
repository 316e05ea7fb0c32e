"""docker-compose.yml as compose reads it, for the tests that check its services without Docker."""

import re
import shlex
from pathlib import Path

COMPOSE = Path(__file__).resolve().parents[1] / "docker-compose.yml"
VARIABLE = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}")


def expand(text: str, env: dict) -> str:
    """Compose's `${VAR}` and `${VAR:-default}` (the default also when VAR is empty)."""
    return VARIABLE.sub(lambda m: str(env.get(m[1]) or m[2] or ""), text)


def services() -> dict:
    import yaml

    return yaml.safe_load(COMPOSE.read_text())["services"]


def service_argv(name: str, env: dict, mounts: dict[str, Path] | None = None) -> list[str]:
    """The service's command, its variables expanded; with `mounts` (a volume's container path ->
    a folder here), its container paths mapped, each of which must lie in one of its volumes."""
    service = services()[name]
    argv = shlex.split(expand(service["command"], env))
    if mounts is None:
        return argv
    volumes = [expand(v, env).split(":")[1] for v in service.get("volumes", [])]
    for i, arg in enumerate(argv):
        if arg.startswith("/"):
            target = next((v for v in volumes if arg == v or arg.startswith(v + "/")), None)
            assert target is not None, f"{name}: {arg} is in none of its volumes {volumes}"
            argv[i] = str(mounts[target]) + arg[len(target) :]
    return argv
