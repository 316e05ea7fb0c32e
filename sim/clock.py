"""The virtual clock the simulation injects into the coordinator (interface: fedrl.clock).

A client's round lasts compute_s = steps * step_s / speed plus its link's virtual seconds
(bytes / bandwidth + latency), composed as the client's threads compose them
(`round_seconds`). The coordinator hands each reply to `arrived` and handles replies in
order of virtual arrival. A reply is due only when no message still out can arrive
earlier; each message's earliest arrival (its compute time, from `lookahead`, which knows
the simulated client behind it) is what lets several clients compute at once in real time
without reordering. Replies due at the same virtual time go in the order of `tie` (the
simulation's: the client id), never in the order the engine happened to return them: two
clients of one profile finish together, and Ray returned them in either order.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


def round_seconds(
    overlapped: bool, compute_s: float, comm_before_s: float, comm_after_s: float
) -> tuple[float, float]:
    """(duration, overlap) of one client round: overlapped, the comm thread's work before
    the delta is ready runs beside compute; sequential, everything runs one after another."""
    if overlapped:
        return max(compute_s, comm_before_s) + comm_after_s, min(compute_s, comm_before_s)
    return comm_before_s + compute_s + comm_after_s, 0.0


class VirtualClock:
    virtual = True

    def __init__(self, lookahead: Callable[[Any], float], tie: Callable[[Any], Any] = lambda instruction: 0):
        self.lookahead = (
            lookahead  # instruction -> the earliest its reply can arrive, in seconds after sending
        )
        self.tie = tie  # instruction -> its rank among replies due at the same virtual time
        self.t = 0.0
        # msg_id -> (sent at, its key at the earliest it can arrive: (time, tie, sent order))
        self.out: dict[str, tuple[float, tuple]] = {}
        self.heap: list[tuple[tuple, str, Any]] = []
        self.seq = itertools.count()  # the last tie-break: the order messages were sent in

    def now(self) -> float:
        return self.t

    def sent(self, msg_id: str, instruction: Any) -> None:
        earliest = self.t + max(0.0, self.lookahead(instruction))
        self.out[msg_id] = (self.t, (earliest, self.tie(instruction), next(self.seq)))

    def arrived(self, msg_id: str, reply: Any, duration_s: float) -> None:
        sent_at, (earliest, *rank) = self.out.pop(msg_id)
        heapq.heappush(self.heap, ((max(earliest, sent_at + duration_s), *rank), msg_id, reply))

    def forget(self, msg_id: str) -> None:
        self.out.pop(msg_id, None)
        self.heap = [h for h in self.heap if h[1] != msg_id]
        heapq.heapify(self.heap)

    def next_due(self) -> tuple[str, Any] | None:
        """The earliest arrival, if no message still out could come before it (at the same
        virtual time, one that ranks before it could); advances time."""
        if not self.heap:
            return None
        if self.out and self.heap[0][0] > min(key for _, key in self.out.values()):
            return None
        (at, *_), msg_id, reply = heapq.heappop(self.heap)
        self.t = max(self.t, at)
        return msg_id, reply
