"""The coordinator's clock: when replies are handled, and what time the run thinks it is.

`Clock` is the interface; `RealClock` hands replies over as they arrive, on the wall clock.
The simulation injects a virtual clock (fedrl.sim.clock.VirtualClock) that orders replies
by simulated arrival instead. The coordinator tells the clock what it sent and what
arrived, and asks it which reply is due next.
"""

from __future__ import annotations

import time
from typing import Any, Protocol


class Clock(Protocol):
    virtual: bool

    def now(self) -> float: ...

    def sent(self, msg_id: str, instruction: Any) -> None: ...

    def arrived(self, msg_id: str, reply: Any, duration_s: float) -> None: ...

    def forget(self, msg_id: str) -> None:
        """A message given up for lost: it no longer holds anything back."""

    def next_due(self) -> tuple[str, Any] | None: ...


class RealClock:
    virtual = False

    def __init__(self):
        self.start = time.perf_counter()
        self.ready: list[tuple[str, Any]] = []

    def now(self) -> float:
        return time.perf_counter() - self.start

    def sent(self, msg_id: str, instruction: Any) -> None:
        pass

    def arrived(self, msg_id: str, reply: Any, duration_s: float) -> None:
        self.ready.append((msg_id, reply))

    def forget(self, msg_id: str) -> None:
        self.ready = [r for r in self.ready if r[0] != msg_id]

    def next_due(self) -> tuple[str, Any] | None:
        return self.ready.pop(0) if self.ready else None
