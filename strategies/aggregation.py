"""Per-block aggregation of client deltas: staleness-weighted mean, robust options, rejection.

global[b] += sum_i a_i * delta_i / sum_i a_i with a_i = n_i * (1 + tau_i) ** -alpha.
Each delta is first clipped to a norm bound: a fixed `clip_norm`, and/or `clip_multiple` times the
median norm of recent updates (the caller's reference) and the ones at hand, over those that moved
something (`step_sizes`; adaptive, so it needs no tuning to the model's scale; one client scaling
its update ×100 moves the result by at most its weight times that bound). The adaptive bound and the
refusal compare norms per √step (an update's `unit_norm`): a fast client's update of 13 local steps
is honestly 2.7x the norm of a slow client's 3 (tiny-gpt-base, mixed volunteers), and a bound at the
median of raw norms cut most of what the fast clients learned. Steps come from the samples an update
claims, within the round's cap, so a boaster gains at most √(max/base steps) = 2x room. A top-k
upload with error feedback is measured per step of its client's latest rounds on the block
(`feedback_window`), not per √step of one: its residual gathers the coordinates that keep one sign
round after round, so its honest norm grows about linearly with them until the residual is spent as
fast as it fills (one top-1% run, medians over its 0-10, 10-25, 25-40 and 40-60 virtual s: norms
0.041 to 0.199, per √step of the round 0.018 to 0.068, per step of all rounds 0.0043 to 0.0030; at
the median per √step of one round 81% of such uploads were clipped, each losing what the clip cut);
there a boaster that claims the round's cap every time gains at most max/base steps = 4x room. An
update far beyond its peers' norms (`refuse_multiple` times their median) is refused before it is
queued: no honest round comes near it, so it is a bug or an attacker, and it goes on the client's
record instead of being scaled down into the result. Both compare with a median that never falls
below half the run's typical step at its height (`step_floor`): when most clients' updates go
nearly silent (a policy collapsed onto one answer per prompt scores whole groups alike), their
median fell 100-10,000x below the run's early steps, and the clip cut every update that still
learned down to that size (a PPO run from scratch stood at 0.996 error for 600 virtual s; with no
clip it learned). An attacker in such a quiet spell gains no more room than an honest step of the
run had anyway. Pure functions over dicts of tensors; the coordinator owns the history of norms.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from fedrl.bounds import at_least


@dataclass(frozen=True)
class AggregationConfig:
    alpha: float = 0.5  # staleness discount exponent
    max_staleness: int = 4  # deltas older than this many versions are rejected (AReaL's eta)
    clip_norm: float | None = None  # per-update L2 norm clip
    clip_multiple: float = 0.0  # adaptive clip: this many times the median recent norm; 0: off
    refuse_multiple: float = 0.0  # refuse an update over this many times the median recent norm; 0: off
    robust: str = "mean"  # mean | trimmed-mean | median (coordinate-wise)
    trim_fraction: float = 0.1

    def __post_init__(self):
        if self.robust not in ("mean", "trimmed-mean", "median"):
            raise ValueError(f"robust must be mean, trimmed-mean or median, got {self.robust!r}")
        at_least(self, 0, "alpha", "max_staleness")
        if not 0 <= self.trim_fraction < 0.5:
            raise ValueError(f"trim_fraction must be in [0, 0.5), got {self.trim_fraction}")
        for name in ("clip_multiple", "refuse_multiple"):
            if not (getattr(self, name) == 0 or getattr(self, name) >= 1):
                raise ValueError(f"{name} must be 0 (off) or >= 1, got {getattr(self, name)}")


@dataclass
class Update:
    node: int
    block: int
    delta: dict[str, torch.Tensor]
    num_samples: int
    staleness: int
    weight: float = 1.0  # the client's reputation (fedrl.strategies.reputation); 1: not weighed
    steps: int = 1  # local optimizer steps behind the delta (error feedback: its latest rounds' on the block)
    feedback: bool = False  # a top-k upload with error feedback (its residual carries older rounds)
    norm: float = field(init=False)  # of the delta: judged on arrival, logged, clipped at aggregation

    def __post_init__(self):
        self.norm = update_norm(self.delta)

    @property
    def scale(self) -> float:
        """How an honest norm grows with the steps behind it: about √steps for one round's delta
        (a fresh Adam's steps add like a random walk), about linearly for an error-feedback upload."""
        steps = max(self.steps, 1)
        return float(steps) if self.feedback else math.sqrt(steps)

    @property
    def unit_norm(self) -> float:
        """The norm per unit of `scale`, what the adaptive clip and the refusal compare."""
        return self.norm / self.scale


# An error-feedback upload's norm grows with its client's rounds on the block only until its
# residual is spent as fast as it fills: one top-10% run's medians by round on the block grew
# 0.071, 0.129, 0.173, 0.181, then stayed within 0.15-0.21 to round 20, while the steps of all
# its rounds grew from 6 to 215 (so per step of all rounds, rounds from the 16th on looked 13x
# smaller than first ones, and a newcomer's first rounds were cut at a median set by old-timers).
FEEDBACK_MEMORY = 0.3  # a residual carries about this / density of its client's last rounds


def feedback_window(density: float) -> int:
    """How many of a client's latest rounds on a block an error-feedback upload at `density`
    is measured by (3 at 10%, 30 at 1%)."""
    return max(1, math.ceil(FEEDBACK_MEMORY / density - 1e-9))


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


def update_norm(delta: Mapping[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in delta.values())))


# An upload made on an older state lands its own update's length from that state, however far
# the block moved since; an honest update that undoes the last steps (Adam's steps from scratch
# are larger than a version's move, and turn back) lands beside it, moved sideways by most of its
# length. Nearer by the margin alone refused 0.4-5.7% of honest updates per run from scratch
# (lr 3e-4, 2-9 versions back: such an update undid 0.8-1.5 of the way back and moved sideways
# by 0.56-0.78 of its length, 10th-90th percentiles of 88); 1-2% at lr 5e-4 fine-tuning without the slack.
ROLLBACK_SLACK = 1  # versions older than the named base before a state counts
ROLLBACK_MARGIN = 0.8  # the upload nearer to that state than to the base by this factor ...
ROLLBACK_REACH = 0.5  # ... and within this share of the way from that state to the base


def older_base(
    new: Mapping[str, torch.Tensor], base_version: int, retained: Mapping[int, Mapping[str, torch.Tensor]]
) -> int | None:
    """The version of a retained global state, more than ROLLBACK_SLACK older than the base an
    upload names, that its new values are nearer to (by ROLLBACK_MARGIN) than to that base and
    within ROLLBACK_REACH of the way from it to the base; None if there is none. An update
    trained on an old state and labelled with a newer base shows this way: measured against the
    base it names, it would move the block back toward the old state by all that was merged
    between. One that lands farther out rolls the block back by at most about twice its own
    length, which the norm refusal and the clip bound like any update's."""
    base = retained.get(base_version)
    if base is None:
        return None

    def distance(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
        return update_norm({n: a[n].float() - b[n].float() for n in new})

    claimed = distance(new, base)
    found = {}
    for version, state in retained.items():
        if version < base_version - ROLLBACK_SLACK:
            near = distance(new, state)
            if near < ROLLBACK_MARGIN * claimed and near < ROLLBACK_REACH * distance(base, state):
                found[version] = near
    return min(found, key=found.get, default=None)


MIN_REFERENCE = 3  # norms of other updates needed before one can be called an outlier
PEAK_WINDOW = 16  # step sizes a median needs before it may raise the run's peak (a few attackers cannot)
PEAK_SHARE = 0.5  # the medians the clip and the refusal use never fall below this share of the peak


def step_sizes(unit_norms: Sequence[float]) -> list[float]:
    """The norms that say how large an honest step is: the non-zero ones. An update of exactly
    zero carries no learning signal (every group it sampled scored alike, so Adam's first step
    moved nothing), and says nothing about step sizes: a policy that has collapsed onto one answer
    sends such updates all round, and their median of 0 refused, or clipped to nothing, every
    update that still learned (seen in a PPO run from scratch; rerun with this, its collapsed
    policy still stood at 0.49 error: its clients' near-zero updates keep the median small)."""
    return [n for n in unit_norms if n > 0]


def peak_step(peak: float, recent: Sequence[float]) -> float:
    """The run's peak typical step after `recent` accepted unit norms: the largest median of at
    least PEAK_WINDOW step sizes seen so far."""
    steps = step_sizes(recent)
    return max(peak, statistics.median(steps)) if len(steps) >= PEAK_WINDOW else peak


def step_floor(peak: float) -> float:
    """The least median step the clip and the refusal compare with, given the run's peak."""
    return PEAK_SHARE * peak


def outlier_reason(
    norm: float, reference: Sequence[float], config: AggregationConfig, floor: float = 0.0
) -> str | None:
    """Why an update of this unit norm (per unit of its scale) is refused next to the `reference` unit norms
    (recent accepted updates and those queued with it), their median at least `floor`, or None.
    Honest updates of one run stay within a few times their median (2.5x at most of 3,760 raw
    norms in the chaos benchmark); ×100 does not."""
    steps = step_sizes(reference)
    if not config.refuse_multiple or len(steps) < MIN_REFERENCE:
        return None
    median = max(statistics.median(steps), floor)
    if norm <= config.refuse_multiple * median:
        return None
    return (
        f"update unit norm {norm:.4g} is {norm / median:.0f}x the median {median:.4g} of recent updates "
        f"(refused beyond {config.refuse_multiple:g}x)"
    )


def clip_delta(delta: Mapping[str, torch.Tensor], max_norm: float) -> dict[str, torch.Tensor]:
    norm = update_norm(delta)
    if norm <= max_norm:
        return dict(delta)  # untouched, bit for bit
    return {k: t * (max_norm / norm) for k, t in delta.items()}


def norm_bound(
    unit_norms: Sequence[float],
    config: AggregationConfig,
    reference: Sequence[float] = (),
    floor: float = 0.0,
) -> float | None:
    """The adaptive clip's bound per unit of scale, given the unit norms of the updates at hand and the
    clip's `reference` (the unit norms of recent accepted and concurrent updates), their median at
    least `floor`; None when off, or when none of them moved anything."""
    steps = step_sizes([*reference, *unit_norms])
    if not config.clip_multiple or not steps:
        return None
    return config.clip_multiple * max(statistics.median(steps), floor)


def clip_limit(update: Update, config: AggregationConfig, bound: float | None) -> float:
    """The largest norm `update` may bring: the fixed clip, and the adaptive `bound` (per unit,
    from norm_bound) times its scale, whichever is smaller; inf when neither is on."""
    limits = [config.clip_norm or math.inf]
    if bound is not None:
        limits.append(bound * update.scale)
    return min(limits)


def aggregate_block(
    updates: list[Update], config: AggregationConfig, bound: float | None = None
) -> dict[str, torch.Tensor]:
    """The combined delta for one block (every update must name the same tensors), each delta
    first clipped to its clip_limit (`bound` from norm_bound; None: only the fixed clip)."""
    if not updates:
        raise ValueError("no updates to aggregate")
    names = set(updates[0].delta)
    if any(set(u.delta) != names for u in updates):
        raise ValueError("updates of one block name different tensors")
    deltas = [clip_delta(u.delta, clip_limit(u, config, bound)) for u in updates]
    if config.robust == "mean":
        weights = torch.tensor(
            [u.num_samples * u.weight * staleness_weight(u.staleness, config.alpha) for u in updates]
        )
        if weights.sum() <= 0:  # no update may move the block
            return {n: torch.zeros_like(deltas[0][n]) for n in names}
        weights = weights / weights.sum()
        return {n: sum(w * d[n] for w, d in zip(weights.tolist(), deltas)) for n in names}
    out = {}
    for n in names:
        stacked = torch.stack([d[n] for d in deltas])
        if config.robust == "median":
            out[n] = stacked.median(dim=0).values
        else:
            # at least one from each end once there are three: a trimmed mean that trims nothing
            # (10% of a buffer of 3) is the plain mean
            k = max(int(config.trim_fraction * len(deltas)), 1 if len(deltas) >= 3 else 0)
            ordered = stacked.sort(dim=0).values
            out[n] = ordered[k : len(deltas) - k].mean(dim=0)
    return out
