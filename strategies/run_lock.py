"""One coordinator a run folder: an exclusive lock on the folder itself, held while the
coordinator lives, and `coordinator.lock` in it naming the holder.

Two coordinators on one folder interleave their checkpoints and events, and each resumes from
what the other wrote: two `fedrl sim` runs given one out_dir, or a run submitted again while
the last one still runs (a ServerApp goes on for some seconds after its SuperLink is killed).
The lock is the kernel's (`flock`), so it goes with its process however that ends (a SIGKILL
too), and a resume after a crash finds it free. It is taken on the folder, not on a file in it,
so deleting the holder's record while it runs does not let a second coordinator in (on a
filesystem that cannot lock a folder, NFS, the record is locked instead, and its deletion would).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_FILE = "coordinator.lock"  # the holder's record, for the error a second coordinator gives


class RunLockedError(RuntimeError):
    """Another coordinator holds this run folder."""


@dataclass(frozen=True)
class RunLock:
    fd: int  # the folder's descriptor, which holds the lock (the record's, where the folder's cannot)
    record: Path


def hold_run_lock(directory: str | Path) -> RunLock:
    """Lock `directory` for this coordinator, until `release`. Raises RunLockedError naming the
    holder if another coordinator (in any process) has it."""
    record = Path(directory) / LOCK_FILE
    try:
        fd = lock_folder(directory, record)
    except BlockingIOError:
        raise RunLockedError(
            f"{directory} is another coordinator's run folder while it runs ({describe(record)}): "
            "stop that one first (a run resumes from its checkpoint), or give this run another out_dir"
        ) from None
    holder = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time()}
    record.write_text(json.dumps(holder))  # one read of it part-written names no holder
    return RunLock(fd, record)


def lock_folder(directory: str | Path, record: Path) -> int:
    try:
        return locked(directory, os.O_RDONLY | os.O_DIRECTORY)
    except BlockingIOError:
        raise
    except OSError:  # NFS locks only a file opened for writing: there the record is the lock
        return locked(record, os.O_RDWR | os.O_CREAT)


def locked(path: str | Path, flags: int) -> int:
    """`path` opened and locked (close-on-exec: the programs the coordinator starts hold none);
    BlockingIOError if another holds it."""
    fd = os.open(path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise
    return fd


def release(lock: RunLock) -> None:
    lock.record.unlink(missing_ok=True)  # first: a coordinator that finds the folder free rewrites it
    os.close(lock.fd)  # closing the last descriptor of the open folder releases the lock


def describe(record: Path) -> str:
    try:
        holder = json.loads(record.read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder["since"]))
        return f"pid {holder['pid']} on {holder['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "its holder left no record of itself"
