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


@settings(max_examples=200, deadline=None)
@given(bit_arrays())
def test_changed_positions_are_where_the_patterns_differ(arrays):
    base, new = arrays
    out = np.full(base.size, -1, np.int64)
    count = patch_kernels.changed_into(base, new, out)
    assert np.array_equal(out[:count], np.flatnonzero(base != new))


def test_the_block_compares_refuse_arrays_they_cannot_read_as_whole_unsigned_vectors():
    """The passes load BLOCK values as one vector and compare unsigned: a strided view or a
    signed array must fail to compile, not give a wrong mask."""
    bits = np.arange(4 * BLOCK, dtype=np.uint16)
    out = np.empty(bits.size, np.int64)
    for base in (bits[::2], bits.view(np.int16)):
        with pytest.raises(TypingError):
            patch_kernels.changed_into(base, base.copy(), out)
    with pytest.raises(TypingError):
        patch_kernels.near_into(
            bits.view(np.int16), np.int16(0x7FFF), np.int16(1 << 7), 7, 256, out, out.copy()
        )


def tier_order(bits: np.ndarray, below: int) -> tuple[np.ndarray, tuple]:
    """The near tier's positions in numpy (by exponent field, then position), and the tier's
    arguments to the kernels: its magnitude mask and bound, the mantissa's bits and the bins."""
    mantissa, exponent = FLOAT_LAYOUT[bits.dtype.itemsize]
    word, bins = bits.dtype.type, 1 << exponent
    magnitude_mask, limit = word((1 << (mantissa + exponent)) - 1), word((below % bins) << mantissa)
    near = np.flatnonzero((bits & magnitude_mask) < limit)
    field = (bits[near] >> word(mantissa)) & word(bins - 1)
    return near[np.argsort(field, kind="stable")], (magnitude_mask, limit, mantissa, bins)


@settings(max_examples=200, deadline=None)
@given(bit_arrays(), st.integers(0, 2**11 - 1))
def test_near_positions_are_by_exponent_then_position(arrays, below):
    bits, _ = arrays
    if bits.dtype.itemsize == 1:
        return  # no float is one byte wide
    order, tier = tier_order(bits, below)
    found, out = np.empty(bits.size, np.int64), np.full(bits.size, -1, np.int64)
    assert np.array_equal(out[: patch_kernels.near_into(bits, *tier, found, out)], order)


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
    z, escapes = np.empty_like(expected), np.zeros(3, np.int64)
    lowest, highest = patch_kernels.distances_into(base[positions], new[positions], is_float, z, escapes)
    assert np.array_equal(z, expected)
    if z.size:
        assert (lowest, highest) == (z.min(), z.max())
    thresholds = [np.iinfo(w).max for w in (np.uint8, np.uint16, np.uint32)]
    assert list(escapes) == [int(np.count_nonzero(expected >= t)) for t in thresholds]


@settings(max_examples=200, deadline=None)
@given(bit_arrays(), st.integers(0, 2**11 - 1))
def test_one_tier_pass_flags_the_near_values_that_changed_and_keeps_the_rest_as_far(arrays, below):
    """Against numpy: the flags in the tier's order, the near changes in that order with their
    bits before and after, the far changes sorted; and the decoder's pass reads them back."""
    base, new = arrays
    if base.dtype.itemsize == 1:
        return  # no float is one byte wide
    near_order, tier = tier_order(base, below)
    held, size, (magnitude_mask, limit) = near_order.size, base.size, tier[:2]
    found, kept = np.empty(size, np.int64), np.empty((2, size), base.dtype)
    flags, near, values, far = (
        np.full((size + 7) // 8, 255, np.uint8),
        np.full(size + 1, -1, np.int64),
        np.empty((2, size + 1), base.dtype),
        np.full(size, -1, np.int64),
    )
    count, moved, outside = patch_kernels.tier_into(base, new, *tier, found, kept, flags, near, values, far)
    differs = base[near_order] != new[near_order]
    assert count == held
    assert np.array_equal(flags[: (held + 7) // 8], np.packbits(differs, bitorder="little"))
    assert np.array_equal(near[:moved], near_order[differs])
    assert np.array_equal(values[0, :moved], base[near_order[differs]])
    assert np.array_equal(values[1, :moved], new[near_order[differs]])
    changed = np.flatnonzero(base != new)
    assert np.array_equal(far[:outside], changed[(base[changed] & magnitude_mask) >= limit])
    back = near_order.copy()  # the decoder's way back: the flagged positions, in the tier's order
    assert np.array_equal(back[: patch_kernels.flagged_into(back, flags)], near[:moved])


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


def optimizer_bits(width: int, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """bf16 (width 2, float32's top half) or float32 bit patterns before and after a step of
    fixed size: small weights cross many ulps, large ones rarely one."""
    rng = np.random.default_rng(seed)
    master = (rng.standard_normal(n) * 0.02).astype(np.float32)
    moved = master + np.float32(3e-5 if width == 2 else 3e-9) * np.sign(rng.standard_normal(n)).astype(
        np.float32
    )
    if width == 4:
        return master.view(np.uint32), moved.view(np.uint32)
    return (master.view(np.uint32) >> 16).astype(np.uint16), (moved.view(np.uint32) >> 16).astype(np.uint16)


def tier_costs(base, new, mantissa: int, bins: int, runs: int, run: int) -> tuple[dict, float]:
    """The estimate's model in numpy: the bits each threshold costs, over the values of `runs`
    runs of `run` spread evenly (or all of them), scaled to the tensor; and the gaps' cost alone."""
    n = base.size
    if n > runs * run:
        picked = np.concatenate(
            [np.arange(r * (n - run) // (runs - 1), r * (n - run) // (runs - 1) + run) for r in range(runs)]
        )
    else:
        picked = np.arange(n)
    fields = (base[picked] >> base.dtype.type(mantissa)).astype(np.int64) & (bins - 1)
    values = np.cumsum(np.bincount(fields, minlength=bins)) * (n / picked.size)
    changed = np.cumsum(np.bincount(fields[base[picked] != new[picked]], minlength=bins)) * (n / picked.size)
    changes = changed[-1]

    def gap_bits(c):
        return max(c, 0) * (np.log2(n / max(c, 1)) + 1.5)

    def flag_bits(ones, total):
        q = min(max(ones / max(total, 1.0), 1e-12), 1 - 1e-12)
        return total * (0.04 - (q * np.log2(q) + (1 - q) * np.log2(1 - q)))

    costs = {
        below: flag_bits(changed[below - 1], values[below - 1]) + gap_bits(changes - changed[below - 1]) + 256
        for below in range(1, bins)
        if values[below - 1] > (values[below - 2] if below > 1 else 0)  # a bin with values in it
    }
    return costs, gap_bits(changes)


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([2, 4]),
    st.integers(1, 60_000),
    st.integers(0, 2**32 - 1),
    st.sampled_from([(4, 256), (16, 1024)]),
)
def test_the_tiers_estimate_takes_the_cheapest_threshold_of_its_runs(width, n, seed, sampling):
    """`near_tier` against its model in numpy, on runs of the tensor (or all of it, where it is no
    larger): the threshold it names costs the least, or no threshold saves 5% over gaps alone."""
    base, new = optimizer_bits(width, n, seed)
    mantissa, exponent = FLOAT_LAYOUT[width]
    below = patch_kernels.near_tier(base, new, mantissa, 1 << exponent, *sampling)
    costs, gaps_alone = tier_costs(base, new, mantissa, 1 << exponent, *sampling)
    cheapest = min(costs.values(), default=np.inf)
    if below:
        assert costs[below] <= cheapest * (1 + 1e-9) and costs[below] < 0.95 * gaps_alone * (1 + 1e-9)
    else:
        assert not cheapest < 0.95 * gaps_alone * (1 - 1e-9)
    if n > 4 * 256:
        assert (
            patch_kernels.near_tier(base, base.copy(), mantissa, 1 << exponent, *sampling) == 0
        )  # nothing changed
