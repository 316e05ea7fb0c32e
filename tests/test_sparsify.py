import math

import pytest
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
@given(block(), st.sampled_from([0.01, 0.1, 0.5, 0.99, 1.0]))
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


def test_entries_that_tie_at_the_smallest_sent_are_not_all_sent():
    """Before: every entry at the k-th magnitude went, more than the density allows (found by the
    property test above: 3 of 2)."""
    base = {"a": torch.zeros(2), "b": torch.zeros(2)}
    upload, kept = top_k_with_feedback(
        base, {"a": torch.tensor([1.0, 0.5]), "b": torch.tensor([1.0, 1.0])}, {}, 0.5
    )
    assert sum(int((upload[n] != 0).sum()) for n in base) == 2
    assert sorted(torch.cat([kept["a"], kept["b"]]).tolist()) == [0.0, 0.0, 0.5, 1.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_error_feedback_sends_everything_eventually(dtype):
    """A constant delta sent at 10% density: after enough rounds the sum of uploads is the sum
    of deltas minus a residual that stays bounded (nothing is dropped, bfloat16 rounding neither)."""
    g = torch.Generator().manual_seed(0)
    base = {"w": torch.zeros(100, dtype=dtype)}
    step = {"w": torch.rand(100, generator=g)}
    residual, sent = {}, torch.zeros(100)
    for _ in range(50):
        upload, residual = top_k_with_feedback(base, step, residual, 0.1)
        assert upload["w"].dtype == dtype
        sent += upload["w"].float()
    assert torch.allclose(sent + residual["w"], 50 * step["w"], rtol=1e-5)
    assert float(residual["w"].abs().max()) < 10 * float(step["w"].max())


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 2**31), st.sampled_from([0.01, 0.1, 0.5, 1.0]))
def test_a_bfloat16_upload_keeps_its_rounding_in_the_residual(seed, density):
    """Against a base held in bfloat16 (the wire dtype) the upload is bfloat16, changed only where
    it sends, each sent value the nearest bfloat16 to base + delta; float32 upload - base +
    residual is the whole float32 delta."""
    g = torch.Generator().manual_seed(seed)
    base = {"a": 0.05 * torch.randn(8, 16, generator=g), "b": torch.randn(16, generator=g)}
    base = {n: b.bfloat16() for n, b in base.items()}
    new = {n: b.float() + 1e-2 * torch.randn(b.shape, generator=g) for n, b in base.items()}
    residual = {n: 1e-3 * torch.randn(b.shape, generator=g) for n, b in base.items()}
    upload, kept = top_k_with_feedback(base, new, residual, density)
    entries = sum(t.numel() for t in base.values())
    assert sum(int((upload[n] != base[n]).sum()) for n in base) <= math.ceil(density * entries)
    for n in base:
        delta = new[n] - base[n].float() + residual[n]
        assert upload[n].dtype == torch.bfloat16 and kept[n].dtype == torch.float32
        assert torch.allclose(upload[n].float() - base[n].float() + kept[n], delta, atol=1e-7)
        sent = upload[n] != base[n]
        assert torch.equal(upload[n][sent], (base[n].float() + delta)[sent].bfloat16())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_density_one_sends_every_entry_rounded_to_the_wire_dtype(dtype):
    """A dense upload is base + delta in the base's dtype everywhere, with at most half an ulp
    kept. For these values that is the new values cast to the base's dtype, bit for bit (in
    general base + (new - base) may differ from new by a float32 rounding, which is kept too)."""
    g = torch.Generator().manual_seed(0)
    base = {"w": (0.05 * torch.randn(64, generator=g)).to(dtype)}
    new = {"w": base["w"].float() + 1e-3 * torch.randn(64, generator=g)}
    upload, kept = top_k_with_feedback(base, new, {}, 1.0)
    assert upload["w"].dtype == dtype
    assert torch.equal(upload["w"], new["w"].to(dtype))
    delta = new["w"] - base["w"].float()
    assert torch.allclose(upload["w"].float() - base["w"].float() + kept["w"], delta, atol=1e-7)
    ulp = torch.finfo(dtype).eps * new["w"].abs()
    assert bool((kept["w"].abs() <= ulp / 2 + 1e-9).all())
