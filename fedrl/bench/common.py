"""Shared benchmark plumbing: run cases on worker processes with a progress bar, write JSON."""

from __future__ import annotations

import json
import multiprocessing as mp
import subprocess
from collections.abc import Callable, Iterable
from pathlib import Path

from tqdm import tqdm

from fedrl.arguments import integer


def _init_worker() -> None:
    import torch

    torch.set_num_threads(1)  # one thread per case; cases run side by side


def add_workers_argument(parser) -> None:
    """For benchmarks whose cases are independent runs (`run_cases`)."""
    parser.add_argument("--workers", type=integer(1), default=2, help="processes running cases side by side")


def run_cases(fn: Callable[[dict], dict], cases: Iterable[dict], workers: int, desc: str) -> list[dict]:
    cases = list(cases)
    if workers <= 1:
        _init_worker()
        return [fn(c) for c in tqdm(cases, desc=desc)]
    with mp.get_context("spawn").Pool(workers, initializer=_init_worker) as pool:
        results = list(tqdm(pool.imap(fn, cases), total=len(cases), desc=desc))
        pool.close()  # the workers exit on their own, their finalizers run (`with` would kill them)
        pool.join()
    return results


def code_version() -> dict:
    """Which fedrl made a benchmark's figures: its version and, run from fedrl's own git checkout,
    its commit (`+dirty` with tracked files changed), so runs of other code are not read as one
    unawares (`bench methods --pool` names them)."""
    import fedrl

    package = Path(fedrl.__file__).resolve().parent

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(package), *args], capture_output=True, text=True, timeout=10)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = None
    try:  # a wheel installed inside some other repository is not that repository's commit
        if (Path(git("rev-parse", "--show-toplevel") or "/nonexistent") / "fedrl").resolve() == package:
            commit = git("rev-parse", "HEAD") or None
            if commit and git("status", "--porcelain", "--untracked-files=no"):
                commit += "+dirty"
    except (OSError, subprocess.TimeoutExpired):  # no git here: the version alone
        pass
    return {"version": fedrl.__version__, "commit": commit}


def write_json(data: dict, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**data, "code": code_version()}, indent=1))
    return out
