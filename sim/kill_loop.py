"""The coordinator killed with SIGKILL again and again, and resumed by running the same command.

Each life of the run is a real `fedrl sim --engine local ... --set resume=true` process, killed
with SIGKILL and started again. The lives are forked from a warm process (multiprocessing's
forkserver) that has imported torch, transformers, peft, numba and matplotlib once: started
cold, each life spent about 5 s of CPU on those imports, about as long as its work.
Their output is appended to `lives.log` in the run folder; a life that exits with an error of
its own (not SIGKILL) stops the loop with the end of that log.

The lives take turns at where the kill lands: at a random moment within about one version's
time after the life's first version and before its second (mostly while it waits for replies),
and, through a failpoint (fedrl.failpoints), in the middle of an aggregation, of a checkpoint
file's write, and of a publish, at its 2nd to 4th time there.
The event log (`events.jsonl`, appended across lives) says what each life reached and where the
next one resumed from: versions lost per kill is the last version announced before the kill
minus the version resumed from. After the last kill the run goes to its end; its final metric is
compared with an unkilled run of the same command and seed.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import runpy
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing import forkserver
from pathlib import Path

import numpy as np

from fedrl import failpoints
from fedrl.run_events import read_events
from fedrl.strategies.checkpoint import load_checkpoints

PHASES = ("random", *failpoints.NAMES)  # where the kills land, in turn


PRELOAD = ["torch", "transformers", "peft", "matplotlib.pyplot", "fedrl.patch_kernels", "fedrl.sim.runner"]


def arguments(run_dir: Path, clients: int, overrides: dict) -> list[str]:
    """The life's command after `fedrl`: the same for every life, resume on."""
    sets = [f"{k}={json.dumps(v)}" for k, v in {**overrides, "resume": True}.items()]
    return ["sim", "--engine", "local", "--clients", str(clients), "--out", str(run_dir), "--set", *sets]


LOG = "lives.log"  # every life's output, appended, beside its run's events


def life(argv: list[str], env: dict[str, str], log: Path) -> None:
    """In the forked process: `fedrl <argv>` under `env`, its output appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.write(out, f"\n--- a life of the run (pid {os.getpid()})\n".encode())  # after a killed one's cut line
    nothing = os.open(os.devnull, os.O_RDONLY)
    for source, fd in ((nothing, 0), (out, 1), (out, 2)):
        os.dup2(source, fd)
    os.close(nothing)
    os.close(out)
    os.environ.clear()
    os.environ.update(env)
    from tqdm import tqdm

    # tqdm's default lock is a multiprocessing semaphore, which a killed life would leave to the
    # resource tracker it shares with the loop (a warning per kill); a thread lock is enough here
    tqdm.set_lock(threading.RLock())
    # the command runs as `python -m fedrl.cli` ran it, across the process boundary the lives
    # had when they were started cold: the simulation layer does not import the CLI above it
    sys.argv = ["fedrl", *argv]
    runpy.run_module("fedrl.cli", run_name="__main__", alter_sys=True)


def start_life(run_dir: Path, clients: int, overrides: dict, env: dict[str, str]) -> mp.process.BaseProcess:
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)  # read when the forkserver starts: at the first life
    argv = arguments(run_dir, clients, overrides)
    proc = context.Process(target=life, args=(argv, env, run_dir / LOG), daemon=True)
    proc.start()
    return proc


@contextmanager
def warm_lives() -> Iterator[None]:
    """Lives started inside are forked from one warm process, which goes when the block ends: idle,
    it kept about 500 MB resident (torch and the rest imported) until the process that used it exited.
    multiprocessing has no public way to stop its forkserver; a Python without the private one
    keeps it to the end, as before."""
    try:
        yield
    finally:
        stop = getattr(forkserver._forkserver, "_stop", None)
        if stop is not None:
            stop()


def failed(run_dir: Path, exitcode: int) -> RuntimeError:
    """A life that exited with an error of its own (not a kill): the run cannot go on."""
    tail = (run_dir / LOG).read_text(errors="replace").splitlines()[-15:]
    lines = "\n".join(f"  {line}" for line in tail)
    return RuntimeError(f"the run in {run_dir} exited with {exitcode}; the end of {run_dir / LOG}:\n{lines}")


def events_of(run_dir: Path) -> list[dict]:
    """The run's events so far, across its lives (a line a kill cut short is skipped)."""
    path = run_dir / "events.jsonl"
    return read_events(path)[0] if path.exists() else []


def last_version(events: list[dict]) -> int:
    return max((e["version"] for e in events if e["kind"] == "version"), default=0)


def run_to_end(run_dir: Path, clients: int, overrides: dict, timeout_s: float) -> dict:
    proc = start_life(run_dir, clients, overrides, dict(os.environ))
    proc.join(timeout_s)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise TimeoutError(f"the run in {run_dir} did not end within {timeout_s:.0f} s")
    if proc.exitcode != 0:
        raise failed(run_dir, proc.exitcode)
    return json.loads((run_dir / "summary.json").read_text())


def resumed_from(life: list[dict]) -> int:
    """Where a life of the run started: the checkpoint it resumed, or v0 when it found none."""
    return next((e["from_version"] for e in life if e["kind"] == "resumed"), 0)


def kill_loop(
    run_dir: Path, kills: int, clients: int, overrides: dict, seed: int = 0, life_timeout_s: float = 300.0
) -> dict:
    """`kills` SIGKILLs of one run, then its completion; the per-kill record and what is left."""
    rng = np.random.default_rng(seed)
    records, interval = [], 2.0  # wall seconds per version, learned from the run itself
    finished = False
    for k in range(kills):
        phase, seen = PHASES[k % len(PHASES)], len(events_of(run_dir))
        env = dict(os.environ)
        env.pop(failpoints.ENV, None)
        if phase != "random":
            env[failpoints.ENV] = f"{phase}:{int(rng.integers(2, 5))}"
        proc = start_life(run_dir, clients, overrides, env)
        start, deadline = time.monotonic(), time.monotonic() + life_timeout_s
        kill_at = None  # random phase: a moment within `interval` after the life's first version
        while time.monotonic() < deadline and proc.is_alive():
            if phase == "random":
                versions = sum(e["kind"] == "version" for e in events_of(run_dir)[seen:])
                if versions and kill_at is None:
                    kill_at = time.monotonic() + float(rng.uniform(0, interval))
                # no later than the life's second version: before a life has measured the pace,
                # `interval` is a guess, and a fast run would otherwise end in this one life
                if versions >= 2 or (kill_at is not None and time.monotonic() >= kill_at):
                    break
            time.sleep(0.05)
        killed_by = "failpoint"
        if proc.is_alive():  # the aimed moment (or a failpoint never reached before the deadline)
            proc.kill()
            killed_by = "loop"
        proc.join()
        if proc.exitcode == 0:  # the run ended before this kill: nothing left to kill, nor to rerun
            finished = True
            break
        if proc.exitcode > 0:
            raise failed(run_dir, proc.exitcode)
        life = events_of(run_dir)[seen:]
        walls = [e["wall"] for e in life if e["kind"] == "version"]
        if len(walls) > 1:
            interval = max(0.2, (walls[-1] - walls[0]) / (len(walls) - 1))
        records.append(
            {
                "kill": k + 1,
                "phase": phase,
                "failpoint": env.get(failpoints.ENV, ""),
                "killed": proc.exitcode == -signal.SIGKILL,
                "killed_by": killed_by,
                "resumed_from": resumed_from(life),
                "reached": max(last_version(life), resumed_from(life)),
                "last_event": life[-1]["kind"] if life else None,
                "life_s": round(time.monotonic() - start, 2),
            }
        )
    if finished:  # its last life, from `seen` on, ended it
        summary = json.loads((run_dir / "summary.json").read_text())
    else:
        seen = len(events_of(run_dir))
        summary = run_to_end(run_dir, clients, overrides, life_timeout_s * 2)
    starts = [r["resumed_from"] for r in records[1:]] + [resumed_from(events_of(run_dir)[seen:])]
    for record, next_start in zip(records, starts):  # a kill loses what its life reached past the next start
        record["versions_lost"] = max(0, record["reached"] - next_start)
    ckpt_dir = run_dir / "checkpoints"
    corrupt: list[str] = []
    list(load_checkpoints(ckpt_dir, corrupt))
    return {
        "kills": records,
        "kills_done": len(records),
        "versions_lost_max": max((r["versions_lost"] for r in records), default=0),
        "versions_lost_total": sum(r["versions_lost"] for r in records),
        "leftover_tmp_files": len(list(ckpt_dir.glob("*.tmp"))),
        "corrupt_checkpoints": len(corrupt),
        "final_metric": summary["final_eval"],
        "initial_metric": summary["initial_eval"],
        "versions": summary["versions"],
    }
