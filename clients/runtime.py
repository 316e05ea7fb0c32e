"""What surrounds a client: its links, the pace of its steps, how its rounds are timed and
which frictions its actor suffers. `Runtime` is the real world: plain links, wall-clock
timings, an honest actor. The simulation wraps the ClientApp with a mod that installs
another runtime for the length of one message (`use_runtime`); the worker asks
`current_runtime()` and never knows which it got.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

from fedrl.frictions import Frictions, StalenessBuffer
from fedrl.link import Link, RateLimitedLink
from fedrl.node_files import leave_request, update_status


@dataclass
class CommResult:
    """What one pass of the communication thread did."""

    held: dict | None = None  # the global adapter it synced to
    upload_key: str = ""
    full_sync_bytes: int = 0  # the cheapest sync to the same version from nothing (what a cache saves)
    sync_patches: int = 0  # patches the sync downloaded (0: it held the version already)
    links: list[Link] = field(default_factory=list)
    intervals: list[tuple[float, float]] = field(default_factory=list)  # when the link was busy (wall clock)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def bytes_up(self) -> int:
        return sum(link.bytes_up for link in self.links)

    @property
    def bytes_down(self) -> int:
        return sum(link.bytes_down for link in self.links)


@dataclass(frozen=True)
class Timing:
    compute_s: float
    comm_s: float
    overlap_s: float
    duration_s: float


def overlap_seconds(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


class Runtime:
    def open_link(self) -> Link:
        return Link()

    def pace(self, step_wall_s: float) -> None:
        """Called after each local step with its wall seconds."""

    def landed(self, comm: CommResult, steps_done: int) -> bool:
        """Whether the comm thread's result is available to compute after `steps_done` steps."""
        return comm.done.is_set()

    def timing(
        self,
        overlapped: bool,
        compute: tuple[float, float],
        steps: int,
        before: CommResult,
        after: CommResult | None,
        start: float,
    ) -> Timing:
        """The round's timing: measured on the wall clock."""
        intervals = before.intervals + (after.intervals if after else [])
        return Timing(
            compute[1] - compute[0],
            sum(end - begin for begin, end in intervals),
            sum(overlap_seconds(compute, iv) for iv in intervals),
            time.perf_counter() - start,
        )

    def frictions(self) -> Frictions:
        """What this client's actor suffers (fedrl.frictions; nothing on an honest client)."""
        return Frictions()

    def actor_history(self) -> StalenessBuffer | None:
        """The snapshots a lagging actor samples from in this round (None: the actor does not
        lag): a fresh buffer, so it lags at most the round's own steps."""
        f = self.frictions()
        return StalenessBuffer(f.staleness, f.staleness_uniform) if f.staleness else None

    def poison_update(self, base: dict, new: dict, seed: int, first: dict) -> dict:
        """What a dishonest client hands in for the block's new values (an honest one: `new`);
        `first`: the block's values at version 0, which a liar about its base trains from."""
        return new

    def leaving(self) -> str:
        """ "" while the node stays; "flush" or "drop" once its owner asked it to leave."""
        return ""

    def shows_ledger(self) -> bool:
        """Whether the node reads its ledger row every round, for an owner to see (fedrl.ledger)."""
        return False

    def show_ledger(self, row: dict | None) -> None:
        """Hand the node's ledger row, as the coordinator last published it, to its owner."""


@dataclass
class NodeRuntime(Runtime):
    """A real node with an owner: links held to the owner's caps (bytes/s, inf: none), and the
    owner's request to leave read from the node's state directory (fedrl.node_files)."""

    up_bytes_s: float = float("inf")
    down_bytes_s: float = float("inf")
    state_dir: str = ""

    def open_link(self) -> Link:
        return RateLimitedLink(self.up_bytes_s, self.down_bytes_s)

    def leaving(self) -> str:
        return leave_request(self.state_dir)

    def shows_ledger(self) -> bool:
        return bool(self.state_dir)

    def show_ledger(self, row: dict | None) -> None:
        if row is not None:
            update_status(self.state_dir, ledger=row)


REAL_WORLD = Runtime()  # stateless: one instance serves every message
_current: ContextVar[Runtime] = ContextVar("fedrl_client_runtime", default=REAL_WORLD)  # noqa: B039


def current_runtime() -> Runtime:
    return _current.get()


@contextmanager
def use_runtime(runtime: Runtime):
    token = _current.set(runtime)
    try:
        yield runtime
    finally:
        _current.reset(token)
