"""Helper processes that go when the process that started them goes.

A volunteer's session starts its node's SuperNode and warm ClientApp launcher. Killed outright
(SIGKILL, the OOM killer, a crash in C), the session stops neither, and a SuperNode left behind
goes on working for the federation unsupervised (no memory cap watched, no status, `fedrl
volunteer leave` cannot find it) while it holds its key's session on the SuperLink, so that the
volunteer's next `fedrl volunteer join` is refused for as long as it runs. Such a process
watches whether it is still the child of the process that started it: the kernel hands an
orphan to another parent (init or a subreaper), so `getppid` changes at once, on Linux and macOS
alike, and a reused pid cannot fool it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

EVERY_S = 0.5


def orphaned(parent_pid: int) -> bool:
    """This process is no longer the child of `parent_pid` (or never was)."""
    return os.getppid() != parent_pid


def interrupt_when_orphaned(parent_pid: int, every_s: float = EVERY_S) -> threading.Thread:
    """A daemon thread that sends this process SIGINT once it is orphaned: Flower's SuperNode
    then stops as on Ctrl-C."""

    def watch() -> None:
        while not orphaned(parent_pid):
            time.sleep(every_s)
        # to the main thread, where Python handles signals: one raised in this thread would wait
        # for the main thread's next bytecode, after however long a sleep it is in
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
