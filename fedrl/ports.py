"""A TCP port to start a server on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (the kernel's pick among its ephemeral ports), for a server started next."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """OSError naming the port when a server could not listen on it now, so that a command which
    starts other work first (Ray, a deployment's services) fails before it. Connections of a
    stopped server that linger in TIME_WAIT do not count: servers bind with SO_REUSEADDR, and so
    does this check."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            raise OSError(f"port {host}:{port}: {err.strerror}") from None
