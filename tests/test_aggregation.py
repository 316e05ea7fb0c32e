import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedrl.strategies.aggregation import (
    PEAK_SHARE,
    PEAK_WINDOW,
    AggregationConfig,
    Update,
    aggregate_block,
    clip_delta,
    clip_limit,
    norm_bound,
    older_base,
    outlier_reason,
    peak_step,
    rejection_reason,
    staleness_weight,
    step_floor,
    update_norm,
)


def upd(value, n=1, tau=0, node=0):
    return Update(node, 0, {"w": torch.full((3,), float(value))}, n, tau)


def test_weighted_mean_with_staleness_discount():
    cfg = AggregationConfig(alpha=0.5)
    out = aggregate_block([upd(1.0, n=10, tau=0), upd(4.0, n=10, tau=3)], cfg)["w"]
    a, b = 10 * 1.0, 10 * (1 + 3) ** -0.5
    assert torch.allclose(out, torch.full((3,), (a * 1.0 + b * 4.0) / (a + b)))
    assert staleness_weight(0, 0.5) == 1.0 and staleness_weight(3, 0.5) == 0.5


def test_a_clients_reputation_scales_its_weight_in_the_mean():
    low_trust = Update(1, 0, {"w": torch.full((3,), 9.0)}, 10, 0, weight=0.1)
    out = aggregate_block([upd(1.0, n=10), low_trust], AggregationConfig())["w"]
    assert torch.allclose(out, torch.full((3,), (1.0 * 1.0 + 0.1 * 9.0) / 1.1))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(-5, 5), st.integers(1, 100), st.integers(0, 4)), min_size=1, max_size=8))
def test_mean_lies_within_the_updates(items):
    out = aggregate_block([upd(v, n, t) for v, n, t in items], AggregationConfig())["w"][0].item()
    values = [v for v, _, _ in items]
    assert min(values) - 1e-5 <= out <= max(values) + 1e-5


def test_robust_options_resist_an_outlier():
    updates = [upd(1.0), upd(1.1), upd(0.9), upd(1.0), upd(1000.0)]
    assert aggregate_block(updates, AggregationConfig(robust="median"))["w"][0].item() == pytest.approx(1.0)
    trimmed = aggregate_block(updates, AggregationConfig(robust="trimmed-mean", trim_fraction=0.2))["w"][
        0
    ].item()
    assert trimmed == pytest.approx((1.0 + 1.1 + 1.0) / 3)
    cfg = AggregationConfig(clip_norm=math.sqrt(3))
    clipped = aggregate_block(updates, cfg, norm_bound([update_norm(u.delta) for u in updates], cfg))["w"]
    assert clipped.max().item() <= 1.0 + 1e-6


def test_clip_scales_down_only():
    delta = {"a": torch.tensor([3.0, 4.0])}
    assert torch.allclose(clip_delta(delta, 1.0)["a"], torch.tensor([0.6, 0.8]))
    assert torch.equal(clip_delta(delta, 10.0)["a"], delta["a"])


def test_rejections():
    cfg = AggregationConfig(max_staleness=2)
    assert "non-finite" in rejection_reason(Update(0, 0, {"w": torch.tensor([float("nan")])}, 1, 0), cfg)
    assert "non-finite" in rejection_reason(Update(0, 0, {"w": torch.tensor([float("inf")])}, 1, 0), cfg)
    assert "exceeds" in rejection_reason(upd(1.0, tau=3), cfg)
    assert "future" in rejection_reason(upd(1.0, tau=-1), cfg)
    assert "num_samples" in rejection_reason(upd(1.0, n=0), cfg)
    assert rejection_reason(upd(1.0, tau=2), cfg) is None
    with pytest.raises(ValueError):
        AggregationConfig(robust="krum-ish")


def honest_and_attackers(scale, n_honest=8, n_attack=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    honest = [Update(i, 0, {"w": 0.01 * torch.randn(64, generator=g) + 0.01}, 16, 0) for i in range(n_honest)]
    mean = sum(u.delta["w"] for u in honest) / n_honest
    attackers = [Update(100 + i, 0, {"w": scale * mean}, 16, 0) for i in range(n_attack)]
    return honest, attackers, mean


@pytest.mark.parametrize("scale", [100.0, -100.0])
def test_the_adaptive_clip_bounds_20_percent_scaled_or_flipped_attackers(scale):
    """With the plain mean, 20% of clients sending x100 (or sign-flipped x100) updates put the
    result ~20 honest-norms away. Clipped, the attackers move it by at most their weight (0.2)
    times the bound (3x the median norm): bounded, not neutralized (a flipped x3 still pulls)."""
    honest, attackers, mean = honest_and_attackers(scale)
    cfg = AggregationConfig(clip_multiple=3.0)
    plain = aggregate_block(honest + attackers, AggregationConfig())["w"]
    bound = norm_bound([update_norm(u.delta) for u in honest + attackers], cfg)
    clipped = aggregate_block(honest + attackers, cfg, bound)["w"]
    assert float((plain - mean).norm() / mean.norm()) > 15
    assert float((clipped - 0.8 * mean).norm()) <= 0.2 * bound + 1e-6


def test_the_adaptive_clip_scales_with_the_square_root_of_an_updates_steps():
    """A fast client's 16 steps bring 4x the norm of a slow client's 1 honestly; at the median
    per √step it is untouched, while a 1-step update of the same norm is cut to the median."""
    cfg = AggregationConfig(clip_multiple=1.0)
    slow = [dataclasses.replace(upd(1.0, node=i), steps=1) for i in range(3)]
    fast = dataclasses.replace(upd(4.0, node=3), steps=16)
    boaster = dataclasses.replace(upd(4.0, node=4), steps=1)
    assert fast.norm == pytest.approx(4 * slow[0].norm) and fast.unit_norm == pytest.approx(slow[0].unit_norm)
    bound = norm_bound([u.unit_norm for u in [*slow, fast, boaster]], cfg)
    assert bound == pytest.approx(slow[0].norm)  # the median unit norm
    assert clip_limit(fast, cfg, bound) == pytest.approx(4 * bound)
    assert torch.equal(aggregate_block([fast], cfg, bound)["w"], fast.delta["w"])  # bit for bit
    cut = aggregate_block([boaster], cfg, bound)["w"]
    assert float(cut.norm()) == pytest.approx(bound, rel=1e-6)
    # the fixed clip still caps every update, whatever its steps
    capped = AggregationConfig(clip_multiple=1.0, clip_norm=0.5 * fast.norm)
    assert clip_limit(fast, capped, bound) == pytest.approx(0.5 * fast.norm)
    assert clip_limit(fast, AggregationConfig(), None) == math.inf


def test_an_error_feedback_upload_is_measured_per_step_of_all_its_rounds():
    """Top-k uploads whose residuals have gathered 10, 20 and 40 steps bring norms 1, 2 and 4,
    as error feedback's do: at the median per step each passes bit for bit, where per √step the
    older ones would be cut. A round's delta of the same steps and norm keeps the √ scale."""
    cfg = AggregationConfig(clip_multiple=1.0)
    uploads = [
        dataclasses.replace(upd(v, node=i), steps=s, feedback=True)
        for i, (v, s) in enumerate([(1, 10), (2, 20), (4, 40)])
    ]
    assert [u.scale for u in uploads] == [10.0, 20.0, 40.0]
    assert len({round(u.unit_norm, 12) for u in uploads}) == 1
    bound = norm_bound([u.unit_norm for u in uploads], cfg)
    for u in uploads:
        assert torch.equal(aggregate_block([u], cfg, bound)["w"], u.delta["w"])
    per_root_step = [dataclasses.replace(u, feedback=False) for u in uploads]
    assert per_root_step[2].scale == pytest.approx(math.sqrt(40))
    root_bound = norm_bound([u.unit_norm for u in per_root_step], cfg)
    assert clip_limit(per_root_step[2], cfg, root_bound) < per_root_step[2].norm  # would be cut
    # an upload twice its step count's share is still cut to it
    boaster = dataclasses.replace(upd(8, node=3), steps=40, feedback=True)
    cut = aggregate_block([boaster], cfg, bound)["w"]
    assert float(cut.norm()) == pytest.approx(uploads[2].norm, rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_the_adaptive_clip_leaves_honest_updates_bit_identical(seed):
    honest, _, _ = honest_and_attackers(1.0, seed=seed)
    recent = [update_norm(u.delta) for u in honest]
    bound = norm_bound(recent, AggregationConfig(clip_multiple=3.0), recent)
    assert bound > max(recent)
    plain = aggregate_block(honest, AggregationConfig())["w"]
    assert torch.equal(aggregate_block(honest, AggregationConfig(clip_multiple=3.0), bound)["w"], plain)


def test_recent_norms_bound_a_buffer_that_is_mostly_attackers():
    """Two x100 updates in a buffer of three: the median of the buffer alone is an attacker's,
    the block's recent history is not."""
    honest, attackers, mean = honest_and_attackers(100.0, n_honest=1)
    history = [update_norm(u.delta) for u in honest_and_attackers(1.0)[0]]
    cfg = AggregationConfig(clip_multiple=3.0)
    bound = norm_bound([update_norm(u.delta) for u in honest + attackers], cfg, history)
    out = aggregate_block(honest + attackers, cfg, bound)["w"]
    assert float(out.norm()) <= 3.0 * sorted(history)[len(history) // 2] + 1e-6
    with pytest.raises(ValueError, match="clip_multiple"):
        AggregationConfig(clip_multiple=0.5)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([100.0, -100.0, 20.0]))
def test_updates_far_beyond_their_peers_norms_are_refused_and_honest_ones_never(seed, scale):
    """×100 (or a sign-flipped ×100, or ×20) of an honest update is refused next to the norms
    of honest ones; every honest update passes; ×3 (inside the bound) is left to the clip."""
    honest, attackers, mean = honest_and_attackers(scale, seed=seed)
    cfg = AggregationConfig(clip_multiple=3.0, refuse_multiple=10.0)
    norms = [update_norm(u.delta) for u in honest]
    assert all(outlier_reason(n, norms, cfg) is None for n in norms)
    reason = outlier_reason(update_norm(attackers[0].delta), norms, cfg)
    assert reason and "refused beyond 10x" in reason
    assert outlier_reason(3 * float(mean.norm()), norms, cfg) is None


def test_the_norm_refusal_needs_peers_and_can_be_off():
    cfg = AggregationConfig(refuse_multiple=10.0)
    assert outlier_reason(1e6, [1.0, 1.0], cfg) is None  # too few norms to call anything an outlier
    assert "1000000x the median" in outlier_reason(1e6, [1.0, 1.0, 1.0], cfg)
    assert outlier_reason(1e6, [0.0] * 8 + [1.0, 1.0], cfg) is None  # two step sizes: too few
    assert outlier_reason(1e6, [1.0] * 8, AggregationConfig()) is None  # off by default here
    with pytest.raises(ValueError, match="refuse_multiple"):
        AggregationConfig(refuse_multiple=0.5)


def test_updates_of_zeros_say_nothing_about_step_sizes():
    """A collapsed policy's clients send exact zeros round after round (every group scored
    alike). The median of their norms is 0: an update that still learned must be neither
    refused as infinitely far beyond it nor clipped to nothing; the median is over the updates
    that moved something."""
    cfg = AggregationConfig(clip_multiple=1.0, refuse_multiple=10.0)
    history = [0.0] * 20 + [0.8, 1.0, 1.2]
    assert outlier_reason(1.1, history, cfg) is None
    assert "is 20x the median 1" in outlier_reason(20.0, history, cfg)
    assert norm_bound([0.0, 1.1], cfg, history) == pytest.approx(1.05)
    learned = Update(1, 0, {"w": torch.full((4,), 1.5)}, 10, 0)  # norm 3
    merged = aggregate_block([learned], cfg, norm_bound([learned.unit_norm], cfg, history))["w"]
    assert float(merged.norm()) == pytest.approx(1.1)  # clipped to the median step size, not to zero
    assert norm_bound([0.0, 0.0], cfg, [0.0] * 5) is None  # nothing moved: nothing to clip to


def test_a_quiet_majority_does_not_cut_the_updates_that_still_learn():
    """Most clients' updates go nearly silent (a policy collapsed onto one answer per prompt
    scores whole groups alike) while a few still learn at the run's usual size. The median of
    recent norms falls 100x, and before the floor the clip cut every learning update to it and
    the refusal turned them away; now they are measured against half the run's peak typical
    step. An attacker in the quiet spell gets no more room than that."""
    cfg = AggregationConfig(clip_multiple=1.0, refuse_multiple=10.0)
    peak = 0.0
    loud = [1.0, 0.9, 1.1, 1.2, 0.8] * 4  # the run's early steps
    for n in range(1, len(loud) + 1):
        peak = peak_step(peak, loud[:n])
    assert peak == pytest.approx(1.0)  # set once PEAK_WINDOW step sizes were there
    quiet = [0.01] * 50 + [1.0, 1.1] * 5  # the last 60: mostly silent, a few still learning
    peak = peak_step(peak, quiet)
    assert peak == pytest.approx(1.0)  # a quiet spell does not lower it
    floor = step_floor(peak)
    assert floor == PEAK_SHARE * peak
    # without the floor: a learning update is "100x the median" and clipped to 1% of itself
    assert "100x the median" in outlier_reason(1.0, quiet, cfg)
    assert norm_bound([1.0], cfg, quiet) == pytest.approx(0.01)
    # with it: accepted, and clipped to half the peak at the least
    assert outlier_reason(1.0, quiet, cfg, floor) is None
    assert norm_bound([1.0], cfg, quiet, floor) == pytest.approx(PEAK_SHARE)
    learned = Update(1, 0, {"w": torch.full((4,), 0.5)}, 10, 0)  # norm 1
    merged = aggregate_block([learned], cfg, norm_bound([learned.unit_norm], cfg, quiet, floor))["w"]
    assert float(merged.norm()) == pytest.approx(PEAK_SHARE)
    # x100 of a step of the run is still refused, and the clip is the run's own scale
    assert "refused beyond 10x" in outlier_reason(100.0, quiet, cfg, floor)
    assert norm_bound([9.0], cfg, quiet, floor) == pytest.approx(PEAK_SHARE)
    # where the median is above the floor, the floor changes nothing
    assert norm_bound([1.0], cfg, loud, floor) == norm_bound([1.0], cfg, loud)


def test_the_peak_needs_a_full_window_of_steps():
    """A few updates cannot set the peak: two attackers' x100 among the first updates would
    otherwise raise the floor of the whole run."""
    early = [1.0, 100.0, 100.0]
    assert peak_step(0.0, early) == 0.0 and step_floor(0.0) == 0.0
    window = [1.0] * (PEAK_WINDOW - 3) + [100.0] * 3
    assert peak_step(0.0, window) == pytest.approx(1.0)  # a median: the minority does not move it
    assert peak_step(0.0, [0.0] * 40) == 0.0  # zeros are no step sizes


def _trajectory(steps: int, seed: int) -> dict[int, dict[str, torch.Tensor]]:
    """Retained global states v0..v(steps): a random walk with a drift, as training makes."""
    g = torch.Generator().manual_seed(seed)
    drift, states = torch.randn(64, generator=g), {0: {"w": torch.zeros(64)}}
    for v in range(1, steps + 1):
        states[v] = {"w": states[v - 1]["w"] + drift + 0.5 * torch.randn(64, generator=g)}
    return states


def test_an_update_made_on_an_old_state_and_labelled_newer_is_found():
    states = _trajectory(6, seed=0)
    step = {"w": 0.1 * torch.ones(64)}
    liar = {"w": states[0]["w"] + step["w"]}  # trained on v0, claims v6
    assert older_base(liar, 6, states) == 0
    assert older_base({"w": states[6]["w"] + step["w"]}, 6, states) is None  # honest
    # a claim one version off is within the slack: an honest update may undo part of a step
    assert older_base({"w": states[5]["w"]}, 6, states) is None
    assert older_base(liar, 1, states) is None  # nothing older than the slack to compare with
    assert older_base(liar, 9, states) is None  # a base that is not retained: judged elsewhere


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**16), st.floats(0.0, 0.49))
def test_an_honest_update_smaller_than_half_the_way_back_is_never_refused(steps, seed, fraction):
    """|new - older| >= |base - older| - |u| > |u| = |new - base| whenever |u| is under half of
    the distance to every older retained state, whatever its direction."""
    states = _trajectory(steps, seed)
    g = torch.Generator().manual_seed(seed + 1)
    direction = torch.randn(64, generator=g)
    nearest_older = min(update_norm({"w": states[steps]["w"] - states[v]["w"]}) for v in range(steps - 1))
    u = direction * (fraction * nearest_older / float(direction.norm()))
    assert older_base({"w": states[steps]["w"] + u}, steps, states) is None


@settings(max_examples=50, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**16), st.integers(0, 1_000), st.floats(0.0, 0.4))
def test_an_update_made_on_an_older_state_is_found_when_the_way_back_is_2_5_times_its_length(
    steps, seed, older, fraction
):
    """A liar's upload lies its update's length from the state it was made on: with that length
    at most 0.4 of the way to the base it names, it is nearer that state by the margin
    (|u| < 0.8 |u - way| once |way| > 2.25 |u|) and within half the way, whatever its direction."""
    states = _trajectory(steps, seed)
    made_on = older % (steps - 1)  # more than the slack behind the base
    way = update_norm({"w": states[steps]["w"] - states[made_on]["w"]})
    g = torch.Generator().manual_seed(seed + 2)
    direction = torch.randn(64, generator=g)
    u = direction * (fraction * way / float(direction.norm()))
    assert older_base({"w": states[made_on]["w"] + u}, steps, states) is not None


def test_an_honest_update_that_turns_back_and_moves_sideways_is_not_a_rollback():
    """What Adam does from scratch: a client's update is larger than a version's move and may
    undo it, overshooting the older state by a tenth of the way and moving sideways by 0.75 of its
    own length (seen in a DG run: nearer that state than the base by 25%). It lands far from the
    older state next to how far the block moved, so it is no liar's: that one lands at its own
    update's length from the state it was made on, however far the block moved since."""
    way = torch.zeros(64)
    way[0] = 0.6  # the block's move from v0 to v2
    states = {0: {"w": torch.zeros(64)}, 1: {"w": torch.zeros(64)}, 2: {"w": way}}
    sideways = torch.zeros(64)
    sideways[1] = 0.75
    update = -1.1 * way + sideways
    new = {"w": states[2]["w"] + update}
    near, claimed = update_norm({"w": new["w"]}), update_norm({"w": update})
    assert near < 0.8 * claimed  # the margin alone called it a rollback
    assert older_base(new, 2, states) is None
    # a liar made on v0 lands its own update's length (0.075) from it, and is found
    assert older_base({"w": 0.1 * sideways}, 2, states) == 0


def test_a_block_whose_updates_all_weigh_nothing_stays_where_it_is():
    """The direction weighting gives an update that points away from the answers weight 0; when
    every update of a block does, the block does not move (0 / 0 would be NaN in every value)."""
    honest, _, _ = honest_and_attackers(1.0)
    nothing = [dataclasses.replace(u, weight=0.0) for u in honest]
    out = aggregate_block(nothing, AggregationConfig())["w"]
    assert torch.equal(out, torch.zeros_like(out))
    # one update with weight: the block moves by exactly that update
    one = [*nothing[:-1], dataclasses.replace(honest[-1], weight=0.3)]
    assert torch.allclose(aggregate_block(one, AggregationConfig())["w"], honest[-1].delta["w"])
