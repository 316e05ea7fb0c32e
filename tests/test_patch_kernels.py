"""The compiled passes against numpy's whole-array forms of the same definitions, on every
unsigned width, at sizes around the block (tails, empty tensors) and at any density."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from numba.core.errors import TypingError
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


FLOAT_LAYOUT = {2: (7, 8), 4: (23, 8), 8: (52, 11)}  # mantissa and exponent bits by width (bf16)


def exponent_fields(bits: np.ndarray) -> np.ndarray:
    mantissa, exponent = FLOAT_LAYOUT[bits.dtype.itemsize]
    return ((bits >> bits.dtype.type(mantissa)) & bits.dtype.type((1 << exponent) - 1)).astype(np.int64)


@settings(max_examples=200, deadline=None)
@given(bit_arrays(), st.integers(0, 70))
def test_changed_positions_are_where_the_patterns_differ_and_the_sample_is_strided(arrays, stride):
    base, new = arrays
    out = np.full(base.size, -1, np.int64)
    if base.dtype.itemsize == 1:  # no float is one byte wide: no sample
        stride, mantissa, sampled = 0, 0, np.zeros(1, np.int64)
    else:
        mantissa, exponent = FLOAT_LAYOUT[base.dtype.itemsize]
        sampled = np.zeros(1 << exponent, np.int64)
    count = patch_kernels.changed_into(base, new, out, stride, mantissa, sampled)
    assert np.array_equal(out[:count], np.flatnonzero(base != new))
    if stride:
        expected = np.bincount(exponent_fields(base[::stride]), minlength=sampled.size)
        assert np.array_equal(sampled, expected)
    else:
        assert not sampled.any()


def test_the_block_compares_refuse_arrays_they_cannot_read_as_whole_unsigned_vectors():
    """The passes load BLOCK values as one vector and compare unsigned: a strided view or a
    signed array must fail to compile, not give a wrong mask."""
    bits = np.arange(4 * BLOCK, dtype=np.uint16)
    out, sampled = np.empty(bits.size, np.int64), np.zeros(1, np.int64)
    for base in (bits[::2], bits.view(np.int16)):
        with pytest.raises(TypingError):
            patch_kernels.changed_into(base, base.copy(), out, 0, 0, sampled)
    with pytest.raises(TypingError):
        patch_kernels.near_into(
            bits.view(np.int16), np.int16(0x7FFF), np.int16(1 << 7), 7, 256, out, out.copy()
        )


@settings(max_examples=200, deadline=None)
@given(bit_arrays(), st.integers(0, 2**11 - 1))
def test_near_positions_are_by_exponent_then_position(arrays, below):
    bits, _ = arrays
    if bits.dtype.itemsize == 1:
        return  # no float is one byte wide
    mantissa, exponent = FLOAT_LAYOUT[bits.dtype.itemsize]
    below %= 1 << exponent
    word = bits.dtype.type
    magnitude_mask, limit = word((1 << (mantissa + exponent)) - 1), word(below << mantissa)
    found, out = np.empty(bits.size, np.int64), np.full(bits.size, -1, np.int64)
    count = patch_kernels.near_into(bits, magnitude_mask, limit, mantissa, 1 << exponent, found, out)
    near = np.flatnonzero((bits & magnitude_mask) < limit)
    field = (bits[near] >> word(mantissa)) & word((1 << exponent) - 1)
    assert np.array_equal(out[:count], near[np.argsort(field, kind="stable")])


def planes(values: np.ndarray, width) -> np.ndarray:
    """Values in `width` as byte planes (all low bytes, then the next...), as streams travel."""
    itemsize = np.dtype(width).itemsize
    return np.ascontiguousarray(values.astype(width).view(np.uint8).reshape(-1, itemsize).T).reshape(-1)


KINDS = {
    "raw": patch_kernels.VALUES_RAW,
    "sign": patch_kernels.VALUES_SIGN,
    "delta": patch_kernels.VALUES_DELTA,
}
NOTHING = (np.uint64(0), np.uint64(0))  # no magnitude lies under 0: no tier to stay outside


@settings(max_examples=300, deadline=None)
@given(bit_arrays(), st.booleans(), st.sampled_from(sorted(KINDS)), st.integers(0, 2**32 - 1))
def test_a_scatter_writes_each_stream_as_it_travels(arrays, is_float, kind, seed):
    """Streams in the encoder's numpy forms (`ordered`, `zigzag`: distances across zero and
    wrapping; byte planes; escapes in a narrower width) are written back to exactly the new
    bits, the old ones kept."""
    base, target = arrays
    rng = np.random.default_rng(seed)
    positions = some_positions(base.size, seed)
    target = target.copy()
    if kind == "sign":  # one ulp either way at each position
        step = rng.choice([-1, 1], positions.size).astype(ordered(base, is_float).dtype)
        moved = (ordered(base[positions], is_float) + step).view(base.dtype)
        target[positions] = ordered(moved, is_float).view(base.dtype)
    z = zigzag(ordered(target[positions], is_float) - ordered(base[positions], is_float))
    escapes, itemsize = np.empty(0, base.dtype), base.dtype.itemsize
    if kind == "raw":
        data = planes(target[positions], base.dtype)
    elif kind == "sign":
        data, itemsize = np.packbits(z == 2, bitorder="little"), 0
    else:
        narrower = [w for w in WIDTHS if np.dtype(w).itemsize < base.dtype.itemsize]
        if not narrower:
            return  # a byte-wide tensor's distances travel raw
        width = narrower[rng.integers(len(narrower))]
        largest = np.iinfo(width).max
        escaped = z >= largest
        data, escapes, itemsize = (
            planes(np.where(escaped, largest, z), width),
            z[escaped],
            np.dtype(width).itemsize,
        )
    bits = base.copy()
    old, new = np.empty_like(bits, shape=positions.size), np.empty_like(bits, shape=positions.size)
    fault, wrote = patch_kernels.scatter_into(
        bits, positions, data, KINDS[kind], itemsize, escapes, is_float, *NOTHING, old, new
    )
    assert (fault, wrote) == (patch_kernels.OK, positions.size)
    assert np.array_equal(old, base[positions]) and np.array_equal(new, target[positions])
    expected = base.copy()
    expected[positions] = target[positions]
    assert np.array_equal(bits, expected)


def test_a_scatter_stops_at_a_fault_and_keeps_what_it_overwrote():
    base = np.array([1, 1, 6, 1, 1, 3, 1, 1, 9, 1], np.uint16) << np.uint16(7)  # exponent fields, bf16
    positions = np.array([2, 5, 8])  # exponents 6, 3, 9
    one_escape = planes(np.array([3, 255, 1]), np.uint8)  # the middle value escapes uint8
    fine = np.array([9], np.uint16)
    tier = (np.uint64(0x7FFF), np.uint64(4 << 7))  # magnitudes under exponent 4: the middle one
    escapes_differ, in_tier = patch_kernels.SCATTER_ESCAPES_DIFFER, patch_kernels.SCATTER_IN_NEAR_TIER
    cases = {  # data, kind, itemsize, escapes, tier -> fault, values written
        "escape missing": ((one_escape, "delta", 1, np.empty(0, np.uint16), NOTHING), (escapes_differ, 1)),
        "escape extra": ((one_escape, "delta", 1, np.array([9, 9], np.uint16), NOTHING), (escapes_differ, 3)),
        "escapes to a raw stream": (
            (planes(base[positions], np.uint16), "raw", 2, fine, NOTHING),
            (escapes_differ, 3),
        ),
        "a position in the near tier": ((one_escape, "delta", 1, fine, tier), (in_tier, 1)),
        "none": ((one_escape, "delta", 1, fine, NOTHING), (patch_kernels.OK, 3)),
    }
    for reason, ((data, kind, itemsize, escapes, outside), expected) in cases.items():
        bits = base.copy()
        old, new = np.zeros(3, np.uint16), np.zeros(3, np.uint16)
        fault, wrote = patch_kernels.scatter_into(
            bits, positions, data, KINDS[kind], itemsize, escapes, True, *outside, old, new
        )
        assert (fault, wrote) == expected, reason
        untouched = np.setdiff1d(np.arange(base.size), positions[:wrote])
        assert np.array_equal(bits[untouched], base[untouched]), reason
        assert np.array_equal(old[:wrote], base[positions[:wrote]]), reason


def some_positions(size: int, seed: int) -> np.ndarray:
    return np.flatnonzero(np.random.default_rng(seed).random(size) < 0.5)


@settings(max_examples=200, deadline=None)
@given(bit_arrays(), st.booleans(), st.integers(0, 2**32 - 1))
def test_distances_are_the_zigzagged_key_differences(arrays, is_float, seed):
    base, new = arrays
    positions = some_positions(base.size, seed)
    expected = zigzag(ordered(new[positions], is_float) - ordered(base[positions], is_float))
    z, after, escapes = np.empty_like(expected), np.empty_like(expected), np.zeros(3, np.int64)
    lowest, highest = patch_kernels.distances_into(base, new, positions, is_float, z, after, escapes)
    assert np.array_equal(z, expected) and np.array_equal(after, new[positions])
    if z.size:
        assert (lowest, highest) == (z.min(), z.max())
    thresholds = [np.iinfo(w).max for w in (np.uint8, np.uint16, np.uint32)]
    assert list(escapes) == [int(np.count_nonzero(expected >= t)) for t in thresholds]


@settings(max_examples=200, deadline=None)
@given(bit_arrays(), st.integers(0, 2**32 - 1))
def test_a_tier_split_flags_the_near_values_that_changed_and_keeps_the_rest_as_far(arrays, seed):
    base, new = arrays
    rng = np.random.default_rng(seed)
    word = base.dtype.type
    magnitude_mask = word(_all_ones(base.dtype) >> 1)
    limit = word(rng.integers(0, _all_ones(base.dtype) >> 1, dtype=base.dtype, endpoint=True))
    is_near = (base & magnitude_mask) < limit
    near = rng.permutation(np.flatnonzero(is_near))  # the tier's order is the caller's
    changed = np.flatnonzero(base != new)
    flags, near_changed, far = (
        np.full((near.size + 7) // 8, 255, np.uint8),
        np.empty_like(near),
        np.empty_like(changed),
    )
    moved, outside = patch_kernels.split_tier(
        base, new, changed, near, magnitude_mask, limit, flags, near_changed, far
    )
    differs = base[near] != new[near]
    assert np.array_equal(flags, np.packbits(differs, bitorder="little"))
    assert np.array_equal(near_changed[:moved], near[differs])
    assert np.array_equal(far[:outside], changed[~is_near[changed]])
    kept = near.copy()  # the decoder's way back: the flagged positions, in the tier's order
    assert np.array_equal(kept[: patch_kernels.flagged_into(kept, flags)], near[differs])


def _all_ones(dtype) -> int:
    return int(np.iinfo(dtype).max)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 2**36), max_size=300), st.integers(0, 40))
def test_gaps_and_rice_codes_are_numpys(steps, k):
    positions = np.cumsum(np.array(steps, np.int64)) - 1  # from 0, strictly increasing
    gaps, escapes = np.empty(positions.size, np.uint64), np.zeros(3, np.int64)
    patch_kernels.gaps_into(positions, gaps, escapes)
    expected = np.diff(positions, prepend=0).astype(np.uint64)
    assert np.array_equal(gaps, expected)
    thresholds = [np.iinfo(w).max for w in (np.uint8, np.uint16, np.uint32)]
    assert list(escapes) == [int(np.count_nonzero(expected >= t)) for t in thresholds]
    # Rice codes: quotients in unary (0s, then a 1), then the k low bits of each, as bit streams
    small = gaps[gaps >> np.uint64(k) < 4096]  # a unary stream of reasonable length
    quotients = (small >> np.uint64(k)).astype(np.int64)
    unary = np.zeros(int(quotients.sum()) + small.size, dtype=bool)
    unary[np.cumsum(quotients + 1) - 1] = True
    low = (small[:, None] >> np.arange(k, dtype=np.uint64)) & np.uint64(1)
    reference = (
        np.packbits(unary, bitorder="little").tobytes()
        + np.packbits(low.astype(bool), bitorder="little").tobytes()
    )
    out = np.zeros(len(reference), np.uint8)
    assert out[: patch_kernels.rice_into(small, k, out)].tobytes() == reference


@settings(max_examples=200, deadline=None)
@given(bit_arrays(), st.integers(0, 2))
def test_narrowed_planes_escape_what_does_not_fit_and_read_back(arrays, narrower):
    values, _ = arrays
    widths = [w for w in WIDTHS if np.dtype(w).itemsize < values.dtype.itemsize]
    if not widths:
        return  # nothing is narrower than a byte
    width = widths[narrower % len(widths)]
    largest = np.iinfo(width).max
    escaped = values >= largest
    out, escapes = (
        np.empty(values.size * np.dtype(width).itemsize, np.uint8),
        np.empty(escaped.sum(), values.dtype),
    )
    patch_kernels.planes_into(values, np.dtype(width).itemsize, out, escapes)
    assert np.array_equal(out, planes(np.where(escaped, largest, values), width))
    assert np.array_equal(escapes, values[escaped])
