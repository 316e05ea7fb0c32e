"""Checks on settings, made the one way: an error names each setting out of bounds and its
value, not a list of every setting the check covers."""

from __future__ import annotations

from collections.abc import Callable


def at_least(obj, least: float, *names: str, label: Callable[[str], str] = str) -> None:
    """Raise ValueError unless every attribute `names` of `obj` is >= `least` (NaN is not: it
    passed `< least`, and `--set target_error=NaN` ran a run that could never reach it); `label`
    spells a name as its user writes it (`max-threads` for a node's `max_threads`)."""
    low = [name for name in names if not getattr(obj, name) >= least]
    if low:
        raise ValueError(
            "; ".join(f"{label(name)} must be >= {least}, got {getattr(obj, name)}" for name in low)
        )


def require(condition: bool, problem: str) -> None:
    """Raise ValueError(problem) unless `condition`: one check of a list that is run in full."""
    if not condition:
        raise ValueError(problem)
