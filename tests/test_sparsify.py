import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedrl.sparsify import top_k_with_feedback


@st.composite
def block(draw):
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    shapes = draw(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 12)), min_size=1, max_size=3))
    base = {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    new = {n: b + 1e-3 * torch.randn(b.shape, generator=g) for n, b in base.items()}
    residual = (
        {n: 1e-3 * torch.randn(b.shape, generator=g) for n, b in base.items()} if draw(st.booleans()) else {}
    )
    return base, new, residual


@settings(max_examples=100, deadline=None)
@given(block(), st.sampled_from([0.01, 0.1, 0.5, 0.99]))
def test_what_is_sent_plus_what_is_kept_is_the_whole_delta(case, density):
    base, new, residual = case
    upload, kept = top_k_with_feedback(base, new, residual, density)
    entries = sum(t.numel() for t in base.values())
    changed = sum(int((upload[n] != base[n]).sum()) for n in base)
    assert changed <= math.ceil(density * entries)
    for n in base:
        delta = new[n] - base[n] + residual.get(n, 0)
        assert torch.allclose(upload[n] - base[n] + kept[n], delta, atol=1e-7)
    smallest_sent = min(
        (
            float((upload[n] - base[n]).abs()[upload[n] != base[n]].min())
            for n in base
            if (upload[n] != base[n]).any()
        ),
        default=0.0,
    )
    assert all(float(kept[n].abs().max()) <= smallest_sent + 1e-6 for n in base)  # the largest went first


def test_error_feedback_sends_everything_eventually():
    """A constant delta sent at 10% density: after enough rounds the sum of uploads is the sum
    of deltas minus a residual that stays bounded (nothing is dropped)."""
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.zeros(100)}
    step = {"w": torch.rand(100, generator=g)}
    residual, sent = {}, torch.zeros(100)
    for _ in range(50):
        upload, residual = top_k_with_feedback(base, step, residual, 0.1)
        sent += upload["w"]
    assert torch.allclose(sent + residual["w"], 50 * step["w"], rtol=1e-5)
    assert float(residual["w"].abs().max()) < 10 * float(step["w"].max())


def test_density_one_sends_the_block_as_is():
    base, new = {"w": torch.zeros(4)}, {"w": torch.arange(4.0)}
    assert top_k_with_feedback(base, new, {}, 1.0) == (new, {})
