"""`flwr-clientapp` as a SuperNode with a warm launcher sees it (fedrl.deploy.warm_clientapp).

Standard library only, run with `python -S`: it starts in milliseconds. It hands its argv,
environment, working directory and stdin/stdout/stderr to the launcher listening on
$FEDRL_WARM_SOCKET, forwards SIGTERM, SIGINT and SIGHUP to the child the launcher forked, and
exits with the child's code. A launcher still importing is waited for (a cold start would
import the same modules beside it, on the same cores). When no launcher answers before a child
exists, it execs Flower's own command ($FEDRL_FLWR_CLIENTAPP): a launcher that died costs speed,
not a message.
"""

import json
import os
import signal
import socket
import sys
import time

STARTING_WAIT_S = 60.0  # the longest a launch waits for a launcher to finish its imports


def fall_back() -> None:
    real = os.environ["FEDRL_FLWR_CLIENTAPP"]
    os.execv(real, [real, *sys.argv[1:]])


def starting(socket_path: str) -> bool:
    """The launcher is alive but not listening yet: it writes its pid before it imports."""
    try:
        with open(os.path.join(os.path.dirname(socket_path), "pid")) as f:
            os.kill(int(f.read()), 0)
        return True
    except (OSError, ValueError):
        return False


def connect(socket_path: str) -> socket.socket:
    deadline = time.monotonic() + STARTING_WAIT_S
    while True:
        launcher = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            launcher.connect(socket_path)
            return launcher
        except (FileNotFoundError, ConnectionRefusedError):
            launcher.close()
            if time.monotonic() > deadline or not starting(socket_path):
                raise
            time.sleep(0.1)


def main() -> int:
    child, pending = 0, []

    def forward(signum, frame) -> None:  # from the start: a signal may come before the child
        if not child:
            pending.append(signum)
            return
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, forward)
    request = {"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}
    payload = json.dumps(request).encode()
    try:
        launcher = connect(os.environ["FEDRL_WARM_SOCKET"])
        socket.send_fds(launcher, [b"F"], [0, 1, 2])
        launcher.sendall(len(payload).to_bytes(4, "big") + payload)
        replies = launcher.makefile("rb")
        pid_line = replies.readline()
    except (OSError, KeyError):
        pid_line = b""
    if not pid_line.strip():
        if pending:  # told to stop before anything ran
            return 128 + pending[0]
        fall_back()
    child = int(pid_line)
    for signum in pending:
        forward(signum, None)
    code = replies.readline().strip()
    return int(code) if code else 1  # no code: the child was killed


if __name__ == "__main__":
    sys.exit(main())
