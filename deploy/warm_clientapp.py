"""Warm ClientApp launches: Flower's own `flwr-clientapp`, forked from a process that has
already imported torch, transformers, peft and fedrl's client.

A SuperNode (subprocess isolation) starts a fresh `flwr-clientapp` process for every message,
and importing fedrl's client with peft and transformers takes 8-11 s of CPU on a 2-core
machine, where a round of the tiny model takes about one. A warm launcher pays the imports
once and forks a child per launch; the child runs Flower's `flwr_clientapp()` unchanged, with
the launching process's argv, environment, working directory and stdin/stdout/stderr, and
lives no longer than the shim that asked for it. The SuperNode finds it through a shim named
`flwr-clientapp` first on its PATH (deploy/clientapp_shim.py), which falls back to Flower's
command when no launcher answers.

The socket lives in a fresh 0700 directory, and on Linux a peer of another uid is refused too:
whoever can launch a ClientApp chooses its Runtime API address, and so the code it runs. The
launcher is started by `fedrl supernode` just before it becomes `flower-supernode`, or by a
caller that keeps it and hands it to the SuperNodes it starts (`--warm-launcher`: a volunteer's
session, a local deployment), which starts it again where those SuperNodes look if it dies
(`LauncherKeeper`); it exits when the process that started it does, and a killed launcher's
socket is simply not answered.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from fedrl.deploy.federation import tool
from fedrl.deploy.parent_watch import orphaned

ENTRY = "flwr.supernode.cli.flwr_clientapp:flwr_clientapp"  # Flower's own `flwr-clientapp`
PRELOAD = ("torch", "transformers", "peft", "fedrl.lora", "fedrl.clients.client_app")
PREFIX, SOCKET, PID = "fedrl-warm-", "launcher.sock", "pid"
SHIM = Path(__file__).with_name("clientapp_shim.py")
MAX_REQUEST = 1 << 20


@dataclass(frozen=True)
class WarmLauncher:
    """A launcher's directory (its socket and the shim) and how to start it and a SuperNode."""

    directory: Path
    entry: str = ENTRY
    preload: tuple[str, ...] = PRELOAD

    @classmethod
    def create(cls, entry: str = ENTRY, preload: tuple[str, ...] = PRELOAD) -> WarmLauncher:
        prune_killed()
        launcher = cls(Path(tempfile.mkdtemp(prefix=PREFIX)), entry, preload)  # 0700
        launcher.install_shim()
        return launcher

    def install_shim(self) -> None:
        (self.directory / "bin").mkdir(exist_ok=True)
        shim = self.directory / "bin" / "flwr-clientapp"
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{SHIM}" "$@"\n')
        shim.chmod(0o700)

    def revive(self) -> None:
        """Ready this launcher's directory for a new launcher after the last one died: the
        SuperNodes it was handed find it by this path. A launcher that exited took its directory
        along; it is made again only if the name is free (mkdir is exclusive), and a directory
        that is there must be this user's own, 0700 (else ValueError): whoever serves the socket
        gets each launch's environment. The dead launcher's pid and socket go, so that no
        launch takes it for alive."""
        try:
            self.directory.mkdir(mode=0o700)
        except FileExistsError:
            if not owned(self.directory):
                raise ValueError(f"{self.directory} is no longer this user's launcher directory") from None
        for stale in (PID, SOCKET):
            (self.directory / stale).unlink(missing_ok=True)
        self.install_shim()

    @property
    def socket_path(self) -> Path:
        return self.directory / SOCKET

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "fedrl.deploy.warm_clientapp", str(self.socket_path)]
        return argv + ["--entry", self.entry, "--preload", ",".join(self.preload)]

    def start(self, env: dict[str, str], **popen) -> subprocess.Popen:
        """The launcher as a child of this process, with `env` (the thread and memory limits of
        the ClientApps it forks); it exits when this process does."""
        return subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, env=env, **popen)

    def env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` for a SuperNode whose ClientApps this launcher starts."""
        return {
            **env,
            "PATH": f"{self.directory / 'bin'}{os.pathsep}{env.get('PATH', '')}",
            "FEDRL_WARM_SOCKET": str(self.socket_path),
            "FEDRL_FLWR_CLIENTAPP": tool("flwr-clientapp"),  # Flower's own, for the shim's fallback
        }

    def ready(self) -> bool:
        return self.socket_path.exists()

    @classmethod
    def running_at(cls, directory: Path) -> WarmLauncher:
        """The launcher whose directory is `directory`, started by whoever passes it (a volunteer's
        session keeps one across its SuperNode's restarts); ValueError for anything else."""
        directory = Path(directory)
        if not owned(directory) or not (directory / "bin" / "flwr-clientapp").is_file():
            raise ValueError(f"--warm-launcher {directory}: not the directory of a launcher of this user's")
        return cls(directory)


RESTART_S = 30.0  # the least time between two starts of a kept launcher
QUICK_DEATHS = 3  # launchers in a row that died within RESTART_S of their start: left down then


class LauncherKeeper:
    """The launcher of an owner that hands it to its SuperNodes (a volunteer's session, a local
    deployment): started with the first SuperNode, and started again in the same directory if
    it dies, so that the SuperNodes keep their warm launches. At most once every RESTART_S, and
    after QUICK_DEATHS launchers in a row that died within RESTART_S of their start (at their
    imports: a memory cap too small, a broken install) not again: each try costs seconds of CPU
    on a machine lent to the federation. While it is down, launches start cold. `start` runs a
    launcher's argv as the owner runs its processes; `make` makes a launcher's directory."""

    def __init__(
        self,
        start: Callable[[list[str]], subprocess.Popen],
        make: Callable[[], WarmLauncher] = WarmLauncher.create,
    ):
        self.start, self.make = start, make
        self.warm: WarmLauncher | None = None
        self.proc: subprocess.Popen | None = None
        self.started_at, self.died_at = -RESTART_S, None
        self.quick_deaths = 0

    def ensure(self) -> str | None:
        """Start the launcher if there is none yet, or again if it died (see the class); a line
        saying what happened if it had died, else None."""
        if self.proc is not None and self.proc.poll() is None:
            return None
        if self.quick_deaths >= QUICK_DEATHS:
            return None  # left down
        if self.proc is not None and self.died_at is None:
            self.died_at = time.monotonic()  # as first seen: the owner looks every second or so
        if time.monotonic() - self.started_at < RESTART_S:
            return None
        note = None
        if self.warm is None:
            self.warm = self.make()
        else:
            quick = self.died_at - self.started_at < RESTART_S
            self.quick_deaths = self.quick_deaths + 1 if quick else 0
            note = f"the warm ClientApp launcher exited with {self.proc.returncode}"
            if self.quick_deaths >= QUICK_DEATHS:
                return f"{note}, {QUICK_DEATHS} in a row within {RESTART_S:g} s of their start: left down"
            note += ": started again"
            try:
                self.warm.revive()
            except (ValueError, OSError) as err:
                # the SuperNodes handed this one launch cold from now on; later ones get the new
                self.warm = self.make()
                note += f" in a new directory, for SuperNodes started from now on ({err})"
        self.proc = self.start(self.warm.argv())
        # its pid at once, as it will write it: a launch in the meantime waits for it instead of
        # starting cold, and no prune takes the directory for a dead launcher's
        (self.warm.directory / PID).write_text(str(self.proc.pid))
        self.started_at, self.died_at = time.monotonic(), None
        return note


def owned(directory: Path) -> bool:
    """A directory of this user's that no one else may enter (itself, not a link to one)."""
    try:
        st = directory.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077 == 0


def prune_killed() -> None:
    """Remove the directories that killed launchers left (a launcher that exits removes its own)."""
    for directory in Path(tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            if owned(directory) and not psutil.pid_exists(int((directory / PID).read_text())):
                shutil.rmtree(directory, ignore_errors=True)
        except (OSError, ValueError):  # not started yet
            pass


def exec_with_launcher(argv: list[str], env: dict[str, str], launcher: WarmLauncher | None = None) -> None:
    """Become `argv` (a SuperNode: `flower-supernode ...`) whose ClientApps `launcher` forks, or
    without one a fresh launcher as a child that goes when it does; never returns."""
    if launcher is None:
        launcher = WarmLauncher.create()
        launcher.start(env)
    os.execve(argv[0], argv, launcher.env(env))


# ---------------------------------------------------------------------------- the launcher


def resolve(entry: str):
    module, _, name = entry.partition(":")
    return getattr(importlib.import_module(module), name)


def receive(conn: socket.socket) -> tuple[list[int], dict]:
    """The shim's file descriptors and request; ValueError for anything else."""
    if hasattr(socket, "SO_PEERCRED"):  # Linux; elsewhere the 0700 directory alone keeps others out
        pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            raise ValueError(f"refused a launch from pid {pid}: uid {uid} is not this launcher's")
    conn.settimeout(10.0)
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    try:
        size = int.from_bytes(read_exactly(conn, 4), "big")
        if size > MAX_REQUEST:
            raise ValueError(f"a launch request of {size} bytes")
        request = json.loads(read_exactly(conn, size))
        if len(fds) != 3 or set(request) != {"argv", "env", "cwd"}:
            raise ValueError("a launch request without stdin/stdout/stderr, argv, env and cwd")
    except (ValueError, OSError):
        for fd in fds:
            os.close(fd)
        raise
    conn.settimeout(None)
    return fds, request


def read_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ValueError("the launch request ended early")
        data += chunk
    return data


def run_child(conn: socket.socket, fds: list[int], request: dict, entry) -> None:
    """In the forked child: become the launching process and run `entry`; never returns."""
    code = 1
    try:
        # a fresh Python's dispositions, which the launcher changed for itself
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["flwr-clientapp", *request["argv"]]
        conn.sendall(f"{os.getpid()}\n".encode())
        threading.Thread(target=go_with_the_shim, args=(conn,), daemon=True).start()
        try:
            entry()
            code = 0
        except SystemExit as done:
            code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # everything, so that the child never returns into the accept loop
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
            conn.sendall(f"{code}\n".encode())
        except BaseException:
            pass
        os._exit(code)


def go_with_the_shim(conn: socket.socket) -> None:
    """In the forked child: SIGKILL itself once the shim's end of the connection closes. The shim
    holds it until it has the exit code, and it is what the SuperNode started, in the SuperNode's
    process group: a node killed with its group takes its ClientApps along at once, as cold
    ones go, rather than after Flower's parent watch (whose SIGINT waits out a connection
    retry's backoff: 14 s once here)."""
    try:
        while conn.recv(1):  # the shim sends nothing after its request
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def serve(socket_path: Path, entry_ref: str, preload: list[str]) -> None:
    started, parent = time.monotonic(), os.getppid()
    for signum in (signal.SIGTERM, signal.SIGINT):  # to the finally below, quietly
        signal.signal(signum, lambda signum, frame: sys.exit(0))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        (socket_path.parent / PID).write_text(str(os.getpid()))
        for name in preload:
            importlib.import_module(name)
        entry = resolve(entry_ref)
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped by the kernel
        listener.settimeout(1.0)
        listener.bind(str(socket_path) + ".new")
        listener.listen(16)
        os.rename(str(socket_path) + ".new", socket_path)  # appears only once it accepts
        print(f"warm ClientApp launcher ready in {time.monotonic() - started:.1f} s", flush=True)
        while not orphaned(parent):
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            try:
                fds, request = receive(conn)
            except (OSError, ValueError) as err:
                print(f"warm ClientApp launcher: {err}", flush=True)
                conn.close()
                continue
            try:
                child = os.fork()
            except OSError as err:  # the shim sees no child and runs Flower's own command
                print(f"warm ClientApp launcher: cannot fork: {err}", flush=True)
                child = -1
            if child == 0:
                listener.close()
                run_child(conn, fds, request, entry)
            for fd in fds:
                os.close(fd)
            conn.close()
    finally:
        listener.close()
        # the shim goes with the socket: a SuperNode that outlives its launcher finds Flower's own
        shutil.rmtree(socket_path.parent, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("socket", type=Path)
    parser.add_argument("--entry", default=ENTRY, help="module:function a child runs")
    parser.add_argument("--preload", default=",".join(PRELOAD), help="modules to import once")
    args = parser.parse_args()
    serve(args.socket, args.entry, [name for name in args.preload.split(",") if name])


if __name__ == "__main__":
    main()
