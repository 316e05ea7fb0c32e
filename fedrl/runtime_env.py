"""Whether a ServerApp runs on packages Flower installed for its run instead of the user's own.

Unless FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1 was set when the SuperLink started, `flwr
run` has it install the app's dependencies with `uv sync` into a fresh environment for each
run, from the package index, and put that environment ahead of the interpreter's own on
sys.path (its path in VIRTUAL_ENV; sys.prefix stays the interpreter's). For fedrl that is
torch's CUDA build on Linux (several GB the first time) and whatever versions resolve that day,
in place of the install the user made and tested. Measured with `flwr run . --stream` here:
61 s with the installation (uv's cache already warm), 32 s without, on the same results.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

DISABLE = "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"


def installed_for_the_run(prefix: str, virtual_env: str | None, module_file: str) -> bool:
    """True when `module_file` lies in an environment activated over the interpreter's own."""
    if not virtual_env:
        return False
    env = Path(virtual_env).resolve()
    return env != Path(prefix).resolve() and Path(module_file).resolve().is_relative_to(env)


def runtime_env_warning() -> str | None:
    """What to tell the user when this process imports torch from such an environment."""
    import torch

    env = os.environ.get("VIRTUAL_ENV")
    if not installed_for_the_run(sys.prefix, env, torch.__file__):
        return None
    return (
        f"this run imports torch {torch.__version__} and fedrl's other dependencies from {env}, which "
        "Flower's SuperLink installed for it from the package index, not from the environment fedrl "
        f"was installed in. To run on your own install, start the SuperLink with {DISABLE}=1 set "
        "(or --disable-runtime-dependency-installation); `flwr run` leaves its local SuperLink "
        "running between runs, so stop that `flower-superlink` process first"
    )
