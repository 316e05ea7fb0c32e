"""Simulated links: a client's bandwidth and latency, on the wall clock or a virtual one.

`ShapedLink` shapes actual transfers with fedrl.link's token bucket (the sender or receiver
waits for tokens chunk by chunk) plus one latency per request; `VirtualLink` does not wait and only
accounts the seconds: latency + bytes / bandwidth. Packet loss is modelled as the goodput
a retransmitting transport keeps: bandwidth * (1 - loss).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from fedrl.link import Link, RateLimitedLink


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


class ShapedLink(RateLimitedLink):
    """Real transfers, paced to the profile on the wall clock."""

    def __init__(self, profile: LinkProfile):
        super().__init__(profile.rate("up"), profile.rate("down"))
        self.profile = profile

    async def latency(self) -> None:
        if self.profile.latency_s:
            await asyncio.sleep(self.profile.latency_s)


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
