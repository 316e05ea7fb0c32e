"""Helper processes that go when the process that started them goes.

A volunteer's session starts its node's SuperNode and warm ClientApp launcher. Killed outright
(SIGKILL, the OOM killer, a crash in C), the session stops neither, and a SuperNode left behind
goes on working for the federation unsupervised (no memory cap watched, no status, `fedrl
volunteer leave` cannot find it) while it holds its key's session on the SuperLink, so that the
volunteer's next `fedrl volunteer join` is refused for as long as it runs. Such a process
watches whether it is still the child of the process that started it: the kernel hands an
orphan to another parent (init or a subreaper), so `getppid` changes at once, on Linux and macOS
alike, and a reused pid cannot fool it.

A program that cannot watch for itself (`flower-superlink` has no such option) runs under
`python -m fedrl.deploy.parent_watch --parent-pid PID -- COMMAND...`, a guard that watches for
it: `fedrl deploy local` killed outright would otherwise leave its SuperLink, with the ServerApp
it started, serving and holding its port.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

EVERY_S = 0.5


def orphaned(parent_pid: int) -> bool:
    """This process is no longer the child of `parent_pid` (or never was)."""
    return os.getppid() != parent_pid


def interrupt_when_orphaned(parent_pid: int, every_s: float = EVERY_S) -> threading.Thread:
    """A daemon thread that sends this process SIGINT once it is orphaned: Flower's SuperNode
    then stops as on Ctrl-C. Call it from the main thread."""
    # a SIGINT ignored or blocked where this process was started (a shell script's background
    # job ignores it, and so may a test runner) is inherited: the interrupt would then be lost
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

    def watch() -> None:
        while not orphaned(parent_pid):
            time.sleep(every_s)
        # to the main thread, where Python handles signals: one raised in this thread would wait
        # for the main thread's next bytecode, after however long a sleep it is in
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread


def guard(argv: list[str], parent_pid: int, every_s: float = EVERY_S, grace_s: float = 15.0) -> int:
    """Run `argv` as this process's child for as long as `parent_pid` is this process's parent,
    and return its exit code. Once orphaned: SIGTERM to the process group this guard leads (what
    the command started goes too), SIGKILL to it after `grace_s`. A signal to the group reaches
    the command as well, so the guard ignores the stopping ones and waits for the command."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    child = subprocess.Popen(argv)
    leads = os.getpgrp() == os.getpid()  # started in a session of its own, as deployments start services

    def send(sig: int) -> None:
        if not leads:
            child.send_signal(sig)
            return
        try:
            os.killpg(os.getpgrp(), sig)
        except ProcessLookupError:
            pass

    while child.poll() is None and not orphaned(parent_pid):
        time.sleep(every_s)
    if child.returncode is None:
        send(signal.SIGTERM)
        try:
            child.wait(grace_s)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)  # the guard goes with its group
            child.wait()
    return child.returncode if child.returncode >= 0 else 128 - child.returncode  # as a shell says a signal


def guarded(argv: list[str], parent_pid: int | None = None) -> list[str]:
    """`argv` run under the guard for `parent_pid` (default: this process)."""
    pid = os.getpid() if parent_pid is None else parent_pid
    return [sys.executable, "-m", "fedrl.deploy.parent_watch", "--parent-pid", str(pid), "--", *argv]


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fedrl.deploy.parent_watch",
        description="run a command for as long as the process with --parent-pid is this one's parent",
    )
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --")
    sys.exit(guard(command, args.parent_pid))


if __name__ == "__main__":
    main()
