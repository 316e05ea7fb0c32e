"""Node credentials for the patch store: HMAC tokens derived from one coordinator secret.

The coordinator hands each node its token inside its (authenticated, TLS) control-plane
message; the store recomputes it, so uploads are bound to the node that made them.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

ADMIN = "admin"


def new_secret() -> bytes:
    return secrets.token_bytes(32)


def token_for(secret: bytes, principal: str) -> str:
    return hmac.new(secret, f"fedrl-store:{principal}".encode(), hashlib.sha256).hexdigest()


def node_principal(node_id: int) -> str:
    return f"node-{int(node_id)}"


def check_token(secret: bytes, principal: str, token: str) -> bool:
    return hmac.compare_digest(token_for(secret, principal), token)
