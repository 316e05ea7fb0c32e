"""The patch store under attack and load, on 127.0.0.1 only, every loop bounded.

A real `fedrl patch-store` process; an honest node uploads and downloads 256 KB objects in a
loop and times each request, first alone, then while attackers run at once:
  - `concurrent`: 200 concurrent 1 MB uploads from valid credentials (a flood, not a forgery);
  - `slow-headers`: 50 connections that trickle their request headers a byte at a time;
  - `oversize`: bodies past the object limit, declared and chunked, and a declared 1 GiB body
    that sends a few bytes and stalls;
  - `replayed`: one captured, validly signed request sent again and again;
  - `wrong-credential`: requests signed with a token of another store, an expired token, or none;
  - `traversal`: object names that look like paths out of the store.
Reported: the honest node's p50/p99 latency alone and under attack, the store's resident memory
(peak) before and after, whether it stayed up, and per attack how many requests were tried and
how many got a 2xx they should not have (`silently_accepted`).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

from fedrl.credentials import new_secret, node_principal, sign_request, token_for
from fedrl.ports import free_port
from fedrl.sim.memory import status_bytes
from fedrl.store_client import PatchStoreClient, StoreError

HONEST, ATTACKER = node_principal(1), node_principal(666)
TRAVERSAL = [
    "/objects/../../etc/passwd",
    "/objects/..%2F..%2Fetc%2Fpasswd",
    "/objects/%2e%2e/%2e%2e/etc/passwd",
    "/objects/" + "../" * 20 + "etc/shadow",
    "/objects/....//....//etc/passwd",
    "/objects/%252e%252e%252f",
    "/objects/" + "a" * 63 + "/",
    "/objects/" + "A" * 64,
    "/objects//etc/passwd",
    "/objects/" + "0" * 64 + "%00",
]


class StoreProcess:
    """`fedrl patch-store` on a free loopback port, its secret in a temp dir."""

    def __init__(self, max_object_mb: int = 8):
        self.dir = tempfile.TemporaryDirectory(prefix="fedrl-store-attack-")
        self.secret = secrets.token_hex(32).encode()  # the file's bytes are the secret
        secret_file = Path(self.dir.name) / "store.secret"
        secret_file.write_bytes(self.secret)
        self.port = free_port("127.0.0.1")
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fedrl.cli", "patch-store", "--port", str(self.port)]
            + ["--secret-file", str(secret_file), "--max-object-mb", str(max_object_mb)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("the patch store did not start")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self, field: str = "VmRSS") -> int:
        return status_bytes(field, self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.dir.cleanup()


async def honest_node(url: str, secret: bytes, stop: asyncio.Event, max_ops: int) -> list[float]:
    """Upload and download 256 KB objects (16 of them, in turn, so its quota never binds) until
    `stop`; the seconds each request took (inf: refused)."""
    objects = [np.random.default_rng(i).bytes(256 << 10) for i in range(16)]
    latencies = []
    async with PatchStoreClient(url, HONEST, token_for(secret, HONEST)) as store:
        for i in range(max_ops):
            if stop.is_set():
                break
            data = objects[i % len(objects)]
            for request in (store.put, store.get):
                start = time.perf_counter()
                try:
                    await request(data if request == store.put else hashlib.sha256(data).hexdigest())
                    latencies.append(time.perf_counter() - start)
                except StoreError:
                    latencies.append(float("inf"))  # an honest request refused counts as lost
    return latencies


async def status_of(session: aiohttp.ClientSession, method: str, url: str, **kw) -> int:
    try:
        async with session.request(method, url, **kw) as resp:
            await resp.read()
            return resp.status
    except (aiohttp.ClientError, TimeoutError):
        return 0  # refused at the connection: not accepted


async def concurrent_uploads(url: str, secret: bytes, count: int) -> dict:
    """A flood from valid credentials: each must be stored or refused (507 quota, 503 busy)."""
    rng = np.random.default_rng(2)
    bodies = [rng.bytes(1 << 20) for _ in range(count)]
    async with PatchStoreClient(url, ATTACKER, token_for(secret, ATTACKER)) as store:
        results = await asyncio.gather(*(store.put(b) for b in bodies), return_exceptions=True)
    stored = sum(isinstance(r, str) for r in results)
    return {"tried": count, "stored": stored, "refused": count - stored, "silently_accepted": 0}


async def slow_headers(port: int, count: int, seconds: float) -> dict:
    """Connections that send their headers one byte every 0.5 s; each is closed by the bound."""
    request = f"PUT /objects/{'0' * 64} HTTP/1.1\r\nHost: store\r\nX-Principal: {ATTACKER}\r\n".encode()

    async def trickle() -> int:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return 0
        sent, deadline = 0, time.monotonic() + seconds
        try:
            while time.monotonic() < deadline and sent < len(request):
                writer.write(request[sent : sent + 1])
                await writer.drain()
                sent += 1
                await asyncio.sleep(0.5)
        except OSError:
            pass
        finally:
            writer.close()
        return sent

    await asyncio.gather(*(trickle() for _ in range(count)))
    return {"tried": count, "silently_accepted": 0}


async def oversize(url: str, port: int, secret: bytes, limit: int) -> dict:
    """Bodies past the object limit, declared and chunked, and a 1 GiB declaration that stalls."""
    accepted, tried = 0, 0
    store = PatchStoreClient(url, ATTACKER, token_for(secret, ATTACKER))
    async with aiohttp.ClientSession() as session:
        big = os.urandom(limit + 1)
        digest = hashlib.sha256(big).hexdigest()

        async def chunked():
            for start in range(0, len(big), 1 << 16):
                yield big[start : start + (1 << 16)]

        for body in (big, chunked()):
            _, headers = store._signed("PUT", f"/objects/{digest}")
            tried += 1
            accepted += (
                200
                <= await status_of(session, "PUT", f"{url}/objects/{digest}", data=body, headers=headers)
                < 300
            )
    # a declared 1 GiB body with 16 bytes sent: refused at once, not held
    _, headers = store._signed("PUT", f"/objects/{'1' * 64}")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    writer.write(
        f"PUT /objects/{'1' * 64} HTTP/1.1\r\nHost: store\r\n{head}Content-Length: {1 << 30}\r\n\r\n".encode()
    )
    writer.write(b"x" * 16)
    await writer.drain()
    try:
        status_line = await asyncio.wait_for(reader.readline(), 10)
    except TimeoutError:
        status_line = b""
    writer.close()
    tried += 1
    accepted += status_line.split(b" ")[1:2] in ([b"200"], [b"201"])
    return {
        "tried": tried,
        "silently_accepted": int(accepted),
        "gigabyte_declaration": status_line.decode().strip(),
    }


async def replayed_and_wrong(url: str, secret: bytes, replays: int) -> dict:
    """One captured request replayed; requests signed with a foreign or expired token, or none."""
    async with aiohttp.ClientSession() as session:
        captured = sign_request(ATTACKER, token_for(secret, ATTACKER), "GET", "/catalog")
        first = await status_of(session, "GET", f"{url}/catalog", headers=captured)
        replay_ok = sum(
            [
                200 <= s < 300
                for s in await asyncio.gather(
                    *(status_of(session, "GET", f"{url}/catalog", headers=captured) for _ in range(replays))
                )
            ]
        )
        wrong = [
            sign_request(ATTACKER, token_for(new_secret(), ATTACKER), "GET", "/catalog"),
            sign_request(ATTACKER, token_for(secret, ATTACKER, ttl_s=-60), "GET", "/catalog"),
            sign_request("admin", token_for(secret, ATTACKER), "GET", "/catalog"),
            {"Authorization": f"Bearer {token_for(secret, ATTACKER)}", "X-Principal": ATTACKER},
            {},
        ]
        wrong_ok = 0
        for _ in range(max(1, replays // len(wrong))):
            for headers in wrong:
                wrong_ok += 200 <= await status_of(session, "GET", f"{url}/catalog", headers=headers) < 300
    return {
        "replayed": {"tried": replays, "silently_accepted": replay_ok, "original_status": first},
        "wrong-credential": {
            "tried": len(wrong) * max(1, replays // len(wrong)),
            "silently_accepted": wrong_ok,
        },
    }


async def traversal(url: str, secret: bytes) -> dict:
    store = PatchStoreClient(url, ATTACKER, token_for(secret, ATTACKER))
    accepted = 0
    async with aiohttp.ClientSession() as session:
        for path in TRAVERSAL:
            for method in ("GET", "PUT", "DELETE"):
                _, headers = store._signed(method, path)
                status = await status_of(
                    session, method, url + path, headers=headers, data=b"x" if method == "PUT" else None
                )
                accepted += 200 <= status < 300
    return {"tried": len(TRAVERSAL) * 3, "silently_accepted": accepted}


def percentiles(latencies: list[float]) -> dict:
    finite = [x for x in latencies if x != float("inf")]
    if not finite:
        return {"requests": len(latencies), "lost": len(latencies)}
    return {
        "requests": len(latencies),
        "lost": len(latencies) - len(finite),
        "p50_ms": float(np.percentile(finite, 50) * 1e3),
        "p99_ms": float(np.percentile(finite, 99) * 1e3),
    }


async def _run(store: StoreProcess, seconds: float, scale: float) -> dict:
    secret, url = store.secret, store.url
    stop = asyncio.Event()
    baseline = asyncio.create_task(honest_node(url, secret, stop, max_ops=10_000))
    await asyncio.sleep(seconds)
    stop.set()
    alone = await baseline
    rss_before = store.rss()

    stop = asyncio.Event()
    honest = asyncio.create_task(honest_node(url, secret, stop, max_ops=10_000))
    replays = max(10, int(200 * scale))
    attacks = await asyncio.gather(
        concurrent_uploads(url, secret, max(10, int(200 * scale))),
        slow_headers(store.port, max(5, int(50 * scale)), seconds),
        oversize(url, store.port, secret, limit=8 << 20),
        replayed_and_wrong(url, secret, replays),
        traversal(url, secret),
    )
    stop.set()
    under_attack = await honest
    rows = {
        "concurrent": attacks[0],
        "slow-headers": attacks[1],
        "oversize": attacks[2],
        **attacks[3],
        "traversal": attacks[4],
    }
    return {
        "honest_alone": percentiles(alone),
        "honest_under_attack": percentiles(under_attack),
        "store_rss_before": rss_before,
        "store_rss_peak": store.rss("VmHWM"),
        "store_rss_after": store.rss(),
        "attacks": rows,
    }


def attack_store(seconds: float = 10.0, scale: float = 1.0) -> dict:
    """The whole experiment against a fresh store process; `scale` shrinks the attack counts."""
    store = StoreProcess()
    try:
        result = asyncio.run(_run(store, seconds, scale))
        result["survived"] = store.alive()
        return result
    finally:
        store.stop()
