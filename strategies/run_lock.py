"""One coordinator a run folder: an exclusive lock on `coordinator.lock` in it, held while the
coordinator lives.

Two coordinators on one folder interleave their checkpoints and events, and each resumes from
what the other wrote: two `fedrl sim` runs given one out_dir, or a run submitted again while
the last one still runs (a ServerApp goes on for some seconds after its SuperLink is killed).
The lock is the kernel's (`flock`), so it goes with its process however that ends (a SIGKILL
too), and a resume after a crash finds it free. The file names the holder, for the error the
second coordinator gives.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_FILE = "coordinator.lock"


class RunLockedError(RuntimeError):
    """Another coordinator holds this run folder."""


def hold_run_lock(directory: str | Path) -> int:
    """Lock `directory` for this coordinator; the lock's file descriptor, to `release`. Raises
    RunLockedError naming the holder if another coordinator (in any process) has it."""
    path = Path(directory) / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # close-on-exec: the programs it starts hold none
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 4096).decode(errors="replace")
        os.close(fd)
        raise RunLockedError(
            f"{directory} is another coordinator's run folder while it runs ({describe(holder)}): "
            "stop that one first (a run resumes from its checkpoint), or give this run another out_dir"
        ) from None
    os.ftruncate(fd, 0)
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    return fd


def release(fd: int) -> None:
    os.close(fd)  # closing the last descriptor of the open file releases the lock


def describe(holder: str) -> str:
    try:
        record = json.loads(holder)
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record["since"]))
        return f"pid {record['pid']} on {record['host']}, since {since}"
    except (ValueError, KeyError, TypeError):
        return "its lock file names no holder yet"
