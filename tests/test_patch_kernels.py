"""The compiled passes against numpy's whole-array forms of the same definitions, on every
unsigned width, at sizes around the block (tails, empty tensors) and at any density."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from ulp_keys import ordered, zigzag

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
    low_bits = width(1) << width(rng.integers(0, 8 * np.dtype(width).itemsize))  # a bit, or any bits:
    new[flip] ^= rng.integers(1, low_bits, flip.sum(), dtype=width, endpoint=True)  # ulps to sign flips
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


@settings(max_examples=200, deadline=None)
@given(bit_arrays(), st.booleans(), st.booleans(), st.integers(0, 2**32 - 1))
def test_a_scatter_writes_what_the_encoder_measured(arrays, is_float, raw, seed):
    """Distances taken by the encoder's numpy forms (`ordered`, `zigzag`), across zero and
    wrapping, are added back by the kernel to exactly the new bits; raw streams are copied."""
    base, target = arrays
    positions = np.flatnonzero(np.random.default_rng(seed).random(base.size) < 0.5)
    stream = (
        target[positions]
        if raw
        else zigzag(ordered(target[positions], is_float) - ordered(base[positions], is_float))
    )
    bits = base.copy()
    old, new = np.empty_like(bits, shape=positions.size), np.empty_like(bits, shape=positions.size)
    patch_kernels.scatter_into(bits, positions, stream, raw, is_float, old, new)
    assert np.array_equal(old, base[positions]) and np.array_equal(new, target[positions])
    expected = base.copy()
    expected[positions] = target[positions]
    assert np.array_equal(bits, expected)


@settings(max_examples=200, deadline=None)
@given(bit_arrays(), st.booleans())
def test_distances_are_the_zigzagged_key_differences(arrays, is_float):
    base, new = arrays
    expected = zigzag(ordered(new, is_float) - ordered(base, is_float))
    z, escapes = np.empty_like(new), np.zeros(3, np.int64)
    lowest, highest = patch_kernels.distances_into(base, new, is_float, z, escapes)
    assert np.array_equal(z, expected)
    if z.size:
        assert (lowest, highest) == (z.min(), z.max())
    thresholds = [np.iinfo(w).max for w in (np.uint8, np.uint16, np.uint32)]
    assert list(escapes) == [int(np.count_nonzero(expected >= t)) for t in thresholds]
