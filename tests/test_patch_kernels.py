"""The compiled passes against numpy's whole-array forms of the same definitions, on every
unsigned width, at sizes around the block (tails, empty tensors) and at any density."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fedrl import patch_kernels
from fedrl.patch_kernels import BLOCK

WIDTHS = [np.uint8, np.uint16, np.uint32, np.uint64]


@st.composite
def bit_arrays(draw):
    width = draw(st.sampled_from(WIDTHS))
    size = draw(st.sampled_from([0, 1, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 17, 1000]))
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from([0.0, 0.01, 0.3, 1.0]))
    rng = np.random.default_rng(seed)
    base = rng.integers(0, np.iinfo(width).max, size, dtype=width, endpoint=True)
    new = base.copy()
    flip = rng.random(size) < density
    new[flip] ^= width(1) << width(rng.integers(0, 8 * np.dtype(width).itemsize))
    return base, new


@settings(max_examples=200, deadline=None)
@given(bit_arrays())
def test_changed_positions_are_where_the_patterns_differ(arrays):
    base, new = arrays
    out = np.full(base.size, -1, np.int64)
    count = patch_kernels.changed_into(base, new, out)
    assert np.array_equal(out[:count], np.flatnonzero(base != new))


@settings(max_examples=200, deadline=None)
@given(bit_arrays(), st.integers(0, 2**11 - 1))
def test_near_positions_are_by_exponent_then_position(arrays, below):
    bits, _ = arrays
    if bits.dtype.itemsize == 1:
        return  # no float is one byte wide
    mantissa, exponent = {2: (7, 8), 4: (23, 8), 8: (52, 11)}[bits.dtype.itemsize]
    below %= 1 << exponent
    word = bits.dtype.type
    magnitude_mask, limit = word((1 << (mantissa + exponent)) - 1), word(below << mantissa)
    found, out = np.empty(bits.size, np.int64), np.full(bits.size, -1, np.int64)
    count = patch_kernels.near_into(bits, magnitude_mask, limit, mantissa, 1 << exponent, found, out)
    near = np.flatnonzero((bits & magnitude_mask) < limit)
    field = (bits[near] >> word(mantissa)) & word((1 << exponent) - 1)
    assert np.array_equal(out[:count], near[np.argsort(field, kind="stable")])
