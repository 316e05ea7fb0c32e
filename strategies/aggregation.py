"""Per-block aggregation of client deltas: staleness-weighted mean, robust options, rejection.

global[b] += sum_i a_i * delta_i / sum_i a_i with a_i = n_i * (1 + tau_i) ** -alpha.
Pure functions over dicts of tensors; the coordinator owns the state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AggregationConfig:
    alpha: float = 0.5  # staleness discount exponent
    max_staleness: int = 4  # deltas older than this many versions are rejected (AReaL's eta)
    clip_norm: float | None = None  # per-update L2 norm clip
    robust: str = "mean"  # mean | trimmed-mean | median (coordinate-wise)
    trim_fraction: float = 0.1

    def __post_init__(self):
        if self.robust not in ("mean", "trimmed-mean", "median"):
            raise ValueError(f"robust must be mean, trimmed-mean or median, got {self.robust!r}")
        if self.alpha < 0 or self.max_staleness < 0 or not 0 <= self.trim_fraction < 0.5:
            raise ValueError("alpha and max_staleness must be >= 0, trim_fraction in [0, 0.5)")


@dataclass
class Update:
    node: int
    block: int
    delta: dict[str, torch.Tensor]
    num_samples: int
    staleness: int


def staleness_weight(staleness: int, alpha: float) -> float:
    return float((1 + staleness) ** -alpha)


def rejection_reason(update: Update, config: AggregationConfig) -> str | None:
    """Why an update must not be aggregated, or None."""
    if update.staleness < 0:
        return f"staleness {update.staleness} is negative (a version from the future)"
    if update.staleness > config.max_staleness:
        return f"staleness {update.staleness} exceeds the bound {config.max_staleness}"
    if update.num_samples <= 0:
        return f"num_samples {update.num_samples} must be positive"
    if not update.delta:
        return "empty delta"
    if not all(torch.isfinite(t).all() for t in update.delta.values()):
        return "non-finite values (NaN/Inf) in the delta"
    return None


def clip_delta(delta: Mapping[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    norm = torch.sqrt(sum((t.double() ** 2).sum() for t in delta.values()))
    scale = min(1.0, max_norm / float(norm)) if norm > 0 else 1.0
    return {k: t * scale for k, t in delta.items()}


def aggregate_block(updates: list[Update], config: AggregationConfig) -> dict[str, torch.Tensor]:
    """The combined delta for one block (every update must name the same tensors)."""
    if not updates:
        raise ValueError("no updates to aggregate")
    names = set(updates[0].delta)
    if any(set(u.delta) != names for u in updates):
        raise ValueError("updates of one block name different tensors")
    deltas = [clip_delta(u.delta, config.clip_norm) if config.clip_norm else u.delta for u in updates]
    if config.robust == "mean":
        weights = torch.tensor([u.num_samples * staleness_weight(u.staleness, config.alpha) for u in updates])
        weights = weights / weights.sum()
        return {n: sum(w * d[n] for w, d in zip(weights.tolist(), deltas)) for n in names}
    out = {}
    for n in names:
        stacked = torch.stack([d[n] for d in deltas])
        if config.robust == "median":
            out[n] = stacked.median(dim=0).values
        else:
            k = int(config.trim_fraction * len(deltas))
            ordered = stacked.sort(dim=0).values
            out[n] = ordered[k : len(deltas) - k].mean(dim=0)
    return out
