"""A TCP port to start a server on."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1", port: int = 0) -> int:
    """A port free now, for a server started next: `port` itself (an OSError that says why not, before
    any work starts) or, for 0, the kernel's pick among its ephemeral ports."""
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as err:
            raise OSError(err.errno, f"cannot listen on {host}:{port}: {err.strerror}") from None
        return s.getsockname()[1]
