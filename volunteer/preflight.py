"""The volunteer's preflight: pass/fail checks of this machine and of the run's two services,
made before anything is enrolled, measured or downloaded. Volunteer projects' most common
complaints are peers that cannot be reached, nodes that run out of memory or disk, and clocks
whose skew makes authentication fail; each gets a line that says what to do.

The checks are pure functions of measured facts (tested alone); `run_preflight` measures them.
"""

from __future__ import annotations

import asyncio
import email.utils
import shutil
import socket
import ssl
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import psutil

from fedrl.credentials import CLOCK_SKEW_S
from fedrl.invite import Invite
from fedrl.store_client import reason
from fedrl.volunteer.probe import Limits, accelerator

PASS, WARN, FAIL = "pass", "warn", "FAIL"
MIN_PYTHON = (3, 11)  # pyproject's requires-python
MIN_FREE_DISK_MB = 500.0  # the node's state and logs are small; the rest is room for them to grow
MIN_AVAILABLE_MB = 1000.0  # below, the learner and its ClientApp are likely to run out of memory
CONNECT_TIMEOUT_S = 5.0
STORE, SUPERLINK = "patch store", "SuperLink"  # the run's services: a FAIL of theirs is "unreachable"


@dataclass(frozen=True)
class Check:
    name: str
    verdict: str  # PASS, WARN or FAIL
    detail: str


def python_check(version: tuple[int, ...]) -> Check:
    shown = ".".join(map(str, version[:3]))
    if tuple(version[:2]) < MIN_PYTHON:
        return Check("python", FAIL, f"{shown}: fedrl needs {'.'.join(map(str, MIN_PYTHON))} or newer")
    return Check("python", PASS, shown)


def memory_check(total_mb: float, available_mb: float, max_memory_mb: float) -> Check:
    detail = f"{total_mb:,.0f} MB, {available_mb:,.0f} MB free"
    if max_memory_mb and max_memory_mb > total_mb:
        too_much = f"--max-memory {max_memory_mb:,.0f} MB is more than the machine has"
        return Check("memory", FAIL, f"{detail}: {too_much}")
    need = min(max_memory_mb, MIN_AVAILABLE_MB) if max_memory_mb else MIN_AVAILABLE_MB
    if available_mb < need:
        return Check("memory", WARN, f"{detail}: under {need:,.0f} MB free, the node may run out of memory")
    return Check("memory", PASS, detail + (f" (limit {max_memory_mb:,.0f} MB)" if max_memory_mb else ""))


def disk_check(free_mb: float, where: Path) -> Check:
    detail = f"{free_mb:,.0f} MB free under {where}"
    if free_mb < MIN_FREE_DISK_MB:
        return Check("disk", FAIL, f"{detail}: the node's state needs {MIN_FREE_DISK_MB:,.0f} MB")
    return Check("disk", PASS, detail)


def clock_check(skew_s: float | None, error: str = "") -> Check:
    """`skew_s`: this machine's clock minus the patch store's. Flower's node authentication and
    the store's tokens both refuse requests whose time is off by more than CLOCK_SKEW_S."""
    if skew_s is None:
        return Check("clock", WARN, f"not measured ({error})")
    detail = f"{skew_s:+.1f} s from the patch store's clock"
    if abs(skew_s) > CLOCK_SKEW_S:
        return Check(
            "clock",
            FAIL,
            f"{detail}: past {CLOCK_SKEW_S:.0f} s the SuperLink and the store refuse this node "
            "(set the clock: NTP)",
        )
    if abs(skew_s) > CLOCK_SKEW_S / 2:
        return Check("clock", WARN, f"{detail}: near the {CLOCK_SKEW_S:.0f} s the services allow (NTP?)")
    return Check("clock", PASS, detail)


def reach_check(name: str, address: str, seconds: float | None, error: str = "") -> Check:
    if seconds is None:
        return Check(name, FAIL, f"cannot reach the {name} at {address}: {error}")
    return Check(name, PASS, f"{address}, TLS verified in {1000 * seconds:.0f} ms")


def tls_handshake(host: str, port: int, ca_file: str, timeout_s: float = CONNECT_TIMEOUT_S) -> float:
    """Seconds to connect and complete a TLS handshake that verifies the peer against the run's
    CA and its host name (what the SuperNode's connection to the Fleet API does first)."""
    context = ssl.create_default_context(cafile=ca_file)
    start = time.perf_counter()
    with socket.create_connection((host, port), timeout=timeout_s) as raw:
        with context.wrap_socket(raw, server_hostname=host):
            return time.perf_counter() - start


async def store_clock(
    store_url: str, ca_file: str, timeout_s: float = CONNECT_TIMEOUT_S
) -> tuple[float, float]:
    """(seconds to the store's /health answer over verified TLS, this clock minus the store's).
    The store's HTTP Date header has whole seconds: its time is taken at the middle of its second,
    at the middle of the request."""
    context = ssl.create_default_context(cafile=ca_file)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        sent = time.time()
        start = time.perf_counter()
        async with session.get(store_url.rstrip("/") + "/health", ssl=context) as resp:
            resp.raise_for_status()
            date = resp.headers.get("Date")
        seconds = time.perf_counter() - start
    if not date:
        raise ValueError("the store's answer has no Date header")
    theirs = email.utils.parsedate_to_datetime(date).timestamp() + 0.5
    return seconds, sent + seconds / 2 - theirs


def run_preflight(invite: Invite, ca_file: str, limits: Limits, home: Path) -> list[Check]:
    memory = psutil.virtual_memory()
    home.mkdir(parents=True, exist_ok=True)
    checks = [
        python_check(sys.version_info),
        memory_check(memory.total / 2**20, memory.available / 2**20, limits.max_memory_mb),
        disk_check(shutil.disk_usage(home).free / 2**20, home),
        Check("accelerator", PASS, accelerator()),
    ]
    try:
        seconds, skew = asyncio.run(store_clock(invite.store_url, ca_file))
        checks += [reach_check(STORE, invite.store_url, seconds), clock_check(skew)]
    except (OSError, aiohttp.ClientError, ValueError) as err:  # TimeoutError is an OSError
        checks += [reach_check(STORE, invite.store_url, None, reason(err)), clock_check(None, "no store")]
    host, _, port = invite.superlink.rpartition(":")
    try:
        checks.append(reach_check(SUPERLINK, invite.superlink, tls_handshake(host, int(port), ca_file)))
    except (OSError, ValueError) as err:
        checks.append(reach_check(SUPERLINK, invite.superlink, None, reason(err)))
    return checks


def preflight_table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    return "\n".join(f"{c.verdict:<4}  {c.name:<{width}}  {c.detail}" for c in checks)


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if c.verdict == FAIL]
