"""The patch store: a content-addressed object service on aiohttp (the data plane).

  PUT    /objects/{sha256}        upload; the server recomputes the hash (node or admin credential)
  GET    /objects/{sha256}        download
  GET    /objects/{sha256}/meta   size and the principals that uploaded it
  DELETE /objects/{sha256}        admin only; ?principal=P releases only P's upload of it
  GET    /catalog                 published global patches: refs, latest version, public key;
                                   ?target=T[&held=V]: only the refs of the routes from V (or from
                                   nothing) to T, what a node syncing to T needs (fedrl.patch_routes);
                                   &plans=N: only the first N routes (a node asks for the rest when
                                   they fail)
  POST   /catalog                 admin only: replace the catalog (objects it drops are deleted)
  POST   /enroll                  an invite's holder asks to join: {"public_key", "name"}
  GET    /enroll/{fingerprint}    that request's status: pending, approved or refused (invite)
  GET    /enroll                  admin only: every request, for the operator's approver
  POST   /enroll/{fingerprint}    admin only: {"status": "approved" | "refused", "reason"}
  GET    /probe?bytes=N           N random bytes (N <= 16 MiB), to measure a link's download
  POST   /probe                   a body that is read and dropped, to measure a link's upload
  GET    /health, /metrics        liveness with what it holds; Prometheus metrics (fedrl.store_metrics)

Credentials: every request but /health and /metrics is signed with an expiring token
(fedrl.credentials.sign_request) as `node-<id>`, `admin`, or `invite:<run>` (what `fedrl
invite` hands to volunteers: it may enroll a key and probe, nothing else); a signed request
opens once (its nonce is remembered), within the clock skew of its time, before its token expires.
Every read of objects and the catalog needs one too: a node reads the coordinator's objects and
its own uploads, and only the coordinator reads an object's uploaders.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from fedrl.background_app import BackgroundApp
from fedrl.credentials import (
    ADMIN,
    INVITE_PREFIX,
    NODE_PREFIX,
    CredentialError,
    ReplayGuard,
    ReplayWindowFull,
    check_body,
    verify_request,
)
from fedrl.node_files import read_json, write_json
from fedrl.patch_routes import routes_in
from fedrl.signing import key_fingerprint_ssh
from fedrl.store_metrics import StoreMetrics

HASH_CHARS = set("0123456789abcdef")
REF_FIELDS = {"base_version", "target_version", "size", "key"}
MAX_PROBE_BYTES = 16 << 20
MAX_ENROLLMENTS = 1000
ENROLL_STATUS = ("pending", "approved", "refused")
ENROLLMENTS_FILE = "enrollments.json"
log = logging.getLogger("fedrl.patch_store")


@dataclass
class StoredObject:
    data: bytes
    uploaders: set[str]  # two nodes may upload identical bytes: each upload stays bound to its node


@dataclass
class StoreState:
    secret: bytes
    max_object_bytes: int = 256 << 20
    max_total_bytes: int = 4 << 30
    max_node_bytes: int = 512 << 20  # what one node's uploads may hold at once
    # bodies being received are held too: their sum is bounded, and a body that stops coming is dropped
    max_receiving_bytes: int = 512 << 20
    upload_idle_s: float = 60.0
    receiving: int = 0  # bytes of bodies being received now (the server's one event loop updates it)
    objects: dict[str, StoredObject] = field(default_factory=dict)
    catalog: dict = field(default_factory=lambda: {"latest": None, "refs": [], "public_key": None})
    enrollments: dict[str, dict] = field(default_factory=dict)  # fingerprint -> request
    ledger: dict[str, dict] = field(default_factory=dict)  # node principal -> its row (fedrl.ledger)
    nonces: ReplayGuard = field(default_factory=ReplayGuard)
    # where enrollments outlive the process (`fedrl patch-store --state-dir`); None: memory only
    enrollments_file: Path | None = None

    def load_enrollments(self) -> None:
        """The enrollments a previous run of the store kept; a clear error for a damaged file."""
        if self.enrollments_file is None:
            return
        kept = read_json(self.enrollments_file)
        if kept is None:
            return
        entries = kept.get("enrollments")
        fields = {"fingerprint", "public_key", "name", "invite", "status", "reason"}
        if not isinstance(entries, list) or not all(
            isinstance(e, dict) and set(e) == fields and e["status"] in ENROLL_STATUS for e in entries
        ):
            raise ValueError(f"{self.enrollments_file} does not hold the store's enrollments")
        self.enrollments = {e["fingerprint"]: e for e in entries}

    def save_enrollments(self) -> None:
        if self.enrollments_file is not None:
            write_json(self.enrollments_file, {"enrollments": list(self.enrollments.values())})

    @property
    def total_bytes(self) -> int:
        return sum(len(o.data) for o in self.objects.values())

    def held_by(self, principal: str) -> int:
        return sum(len(o.data) for o in self.objects.values() if principal in o.uploaders)

    def room_for(self, principal: str, size: int) -> str | None:
        """Why an upload of `size` bytes by `principal` does not fit, or None. Nodes share three
        quarters of the store, each within its own quota: the coordinator's publishes always fit."""
        if self.total_bytes + size > self.max_total_bytes:
            return "store is full"
        if principal == ADMIN:
            return None
        if self.held_by(principal) + size > self.max_node_bytes:
            return f"{principal} is over its quota of {self.max_node_bytes} bytes"
        if self.total_bytes + size > self.max_total_bytes * 3 // 4:
            return "the rest of the store is reserved for the coordinator"
        return None


def _digest(request: web.Request) -> str:
    digest = request.match_info["digest"]
    if len(digest) != 64 or set(digest) - HASH_CHARS:
        raise web.HTTPBadRequest(text="object names are lowercase hex SHA-256 digests (64 characters)")
    return digest


def _whole_number(request: web.Request, name: str) -> int | None:
    """A version number or count from the query (absent: None)."""
    text = request.query.get(name)
    if text is None:
        return None
    if not (text.isascii() and text.isdigit()) or len(text) > 18:
        raise web.HTTPBadRequest(text=f"{name} must be a whole number (an integer >= 0), got {text[:20]!r}")
    return int(text)


def _principal(request: web.Request, state: StoreState, admin: bool = False, invite_ok: bool = False) -> str:
    """The verified principal. An invite's credential only opens what `invite_ok` allows."""
    if "Authorization" not in request.headers:
        raise web.HTTPUnauthorized(text="missing credential: sign the request (fedrl.credentials)")
    try:
        principal = verify_request(
            state.secret, request.headers, request.method, request.raw_path, state.nonces
        )
    except ReplayWindowFull as err:
        raise web.HTTPServiceUnavailable(text=str(err), headers={"Retry-After": "5"}) from None
    except CredentialError as err:
        raise web.HTTPForbidden(text=str(err)) from None
    if admin and principal != ADMIN:
        raise web.HTTPForbidden(text="this operation needs the coordinator's credential")
    if principal.startswith(INVITE_PREFIX) and not invite_ok:
        raise web.HTTPForbidden(text="an invite may only enroll a key and probe the link")
    return principal


async def _signed_json(request: web.Request, what: str):
    """A JSON body that is the one the request was signed with."""
    body = await request.read()
    try:
        check_body(request.headers, body)
    except CredentialError as err:
        raise web.HTTPForbidden(text=str(err)) from None
    try:
        return json.loads(body)
    except ValueError:
        raise web.HTTPBadRequest(text=f"{what} must be JSON") from None


def _fingerprint(request: web.Request, state: StoreState) -> str:
    fingerprint = request.match_info["fingerprint"]
    if fingerprint not in state.enrollments:
        raise web.HTTPNotFound(text="no enrollment with this fingerprint")
    return fingerprint


@web.middleware
async def log_refusals(request: web.Request, handler):
    """Every refused request leaves one line with who asked, what and why."""
    try:
        return await handler(request)
    except web.HTTPException as err:
        if err.status >= 400:
            who = request.headers.get("X-Principal", "anonymous")[:40]
            log.warning(
                "refused %s %s from %s (%s): HTTP %d %s",
                request.method,
                request.path[:80],
                who,
                request.remote,
                err.status,
                (err.text or err.reason)[:200],
            )
        raise


async def receive_body(request: web.Request, state: StoreState) -> bytes:
    """The body of an upload, with memory bounded: at most `max_object_bytes` for one body and
    `max_receiving_bytes` for all bodies in flight (503, retry later), and a body that sends
    nothing for `upload_idle_s` is dropped (408) instead of holding its handler open."""
    chunks, size = [], 0
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(request.content.readany(), state.upload_idle_s)
            except TimeoutError:
                raise web.HTTPRequestTimeout(
                    text=f"upload sent nothing for {state.upload_idle_s:g} s after {size} bytes"
                ) from None
            if not chunk:
                return b"".join(chunks)
            size += len(chunk)
            if size > state.max_object_bytes:
                raise web.HTTPRequestEntityTooLarge(max_size=state.max_object_bytes, actual_size=size)
            if state.receiving + len(chunk) > state.max_receiving_bytes:
                raise web.HTTPServiceUnavailable(
                    text="the store is receiving too many uploads at once; retry shortly",
                    headers={"Retry-After": "5"},
                )
            state.receiving += len(chunk)
            chunks.append(chunk)
    finally:
        state.receiving -= sum(len(c) for c in chunks)


def make_app(state: StoreState) -> web.Application:
    routes = web.RouteTableDef()
    metrics = StoreMetrics(lambda: len(state.objects), lambda: state.total_bytes)

    @routes.get("/metrics")
    async def prometheus(request):
        return web.Response(body=metrics.text(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    @routes.get("/health")
    async def health(request):
        return web.json_response({"ok": True, "objects": len(state.objects), "bytes": state.total_bytes})

    @routes.put("/objects/{digest}")
    async def put(request):
        digest = _digest(request)
        principal = _principal(request, state)
        if request.content_length is not None and request.content_length > state.max_object_bytes:
            raise web.HTTPRequestEntityTooLarge(
                max_size=state.max_object_bytes, actual_size=request.content_length
            )
        body = await receive_body(request, state)
        if hashlib.sha256(body).hexdigest() != digest:
            raise web.HTTPBadRequest(text="body does not hash to the object name")
        if digest in state.objects:
            state.objects[digest].uploaders.add(principal)
            return web.json_response({"digest": digest, "stored": False}, status=200)
        refused = state.room_for(principal, len(body))
        if refused:
            raise web.HTTPInsufficientStorage(text=refused)
        state.objects[digest] = StoredObject(body, {principal})
        return web.json_response({"digest": digest, "stored": True}, status=201)

    @routes.get("/objects/{digest}")
    async def get(request):
        principal = _principal(request, state)
        obj = state.objects.get(_digest(request))
        if obj is None:
            raise web.HTTPNotFound(text="no such object")
        # a node reads what the coordinator published and its own uploads, never another node's
        # (it could otherwise upload the same bytes and claim that node's delta)
        if principal != ADMIN and ADMIN not in obj.uploaders and principal not in obj.uploaders:
            raise web.HTTPForbidden(text=f"this object was uploaded by another node, not by {principal}")
        return web.Response(body=obj.data, content_type="application/octet-stream")

    @routes.get("/objects/{digest}/meta")
    async def meta(request):
        _principal(request, state, admin=True)
        obj = state.objects.get(_digest(request))
        if obj is None:
            raise web.HTTPNotFound(text="no such object")
        return web.json_response({"size": len(obj.data), "uploaders": sorted(obj.uploaders)})

    @routes.delete("/objects/{digest}")
    async def delete(request):
        _principal(request, state, admin=True)
        digest = _digest(request)
        obj = state.objects.get(digest)
        if obj is not None and "principal" in request.query:
            obj.uploaders.discard(request.query["principal"])
        published = any(r["key"] == digest for r in state.catalog["refs"])
        deleted = (
            obj is not None and not published and ("principal" not in request.query or not obj.uploaders)
        )
        if deleted:
            del state.objects[digest]
        return web.json_response({"deleted": deleted})

    @routes.post("/enroll")
    async def enroll(request):
        principal = _principal(request, state, invite_ok=True)
        body = await _signed_json(request, "an enrollment")
        try:
            fingerprint = key_fingerprint_ssh(body["public_key"])
            name = str(body.get("name", ""))[:64]
        except (ValueError, KeyError, TypeError) as err:
            raise web.HTTPBadRequest(text=f"enrollment needs an OpenSSH public key: {err}") from None
        if fingerprint not in state.enrollments:
            if len(state.enrollments) >= MAX_ENROLLMENTS:
                raise web.HTTPInsufficientStorage(text="too many enrollment requests")
            state.enrollments[fingerprint] = {
                "fingerprint": fingerprint,
                "public_key": body["public_key"].strip(),
                "name": name,
                "invite": principal,
                "status": "pending",
                "reason": "",
            }
            state.save_enrollments()
        return web.json_response(state.enrollments[fingerprint])

    @routes.get("/enroll/{fingerprint}")
    async def enrollment(request):
        _principal(request, state, invite_ok=True)
        return web.json_response(state.enrollments[_fingerprint(request, state)])

    @routes.get("/enroll")
    async def enrollments(request):
        _principal(request, state, admin=True)
        return web.json_response(list(state.enrollments.values()))

    @routes.post("/enroll/{fingerprint}")
    async def decide(request):
        _principal(request, state, admin=True)
        entry = state.enrollments[_fingerprint(request, state)]
        body = await _signed_json(request, "a decision")
        try:
            status, reason = body["status"], str(body.get("reason", ""))[:300]
        except (ValueError, KeyError, TypeError):
            raise web.HTTPBadRequest(text='send {"status": "approved" | "refused", "reason": ...}') from None
        if status not in ENROLL_STATUS[1:]:
            raise web.HTTPBadRequest(text=f"status must be approved or refused, got {status!r}")
        entry.update(status=status, reason=reason)
        state.save_enrollments()
        return web.json_response(entry)

    @routes.post("/ledger")
    async def post_ledger(request):
        """The coordinator's ledger rows that changed, by node principal; merged into the rest."""
        _principal(request, state, admin=True)
        rows = await _signed_json(request, "the ledger")
        if not isinstance(rows, dict) or not all(
            isinstance(k, str) and k.startswith(NODE_PREFIX) and isinstance(v, dict) for k, v in rows.items()
        ):
            raise web.HTTPBadRequest(text="the ledger must be JSON: {node principal: its row}")
        state.ledger.update(rows)
        return web.json_response({"rows": len(rows)})

    @routes.get("/ledger")
    async def get_ledger(request):
        """A node's own row, and no one else's (null until the coordinator has published one)."""
        principal = _principal(request, state)
        return web.json_response({"row": state.ledger.get(principal)})

    @routes.get("/probe")
    async def probe_down(request):
        _principal(request, state, invite_ok=True)
        try:
            size = int(request.query.get("bytes", "0"))
        except ValueError:
            raise web.HTTPBadRequest(text="bytes must be an integer") from None
        if not 0 <= size <= MAX_PROBE_BYTES:
            raise web.HTTPBadRequest(text=f"bytes must be in [0, {MAX_PROBE_BYTES}]")
        return web.Response(body=os.urandom(size), content_type="application/octet-stream")

    @routes.post("/probe")
    async def probe_up(request):
        _principal(request, state, invite_ok=True)
        size = 0
        async for chunk in request.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > MAX_PROBE_BYTES:
                raise web.HTTPRequestEntityTooLarge(max_size=MAX_PROBE_BYTES, actual_size=size)
        return web.json_response({"bytes": size})

    @routes.get("/catalog")
    async def get_catalog(request):
        _principal(request, state)
        if "target" not in request.query:
            return web.json_response(state.catalog)
        target, held = _whole_number(request, "target"), _whole_number(request, "held")
        plans = _whole_number(request, "plans")
        if plans == 0:
            raise web.HTTPBadRequest(text="plans must be at least 1 (leave it out for every route)")
        # neither the public key nor the latest version: the node has the key from its instruction,
        # and `latest` moves with publishes, so a metered answer that carried it would weigh what
        # the moment of reading decided (a virtual-clock run's bytes then varied between runs)
        return web.json_response(routes_in(state.catalog["refs"], held, target, plans))

    @routes.post("/catalog")
    async def post_catalog(request):
        _principal(request, state, admin=True)
        catalog = await _signed_json(request, "the catalog")
        try:
            refs = catalog["refs"]
            ok = isinstance(refs, list) and all(
                isinstance(r, dict)
                and set(r) == REF_FIELDS
                and r["key"] in state.objects
                and all(type(r[f]) is int and r[f] >= 0 for f in ("target_version", "size"))
                and (r["base_version"] is None or (type(r["base_version"]) is int and r["base_version"] >= 0))
                for r in refs
            )
        except (ValueError, KeyError, TypeError):
            raise web.HTTPBadRequest(text="catalog must be JSON with a refs list") from None
        if not ok:
            raise web.HTTPBadRequest(
                text="every catalog ref must be {base_version, target_version, size, key}: versions and "
                "size integers >= 0 (base_version null for an anchor), key a stored object"
            )
        live = {r["key"] for r in refs}
        for ref in state.catalog["refs"]:
            if ref["key"] not in live:
                state.objects.pop(ref["key"], None)
        state.catalog = {
            "latest": catalog.get("latest"),
            "refs": refs,
            "public_key": catalog.get("public_key"),
        }
        return web.json_response({"refs": len(refs)})

    app = web.Application(
        client_max_size=state.max_object_bytes, middlewares=[metrics.middleware, log_refusals]
    )
    app.add_routes(routes)
    return app


def ssl_context(certfile: str | None, keyfile: str | None) -> ssl.SSLContext | None:
    if not certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(certfile, keyfile)
    except (OSError, ssl.SSLError) as err:
        raise ValueError(f"TLS certificate {certfile} / key {keyfile} cannot be loaded: {err}") from None
    return ctx


class PatchStoreServer(BackgroundApp):
    """The store on its own event loop in a background thread (inside the ServerApp)."""

    def __init__(
        self, state: StoreState, host: str = "127.0.0.1", port: int = 0, tls: ssl.SSLContext | None = None
    ):
        self.state = state
        super().__init__(lambda: make_app(state), "patch store", host, port, tls)


def serve(
    host: str,
    port: int,
    secret: bytes,
    certfile: str | None = None,
    keyfile: str | None = None,
    max_object_bytes: int = 256 << 20,
    max_total_bytes: int = 4 << 30,
    max_node_bytes: int = 512 << 20,
    state_dir: str | None = None,
) -> None:
    """`fedrl patch-store`: the store as its own service (deployments). With `state_dir`, the
    enrollments (volunteers' keys and the operator's decisions) survive a restart; objects and
    the catalog are held in memory only."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tls = ssl_context(certfile, keyfile)
    state = StoreState(secret, max_object_bytes, max_total_bytes, max_node_bytes)
    if state_dir:
        state.enrollments_file = Path(state_dir) / ENROLLMENTS_FILE
        state.load_enrollments()
    line = json.dumps({"patch_store": f"{'https' if certfile else 'http'}://{host}:{port}"})

    def announce(_aiohttp_says: str) -> None:  # called once it listens: the line means it is up
        print(line, flush=True)

    web.run_app(make_app(state), host=host, port=port, ssl_context=tls, print=announce)
