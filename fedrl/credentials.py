"""Credentials for the patch store: expiring HMAC tokens derived from one coordinator secret,
and requests signed with them.

A token is `<expires>.<mac>`: HMAC(secret, principal and expiry time). The coordinator hands
each node a fresh one inside every (authenticated, TLS) control-plane message; the store
recomputes it, so uploads are bound to the node that made them, and a token stops opening
anything at its expiry. The token itself never travels to the store: each request carries its
time, a random nonce and an HMAC of method, path, body digest, time and nonce keyed by the
token (as AWS SigV4 does), so a captured request cannot be replayed (the store remembers
nonces for the window in which it accepts a request's time) nor altered.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import threading
import time
from collections.abc import Callable
from pathlib import Path

ADMIN = "admin"
INVITE_PREFIX = "invite:"  # an invite's credential: it may enroll a node key and probe the link


MIN_SECRET_BYTES = 16
NODE_TOKEN_TTL_S = 3600.0  # a node's token is renewed with every instruction
ADMIN_TOKEN_TTL_S = 600.0  # holders of the secret mint a fresh one per request
CLOCK_SKEW_S = 300.0  # a request's time may differ this much from the store's clock
UNSIGNED_BODY = "streamed"  # a body bound otherwise (an object's name is its hash) or not at all


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


class CredentialError(ValueError):
    """A request's credential does not open what it asks for; the message says why."""


class ReplayWindowFull(CredentialError):
    """The store holds as many unexpired nonces as it may: the request is fine, retry later."""


def _mac(key: bytes, message: str) -> str:
    return hmac.new(key, message.encode(), hashlib.sha256).hexdigest()


def _token(secret: bytes, principal: str, expires: int) -> str:
    return f"{expires}.{_mac(secret, f'fedrl-store:{principal}:{expires}')}"


def token_for(
    secret: bytes, principal: str, ttl_s: float = NODE_TOKEN_TTL_S, now: float | None = None
) -> str:
    """A token for `principal` that expires `ttl_s` seconds from `now`."""
    return _token(secret, principal, int((time.time() if now is None else now) + ttl_s))


def token_source(secret: bytes, principal: str = ADMIN) -> Callable[[], str]:
    """For holders of the secret (coordinator, approver): a fresh short-lived token each call."""
    return lambda: token_for(secret, principal, ADMIN_TOKEN_TTL_S)


def token_expires(token: str) -> int:
    try:
        return int(token.split(".", 1)[0])
    except ValueError:
        raise CredentialError("malformed token: expected <expires>.<mac>") from None


def body_digest(body: bytes | None) -> str:
    return hashlib.sha256(body).hexdigest() if body is not None else UNSIGNED_BODY


def _request_message(
    method: str, path: str, principal: str, expires: int, when: str, nonce: str, body: str
) -> str:
    return "\n".join(["fedrl-request", method.upper(), path, principal, str(expires), when, nonce, body])


def sign_request(
    principal: str, token: str, method: str, path: str, body: bytes | None = None, now: float | None = None
) -> dict[str, str]:
    """The headers that authenticate one request (`path` with its query string)."""
    when = f"{time.time() if now is None else now:.3f}"
    nonce, digest, expires = secrets.token_hex(16), body_digest(body), token_expires(token)
    message = _request_message(method, path, principal, expires, when, nonce, digest)
    return {
        "X-Principal": principal,
        "X-Fedrl-Expires": str(expires),
        "X-Fedrl-Time": when,
        "X-Fedrl-Nonce": nonce,
        "X-Fedrl-Body-SHA256": digest,
        "Authorization": f"Fedrl-HMAC {_mac(token.encode(), message)}",
    }


class ReplayGuard:
    """Nonces seen within the accepted time window, so each signed request opens once. Bounded:
    entries older than the window are dropped, and past `max_nonces` new requests wait."""

    def __init__(self, window_s: float = CLOCK_SKEW_S, max_nonces: int = 200_000):
        self.window_s, self.max_nonces = window_s, max_nonces
        self.seen: dict[str, float] = {}
        self.lock = threading.Lock()

    def admit(self, nonce: str, when: float, now: float) -> None:
        """Use the nonce up, or a CredentialError: malformed, replayed, or no room (retry)."""
        if not 16 <= len(nonce) <= 64:
            raise CredentialError("nonce must be 16-64 characters")
        with self.lock:
            if len(self.seen) >= self.max_nonces:
                # a nonce whose time is outside the window can never be accepted again anyway
                self.seen = {n: t for n, t in self.seen.items() if t >= now - self.window_s}
                if len(self.seen) >= self.max_nonces:
                    raise ReplayWindowFull("too many requests in the replay window; retry shortly")
            if nonce in self.seen:
                raise CredentialError("this request was already used (replayed nonce)")
            self.seen[nonce] = when


def verify_request(
    secret: bytes, headers, method: str, path: str, guard: ReplayGuard, now: float | None = None
) -> str:
    """The principal a request's signed headers prove, or a CredentialError saying why not."""
    now = time.time() if now is None else now
    auth, principal = headers.get("Authorization", ""), headers.get("X-Principal", "")
    if not auth.startswith("Fedrl-HMAC ") or not principal:
        raise CredentialError("missing credential: sign the request (fedrl.credentials.sign_request)")
    raw_when = headers.get("X-Fedrl-Time", "")  # signed as sent, not as parsed
    try:
        expires, when = int(headers.get("X-Fedrl-Expires", "")), float(raw_when)
    except ValueError:
        raise CredentialError("X-Fedrl-Expires and X-Fedrl-Time must be numbers") from None
    nonce, digest = headers.get("X-Fedrl-Nonce", ""), headers.get("X-Fedrl-Body-SHA256", "")
    token = _token(secret, principal, expires)
    message = _request_message(method, path, principal, expires, raw_when, nonce, digest)
    if not hmac.compare_digest(_mac(token.encode(), message), auth.removeprefix("Fedrl-HMAC ")):
        raise CredentialError(f"credential does not verify for {principal!r}")
    if expires < now:
        raise CredentialError(f"the token of {principal!r} expired {now - expires:.0f} s ago")
    if abs(when - now) > guard.window_s:
        raise CredentialError(
            f"request time is {when - now:+.0f} s from the store's clock (allowed ±{guard.window_s:g} s)"
        )
    guard.admit(nonce, when, now)
    return principal


def check_body(headers, body: bytes) -> None:
    """A signed request's body is the one it was signed with."""
    if not hmac.compare_digest(headers.get("X-Fedrl-Body-SHA256", ""), body_digest(body)):
        raise CredentialError("the body is not the one the request was signed with")


NODE_PREFIX = "node-"  # a node's credential: it uploads, reads the catalog and its own ledger row


def node_principal(node_id: int) -> str:
    return f"{NODE_PREFIX}{int(node_id)}"


def invite_principal(run: str) -> str:
    return f"{INVITE_PREFIX}{run}"
