"""Simulated links: a client's bandwidth and latency, on the wall clock or a virtual one.

`ShapedLink` shapes actual transfers with a token bucket (the sender or receiver waits for
tokens chunk by chunk) plus one latency per request; `VirtualLink` does not wait and only
accounts the seconds: latency + bytes / bandwidth. Packet loss is modelled as the goodput
a retransmitting transport keeps: bandwidth * (1 - loss).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from fedrl.link import CHUNK, Link


@dataclass(frozen=True)
class LinkProfile:
    up_bytes_s: float = float("inf")
    down_bytes_s: float = float("inf")
    latency_s: float = 0.0
    loss: float = 0.0

    def __post_init__(self):
        if self.up_bytes_s <= 0 or self.down_bytes_s <= 0 or self.latency_s < 0 or not 0 <= self.loss < 1:
            raise ValueError("bandwidths must be > 0, latency >= 0 and loss in [0, 1)")

    def rate(self, direction: str) -> float:
        """Goodput in bytes/s."""
        return (self.up_bytes_s if direction == "up" else self.down_bytes_s) * (1.0 - self.loss)

    def seconds(self, nbytes: int, direction: str) -> float:
        return self.latency_s + nbytes / self.rate(direction)


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


class ShapedLink(Link):
    """Real transfers, paced to the profile on the wall clock."""

    def __init__(self, profile: LinkProfile):
        super().__init__()
        self.profile = profile
        self.up, self.down = TokenBucket(profile.rate("up")), TokenBucket(profile.rate("down"))

    async def latency(self) -> None:
        if self.profile.latency_s:
            await asyncio.sleep(self.profile.latency_s)

    async def send(self, n: int) -> None:
        await super().send(n)
        await self.up.consume(n)

    async def receive(self, n: int) -> None:
        await super().receive(n)
        await self.down.consume(n)


class VirtualLink(Link):
    """Real transfers at full speed; `virtual_s` is what they would have taken on the profile."""

    def __init__(self, profile: LinkProfile):
        super().__init__()
        self.profile, self.virtual_s = profile, 0.0

    async def latency(self) -> None:
        self.virtual_s += self.profile.latency_s

    async def send(self, n: int) -> None:
        await super().send(n)
        self.virtual_s += n / self.profile.rate("up")

    async def receive(self, n: int) -> None:
        await super().receive(n)
        self.virtual_s += n / self.profile.rate("down")


def make_link(profile: LinkProfile, virtual: bool) -> Link:
    return VirtualLink(profile) if virtual else ShapedLink(profile)
