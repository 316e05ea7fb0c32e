"""How bytes move between a client and the patch store.

`Link` is the interface and the plain implementation: it counts bytes and slows nothing down.
`RateLimitedLink` holds transfers to a cap with a token bucket (a volunteer's
`--upload-kbps` / `--download-kbps`). The simulation (fedrl.sim.link) builds its shaped links
on it, or accounts seconds on a virtual clock.
"""

from __future__ import annotations

import asyncio
import time

CHUNK = 64 << 10  # transfers move in chunks of this size, so a link can pace them


class Link:
    def __init__(self):
        self.bytes_up = self.bytes_down = 0

    async def latency(self) -> None:
        """One request's round trip (the network's own, on a real link)."""

    async def send(self, n: int) -> None:
        self.bytes_up += n

    async def receive(self, n: int) -> None:
        self.bytes_down += n


class TokenBucket:
    """`rate` bytes/s; tokens start empty (a fresh link gives no free burst, so even a small
    transfer takes n / rate) and idle time banks at most one chunk."""

    def __init__(self, rate: float, burst: int = CHUNK):
        if not rate > 0:
            raise ValueError(f"a rate must be > 0 bytes/s, got {rate}")
        self.rate, self.burst = rate, burst
        self.tokens, self.stamp = 0.0, time.monotonic()

    async def consume(self, n: int) -> None:
        """Take n tokens, going into debt if needed, and wait until the debt is repaid."""
        if self.rate == float("inf"):
            return
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate) - n
        self.stamp = now
        if self.tokens < 0:
            await asyncio.sleep(-self.tokens / self.rate)


class RateLimitedLink(Link):
    """Real transfers held to `up_bytes_s` / `down_bytes_s` on the wall clock (inf: no cap)."""

    def __init__(self, up_bytes_s: float = float("inf"), down_bytes_s: float = float("inf")):
        super().__init__()
        self.up, self.down = TokenBucket(up_bytes_s), TokenBucket(down_bytes_s)

    async def send(self, n: int) -> None:
        await super().send(n)
        await self.up.consume(n)

    async def receive(self, n: int) -> None:
        await super().receive(n)
        await self.down.consume(n)
