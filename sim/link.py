"""A Link moves bytes under a client's bandwidth and latency.

Real mode shapes actual transfers with a token bucket (the sender or receiver waits for
tokens chunk by chunk) plus one latency per request; virtual mode does not wait and only
accounts the seconds: latency + bytes / bandwidth.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

CHUNK = 64 << 10


@dataclass(frozen=True)
class LinkProfile:
    up_bytes_s: float = float("inf")
    down_bytes_s: float = float("inf")
    latency_s: float = 0.0

    def __post_init__(self):
        if self.up_bytes_s <= 0 or self.down_bytes_s <= 0 or self.latency_s < 0:
            raise ValueError("bandwidths must be > 0 and latency >= 0")

    def seconds(self, nbytes: int, direction: str) -> float:
        rate = self.up_bytes_s if direction == "up" else self.down_bytes_s
        return self.latency_s + nbytes / rate


class TokenBucket:
    """`rate` bytes/s; tokens start empty (a fresh link gives no free burst, so even a small
    transfer takes n / rate) and idle time banks at most one chunk."""

    def __init__(self, rate: float, burst: int = CHUNK):
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


class Link:
    """One client's link. `virtual=True` accounts seconds without waiting."""

    def __init__(self, profile: LinkProfile = LinkProfile(), virtual: bool = False):
        self.profile, self.virtual = profile, virtual
        self.up = TokenBucket(profile.up_bytes_s)
        self.down = TokenBucket(profile.down_bytes_s)
        self.bytes_up = self.bytes_down = 0
        self.virtual_s = 0.0

    async def latency(self) -> None:
        if not self.virtual and self.profile.latency_s:
            await asyncio.sleep(self.profile.latency_s)

    async def send(self, n: int) -> None:
        self.bytes_up += n
        await self._shape(self.up, n, "up")

    async def receive(self, n: int) -> None:
        self.bytes_down += n
        await self._shape(self.down, n, "down")

    async def _shape(self, bucket: TokenBucket, n: int, direction: str) -> None:
        if self.virtual:
            rate = self.profile.up_bytes_s if direction == "up" else self.profile.down_bytes_s
            self.virtual_s += n / rate
        else:
            await bucket.consume(n)
