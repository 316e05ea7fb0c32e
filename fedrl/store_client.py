"""aiohttp client of the patch store, with transfers shaped by a Link."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import ssl
import threading
from collections.abc import Callable, Coroutine
from typing import Any

import aiohttp
from yarl import URL

from fedrl.credentials import sign_request
from fedrl.link import CHUNK, Link


class StoreError(OSError):
    """The store refused a request or could not be reached; the message says which and why."""


def reason(err: BaseException) -> str:
    """What went wrong, in a line: without the repr of the TLS context ("ssl:<ssl.SSLContext
    object at 0x7f...>") that aiohttp's connection errors carry; a bare timeout by its name."""
    if isinstance(err, aiohttp.ClientConnectorError):
        cause = err.os_error  # asyncio words a refusal "Connect call failed (host, port)"
        why = os.strerror(cause.errno) if cause.errno else str(cause)
        return f"cannot connect to {err.host}:{err.port}: {why}"
    return str(err) or type(err).__name__


class PatchStoreClient:
    """Use inside one event loop: `async with PatchStoreClient(...) as c: await c.get(key)`.
    `token` is a token string, or a function that mints one (fedrl.credentials.token_source)."""

    def __init__(
        self,
        url: str,
        principal: str,
        token: str | Callable[[], str],
        link: Link | None = None,
        ca_file: str | None = None,
        timeout_s: float = 300.0,
    ):
        self.url, self.principal, self.token = url.rstrip("/"), principal, token
        self.link = link or Link()
        self.ssl = ssl.create_default_context(cafile=ca_file) if ca_file else None
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.session: aiohttp.ClientSession | None = None

    async def __aenter__(self):
        self.session = aiohttp.ClientSession(timeout=self.timeout)
        return self

    def _signed(self, method: str, path: str, body: bytes | None = None) -> tuple[str, dict[str, str]]:
        """The URL of `path` and the headers that sign this one request."""
        url = f"{self.url}{path}"
        token = self.token() if callable(self.token) else self.token
        return url, sign_request(self.principal, token, method, URL(url).raw_path_qs, body)

    async def __aexit__(self, *exc):
        await self.session.close()

    async def _check(self, resp: aiohttp.ClientResponse, what: str) -> None:
        if resp.status >= 400:
            raise StoreError(f"{what}: HTTP {resp.status} {(await resp.text())[:200]}")

    async def put(self, data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        await self.link.latency()

        async def body():
            for start in range(0, len(data), CHUNK):
                chunk = data[start : start + CHUNK]
                await self.link.send(len(chunk))
                yield chunk

        url, headers = self._signed("PUT", f"/objects/{digest}")  # the name binds the body
        try:
            async with self.session.put(
                url, data=body(), ssl=self.ssl, headers={**headers, "Content-Length": str(len(data))}
            ) as resp:
                await self._check(resp, f"upload {digest[:12]}")
        except aiohttp.ClientError as err:
            raise StoreError(f"upload {digest[:12]}: {reason(err)}") from None
        return digest

    async def get(self, digest: str, max_bytes: int = 1 << 32) -> bytes:
        await self.link.latency()
        parts, size = [], 0
        url, headers = self._signed("GET", f"/objects/{digest}")
        try:
            async with self.session.get(url, ssl=self.ssl, headers=headers) as resp:
                await self._check(resp, f"download {digest[:12]}")
                async for chunk in resp.content.iter_chunked(CHUNK):
                    size += len(chunk)
                    if size > max_bytes:
                        raise StoreError(f"download {digest[:12]}: larger than {max_bytes} bytes")
                    await self.link.receive(len(chunk))
                    parts.append(chunk)
        except aiohttp.ClientError as err:
            raise StoreError(f"download {digest[:12]}: {reason(err)}") from None
        data = b"".join(parts)
        if hashlib.sha256(data).hexdigest() != digest:
            raise StoreError(f"download {digest[:12]}: content does not hash to its name")
        return data

    async def json(self, method: str, path: str, payload: Any = None, metered: bool = False) -> Any:
        """A JSON request; `metered`: the answer's bytes pass through the link (data a node
        fetches every round, as a patch's do), else they are control traffic, not counted."""
        body = b"" if payload is None else json.dumps(payload).encode()
        url, headers = self._signed(method, path, body)
        if payload is not None:
            headers["Content-Type"] = "application/json"
        try:
            async with self.session.request(
                method, url, data=body or None, ssl=self.ssl, headers=headers
            ) as resp:
                await self._check(resp, f"{method} {path}")
                if not metered:
                    return await resp.json()
                answer = await resp.read()
            await self.link.receive(len(answer))
            return json.loads(answer)
        except aiohttp.ClientError as err:
            raise StoreError(f"{method} {path}: {reason(err)}") from None

    async def catalog(
        self, target: int | None = None, held: int | None = None, plans: int | None = None
    ) -> dict:
        """The published catalog; with `target`, only the refs of the (first `plans`) routes from
        `held` (None: holding nothing) to it. A node reads this every round, so its bytes are metered."""
        path = "/catalog" if target is None else f"/catalog?target={int(target)}"
        if target is not None and held is not None:
            path += f"&held={int(held)}"
        if target is not None and plans is not None:
            path += f"&plans={int(plans)}"
        return await self.json("GET", path, metered=True)

    async def ledger(self) -> dict | None:
        """This node's ledger row (fedrl.ledger), as the coordinator last published it; None before.
        Read once a round by a node that has an owner to show it to, so its bytes are metered."""
        return (await self.json("GET", "/ledger", metered=True))["row"]

    async def publish_ledger(self, rows: dict[str, dict]) -> dict:
        return await self.json("POST", "/ledger", rows)

    async def meta(self, digest: str) -> dict:
        return await self.json("GET", f"/objects/{digest}/meta")

    async def publish(self, catalog: dict) -> dict:
        return await self.json("POST", "/catalog", catalog)

    async def delete(self, digest: str, principal: str | None = None) -> dict:
        query = f"?principal={principal}" if principal else ""
        return await self.json("DELETE", f"/objects/{digest}{query}")

    async def enroll(self, public_key: str, name: str = "") -> dict:
        return await self.json("POST", "/enroll", {"public_key": public_key, "name": name})

    async def enrollment(self, fingerprint: str) -> dict:
        return await self.json("GET", f"/enroll/{fingerprint}")

    async def enrollments(self) -> list[dict]:
        return await self.json("GET", "/enroll")

    async def decide(self, fingerprint: str, status: str, reason: str = "") -> dict:
        return await self.json("POST", f"/enroll/{fingerprint}", {"status": status, "reason": reason})

    async def probe_down(self, nbytes: int) -> int:
        """Download `nbytes` through the link; the bytes received."""
        await self.link.latency()
        size = 0
        url, headers = self._signed("GET", f"/probe?bytes={int(nbytes)}")
        try:
            async with self.session.get(url, ssl=self.ssl, headers=headers) as resp:
                await self._check(resp, "probe download")
                async for chunk in resp.content.iter_chunked(CHUNK):
                    size += len(chunk)
                    await self.link.receive(len(chunk))
        except aiohttp.ClientError as err:
            raise StoreError(f"probe download: {reason(err)}") from None
        return size

    async def probe_up(self, nbytes: int) -> int:
        """Upload `nbytes` through the link; the bytes the store says it read."""
        await self.link.latency()
        data = os.urandom(int(nbytes))

        async def body():
            for start in range(0, len(data), CHUNK):
                await self.link.send(len(data[start : start + CHUNK]))
                yield data[start : start + CHUNK]

        url, headers = self._signed("POST", "/probe")
        try:
            async with self.session.post(
                url, data=body(), ssl=self.ssl, headers={**headers, "Content-Length": str(len(data))}
            ) as resp:
                await self._check(resp, "probe upload")
                return int((await resp.json())["bytes"])
        except aiohttp.ClientError as err:
            raise StoreError(f"probe upload: {reason(err)}") from None


class BlockingStoreClient:
    """The same client for synchronous callers (the coordinator): a private loop in a thread."""

    def __init__(self, *args, **kwargs):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="store-client", daemon=True)
        self._thread.start()
        self._client = PatchStoreClient(*args, **kwargs)
        self._call(self._client.__aenter__())

    def _call(self, coro: Coroutine):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def __getattr__(self, name):
        method = getattr(self._client, name)
        return lambda *a, **k: self._call(method(*a, **k))

    def close(self) -> None:
        try:
            self._call(self._client.__aexit__(None, None, None))
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            self._loop.close()


def put_signed_patches(admin: BlockingStoreClient, patches, signing_key) -> list[dict]:
    """Store (base_version, target_version, patch) triples signed by `signing_key`; returns
    their catalog refs."""
    from fedrl.signing import sign_patch

    refs = []
    for base, target, data in patches:
        signed = sign_patch(data, signing_key)
        refs.append(
            {"base_version": base, "target_version": target, "size": len(signed), "key": admin.put(signed)}
        )
    return refs
