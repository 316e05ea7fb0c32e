"""A TCP port to start a server on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now (the kernel's pick among its ephemeral ports), for a server started next."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
