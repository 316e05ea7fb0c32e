"""Failpoints: named moments at which a chaos run kills the coordinator on purpose.

A kill -9 at a random moment mostly lands while the coordinator waits for replies; the moments
that can lose or corrupt state (half an aggregation, half a checkpoint file, patches uploaded
but the catalog not yet moved) last milliseconds. `FEDRL_FAILPOINT="NAME:N"` makes the process
SIGKILL itself the N-th time it reaches `failpoint(NAME)` (N defaults to 1): the same signal
an operator's kill -9 sends, at exactly that moment. Unset, a failpoint costs a dict lookup.
"""

from __future__ import annotations

import os
import signal
from collections import Counter

ENV = "FEDRL_FAILPOINT"
NAMES = (
    "aggregate",  # the new global state computed, not yet the run's version
    "checkpoint-write",  # a checkpoint file written to its temporary name, not yet renamed
    "publish",  # the version's patches in the store, the catalog not yet pointing at them
)
_hits: Counter[str] = Counter()


def parse(spec: str) -> tuple[str, int]:
    """`NAME[:N]` -> (NAME, N); a clear ValueError for anything else."""
    name, _, nth = spec.partition(":")
    if name not in NAMES:
        raise ValueError(f"{ENV}={spec!r}: unknown failpoint {name!r}; known: {', '.join(NAMES)}")
    try:
        hit = int(nth or 1)
    except ValueError:
        hit = 0
    if hit < 1:
        raise ValueError(f"{ENV}={spec!r}: the hit to fail at must be an integer >= 1, got {nth!r}")
    return name, hit


def check_env() -> None:
    """Refuse a malformed FEDRL_FAILPOINT at start-up rather than at the moment it names."""
    if os.environ.get(ENV):
        parse(os.environ[ENV])


def failpoint(name: str) -> None:
    spec = os.environ.get(ENV)
    if not spec:
        return
    target, hit = parse(spec)
    if target != name:
        return
    _hits[name] += 1
    if _hits[name] == hit:
        os.kill(os.getpid(), signal.SIGKILL)
