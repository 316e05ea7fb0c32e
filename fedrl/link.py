"""How bytes move between a client and the patch store.

`Link` is the interface and the plain implementation a real client uses: it counts bytes
and slows nothing down. The simulation (fedrl.sim.link) subclasses it to shape transfers
on the wall clock or to account their seconds on a virtual one.
"""

from __future__ import annotations

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
