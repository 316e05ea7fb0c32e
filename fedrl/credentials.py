"""Node credentials for the patch store: HMAC tokens derived from one coordinator secret.

The coordinator hands each node its token inside its (authenticated, TLS) control-plane
message; the store recomputes it, so uploads are bound to the node that made them.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

ADMIN = "admin"
INVITE_PREFIX = "invite:"  # an invite's credential: it may enroll a node key and probe the link


MIN_SECRET_BYTES = 16


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner can read, atomically (a crash leaves the old file or none)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_secret(path: str | Path) -> bytes:
    """A secret from its file, or a ValueError that says what is wrong with the file."""
    path = Path(path)
    try:
        secret = path.read_bytes().strip()
    except OSError as err:
        raise ValueError(f"cannot read the secret file {path}: {err.strerror or err}") from None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{path} holds {len(secret)} bytes; a secret needs at least {MIN_SECRET_BYTES}")
    return secret


def load_or_create_secret(path: str | Path) -> bytes:
    """The secret in `path`, created (hex, 32 random bytes) the first time: it survives restarts."""
    path = Path(path)
    if not path.exists():
        write_private(path, secrets.token_hex(32).encode() + b"\n")
    return read_secret(path)


def token_for(secret: bytes, principal: str) -> str:
    return hmac.new(secret, f"fedrl-store:{principal}".encode(), hashlib.sha256).hexdigest()


def node_principal(node_id: int) -> str:
    return f"node-{int(node_id)}"


def invite_principal(run: str) -> str:
    return f"{INVITE_PREFIX}{run}"


def check_token(secret: bytes, principal: str, token: str) -> bool:
    return hmac.compare_digest(token_for(secret, principal), token)
