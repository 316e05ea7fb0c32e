"""The patch codec's loops, compiled (numba): every pass over a tensor's values or over a
stream of changes. `fedrl.patch` keeps the format, the checks and their messages.

The passes over every value (where base and new differ; the near tier's positions; both at
once for a tiered tensor's encoding, `tier_into`) read a tensor's bit patterns once, BLOCK
values at a time: one vector compare over the block makes a 64-bit mask (`_differ_block`,
`_under_block`), and only its set bits are visited (count-trailing-zeros). At RL learning
rates about 1% of a tensor's values change and 0.5-2% are near (see `fedrl.patch._near_limits`),
so most of the time goes to reading. Over SmolLM2's 6-layer block (21M bf16 values, its
tensors laid end to end; a warm memcpy of them: 2.7 ms), against the numpy whole-array steps
they replace (a temporary per step, then `flatnonzero` over the mask): changed positions 7.3
-> 4.1 ms; near positions by exponent 9.5 -> 3.3 ms with 0.5% of the values near and 17.8 ->
9.0 ms with 1.9% (there the counting sort by exponent takes about half). A branch per block to
skip empty ones, or a store per value with the count bumped by the test, ran at 8 ms where the
mask ran at 3.8 (1.9% near, no sort).

The passes over the changes (their ulp distances, the scatter that writes them, gaps and Rice
codes both ways, the near tier's estimate) were a dozen numpy calls each on arrays of a few
thousand entries: on that block, about 120 µs a tensor of Python and call overhead, more than
the passes over every value took. Each kernel reads what it needs where it lies (positions
into base and new, a value stream's byte planes or sign bits as they travel), instead of
gathered copies or arrays rebuilt first; the one exception is the ulp distances, which take
the changes' bits before and after: `tier_into` keeps a near change's bits while its block is
at hand, where reading them again in the tier's order (by exponent, scattered) took 2.7 ms of
an encode on that block at lr 3e-6, k = 2.

The kernels write into buffers the caller owns and return how many entries they wrote.
Compiled code is kept on disk beside this file (or in the user's cache directory): the first
process to patch bf16 and fp32 tensors compiles for about 9-11 s here (4 s before decoding took
one kernel an entry, which is compiled with every kernel it calls), later ones load it in 0.4 s.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

BLOCK = 64  # values per bit mask: one uint64


def _compiled(fn):
    try:
        return njit(cache=True, nogil=True, boundscheck=False)(fn)
    except RuntimeError:  # nowhere writable to keep compiled code: each process compiles it
        return njit(nogil=True, boundscheck=False)(fn)


@intrinsic
def _trailing_zeros(typingctx, word):
    """LLVM's count-trailing-zeros of a uint64 (one instruction; numba has no such function)."""

    def codegen(context, builder, signature, args):
        fnty = ir.FunctionType(ir.IntType(64), [ir.IntType(64), ir.IntType(1)])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.cttz.i64")
        return builder.call(fn, [args[0], ir.Constant(ir.IntType(1), 0)])

    return types.uint64(types.uint64), codegen


@njit(inline="always")
def _write_set_bits(mask, start, out, count):
    """Writes start + the index of each set bit of `mask` to `out` from `count`; the new count."""
    while mask:
        out[count] = start + np.int64(_trailing_zeros(mask))
        count += 1
        mask &= mask - np.uint64(1)
    return count


@njit(inline="always")
def _differ_mask(base, new, start, length):
    """Where `base` and `new` differ over `length` (<= BLOCK) values from `start`, as bits."""
    mask = np.uint64(0)
    for j in range(length):
        mask |= np.uint64(base[start + j] != new[start + j]) << np.uint64(j)
    return mask


@njit(inline="always")
def _under_mask(bits, magnitude_mask, limit, start, length):
    """Where `bits & magnitude_mask` is under `limit` over `length` (<= BLOCK) values, as bits."""
    mask = np.uint64(0)
    for j in range(length):
        mask |= np.uint64((bits[start + j] & magnitude_mask) < limit) << np.uint64(j)
    return mask


# A whole block's mask as one compare of two LLVM vectors, whose lanes' results become the
# mask's bits as they are (with AVX-512, one compare into a mask register per 32 bf16 lanes).
# LLVM made the loops above into per-lane shifts and ors, about 30 cycles a block: on SmolLM2's
# 6-layer block (lr 3e-6) the changed and near passes together took 6.6 ms, with these 5.3.


def _contiguous_bits(*arrays) -> bool:
    """Whether the intrinsics below may read `arrays` as whole vectors and compare them unsigned
    (other arrays get no implementation: a typing error, never a wrong mask)."""
    return all(
        isinstance(a, types.Array)
        and a.ndim == 1
        and a.layout == "C"
        and isinstance(a.dtype, types.Integer)
        and not a.dtype.signed
        for a in arrays
    )


def _block_vector(context, builder, array_type, array, start):
    """`array[start:start + BLOCK]` as one vector (an unaligned load)."""
    width = context.get_data_type(array_type.dtype).width
    vector = ir.VectorType(ir.IntType(width), BLOCK)
    data = context.make_array(array_type)(context, builder, array).data
    return builder.load(builder.bitcast(builder.gep(data, [start]), vector.as_pointer()), align=width // 8)


def _splat(context, builder, value, value_type, array_type):
    """`value`, as the array's dtype, in every lane of a block's vector."""
    element = context.cast(builder, value, value_type, array_type.dtype)
    vector = ir.VectorType(element.type, BLOCK)
    lanes = ir.Constant(ir.VectorType(ir.IntType(32), BLOCK), [0] * BLOCK)
    first = builder.insert_element(ir.Constant(vector, ir.Undefined), element, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(first, ir.Constant(vector, ir.Undefined), lanes)


@intrinsic
def _differ_block(typingctx, base, new, start):
    """`_differ_mask(base, new, start, BLOCK)` for contiguous arrays."""
    if not _contiguous_bits(base, new) or base.dtype != new.dtype:
        return None

    def codegen(context, builder, signature, args):
        base_type, new_type, _ = signature.args
        differ = builder.icmp_unsigned(
            "!=",
            _block_vector(context, builder, base_type, args[0], args[2]),
            _block_vector(context, builder, new_type, args[1], args[2]),
        )
        return builder.bitcast(differ, ir.IntType(BLOCK))

    return types.uint64(base, new, start), codegen


@intrinsic
def _under_block(typingctx, bits, magnitude_mask, limit, start):
    """`_under_mask(bits, magnitude_mask, limit, start, BLOCK)` for a contiguous array."""
    if not _contiguous_bits(bits):
        return None

    def codegen(context, builder, signature, args):
        bits_type, mask_type, limit_type, _ = signature.args
        magnitude = builder.and_(
            _block_vector(context, builder, bits_type, args[0], args[3]),
            _splat(context, builder, args[1], mask_type, bits_type),
        )
        limit = _splat(context, builder, args[2], limit_type, bits_type)
        return builder.bitcast(builder.icmp_unsigned("<", magnitude, limit), ir.IntType(BLOCK))

    return types.uint64(bits, magnitude_mask, limit, start), codegen


@_compiled
def changed_into(base, new, out) -> int:
    """Writes the sorted positions where `base` and `new` differ into `out` (room for all)."""
    n, count = base.size, 0
    full = n - n % BLOCK
    for start in range(0, full, BLOCK):
        count = _write_set_bits(_differ_block(base, new, start), start, out, count)
    return _write_set_bits(_differ_mask(base, new, full, n - full), full, out, count)


EXPONENT_SHIFT = 48  # the near passes keep a value's exponent field above its position
CHANGED_BIT = 47  # and, in `tier_into`, whether it changed just under it
POSITION_BITS = (1 << CHANGED_BIT) - 1  # positions < 2**47


@_compiled
def near_into(bits, magnitude_mask, limit, mantissa: int, bins: int, found, out) -> int:
    """Writes the positions of the values whose magnitude bits (`bits & magnitude_mask`) are
    under `limit` into `out`, ordered by exponent field, then position (a counting sort over
    the `bins` exponents); `found`: scratch with room for every position."""
    n, count = bits.size, 0
    starts = np.zeros((1, bins + 1), np.int64)  # signed throughout: numba mixes signs into float64
    full = n - n % BLOCK
    nothing, none = np.uint64(0), np.empty((2, 0), bits.dtype)  # no value changes: none is kept
    for start in range(0, full, BLOCK):
        mask = _under_block(bits, magnitude_mask, limit, start)
        count = _write_near(bits, bits, mask, nothing, start, mantissa, found, count, starts, none)
    mask = _under_mask(bits, magnitude_mask, limit, full, n - full)
    count = _write_near(bits, bits, mask, nothing, full, mantissa, found, count, starts, none)
    for e in range(bins):
        starts[0, e + 1] += starts[0, e]
    for i in range(count):  # the counting sort's placing
        exponent = found[i] >> EXPONENT_SHIFT
        out[starts[0, exponent]] = found[i] & POSITION_BITS
        starts[0, exponent] += 1
    return count


@_compiled
def flagged_into(positions, flags) -> int:
    """Keeps, in place and in order, the `positions` whose flag is set (`flags` packed least
    significant bit first); returns how many. About half the near values changed, so a branch
    on each flag was mispredicted as often as not: with `near_into`, 4.2-4.3 ms of a link on
    SmolLM2's 6-layer block at lr 3e-6, k = 2, and 3.6 ms without it."""
    kept = 0
    for i in range(positions.size):  # each written, the count moved by its flag: no branch to mispredict
        positions[kept] = positions[i]
        kept += (flags[i >> 3] >> (i & 7)) & 1
    return kept


@_compiled
def tier_into(
    base, new, magnitude_mask, limit, mantissa: int, bins: int, found, kept, flags, near, values, far
) -> tuple[int, int, int]:
    """A tiered tensor's changes in one pass over `base` and `new`: the changes outside the tier
    (sorted) into `far`; for each near value (`base & magnitude_mask` under `limit`, in the
    tier's order: by exponent field, then position) a flag, packed least significant bit first
    into `flags`, set where it changed; and the near values that changed, in the tier's order:
    their positions into `near`, their bits before and after into `values`' two rows. `found`
    and `kept` (two rows of `base`'s dtype): scratch with room for every position; `near` and
    `values` need one more. Returns how many values are near, how many of them changed, and how
    many changes are far.

    Apart (the changes, then the near values, then a split that read base and new again at each
    near value in the tier's order, scattered), the three passes read the base twice and took
    9.0-9.7 ms of an encode on SmolLM2's 6-layer block at lr 3e-6, k = 2; in one, 5.7 ms, and
    the near changes' bits are at hand for their distances (2.7 ms less for those)."""
    n, count, outside = base.size, 0, 0
    starts = np.zeros((2, bins + 1), np.int64)  # per exponent field: near values, and those that changed
    full = n - n % BLOCK
    for start in range(0, full, BLOCK):
        differ = _differ_block(base, new, start)
        under = _under_block(base, magnitude_mask, limit, start)
        outside = _write_set_bits(differ & ~under, start, far, outside)
        count = _write_near(base, new, under, differ, start, mantissa, found, count, starts, kept)
    differ = _differ_mask(base, new, full, n - full)
    under = _under_mask(base, magnitude_mask, limit, full, n - full)
    outside = _write_set_bits(differ & ~under, full, far, outside)
    count = _write_near(base, new, under, differ, full, mantissa, found, count, starts, kept)
    for e in range(bins):
        starts[0, e + 1] += starts[0, e]
        starts[1, e + 1] += starts[1, e]
    moved = starts[1, bins]
    flags[: (count + 7) // 8] = 0
    for i in range(count):  # the counting sort's placing, straight into flags and near changes
        exponent, changed = found[i] >> EXPONENT_SHIFT, (found[i] >> CHANGED_BIT) & 1
        at = starts[0, exponent]
        flags[at >> 3] |= np.uint8(changed << (at & 7))
        starts[0, exponent] = at + 1
        slot = starts[1, exponent] if changed else moved  # the one past the last: no branch to mispredict
        near[slot] = found[i] & POSITION_BITS
        values[0, slot], values[1, slot] = kept[0, i], kept[1, i]
        starts[1, exponent] += changed
    return count, moved, outside


@njit(inline="always")
def _write_near(bits, new, mask, changed, start, mantissa, found, count, starts, kept):
    """`_write_set_bits` that also counts each value's exponent field (read while the block is at
    hand) and keeps it in `found` above the position, with the value's bit of `changed` under
    it, for the counting sort (`starts[0, e + 1]`: how many have field e). Where `kept` has room,
    each value's bits before and after go there at the same index, and `starts[1, e + 1]` counts
    those that changed. Against reading the exponents again after the pass, on SmolLM2's block:
    4.3 -> 3.0 ms with 1% of the values near, 12.9 -> 9.7 ms with 7.5%."""
    while mask:
        bit = _trailing_zeros(mask)
        at = start + np.int64(bit)
        exponent = (np.int64(bits[at]) >> mantissa) & (starts.shape[1] - 2)  # bins - 1
        moved = np.int64((changed >> bit) & np.uint64(1))
        found[count] = at | (moved << CHANGED_BIT) | (exponent << EXPONENT_SHIFT)
        starts[0, exponent + 1] += 1
        if kept.shape[1]:  # every near value's, not a branch on whether it changed (mispredicted)
            kept[0, count], kept[1, count] = bits[at], new[at]
            starts[1, exponent + 1] += moved
        count += 1
        mask &= mask - np.uint64(1)
    return count


@njit(inline="always")
def _key(value, magnitude, top):
    """A bit pattern's order-preserving key (an involution): floats below zero flip their
    magnitude bits, so that key differences are ulp distances, across zero too."""
    return value ^ (magnitude if (value >> top) & np.uint64(1) else np.uint64(0))


@njit(inline="always")
def _layout(bits, is_float):
    """uint64 constants for `bits`'s width: its top bit's index, all its bits set, and the
    magnitude bits a key flips (none for integers). The kernels' arithmetic runs in uint64:
    numba turns a mix of signs into float64."""
    one = np.uint64(1)
    top = np.uint64(8 * bits.itemsize) - one
    all_ones = (one << top) - one + (one << top)  # 2**width - 1, without shifting 64 places
    return top, all_ones, (one << top) - one if is_float else np.uint64(0)


@_compiled
def distances_into(before, after, is_float: bool, z, at_least) -> tuple[int, int]:
    """Each change's ulp distance (the key of its bits `after` minus that of its bits `before`,
    mod 2**width) zigzagged into `z`: 0, -1, 1, -2 ... -> 0, 1, 2, 3 .... Returns the smallest
    and largest, and adds to `at_least[i]` how many are at least 2**(8 * 2**i) - 1 (escapes in
    a narrower width)."""
    top, all_ones, magnitude = _layout(before, is_float)
    lowest, highest = all_ones, np.uint64(0)
    for i in range(before.size):
        now, was = _key(np.uint64(after[i]), magnitude, top), _key(np.uint64(before[i]), magnitude, top)
        d = (now - was) & all_ones
        zig = ((d << np.uint64(1)) & all_ones) ^ (all_ones if d >> top else np.uint64(0))
        z[i] = zig
        lowest, highest = min(lowest, zig), max(highest, zig)
        _count_at_least(zig, at_least)
    return lowest, highest


@njit(inline="always")
def _count_at_least(value, at_least):
    for w in range(at_least.size):
        at_least[w] += value >= np.uint64((1 << (8 << w)) - 1)


@_compiled
def gaps_into(positions, gaps, at_least) -> None:
    """Sorted positions as gaps (the first from 0) into `gaps`, adding to `at_least[i]` how many
    are at least 2**(8 * 2**i) - 1 (escapes in a narrower width)."""
    previous = np.int64(0)
    for i in range(positions.size):
        gap = np.uint64(positions[i] - previous)
        gaps[i] = gap
        previous = positions[i]
        _count_at_least(gap, at_least)


@_compiled
def rice_into(gaps, k: int, out) -> int:
    """Rice codes of `gaps` into `out` (zeroed, room for both streams; see
    `fedrl.patch.rice_encode`): each quotient in unary, then every gap's k low bits. Returns
    the bytes written."""
    bit = np.int64(0)
    for i in range(gaps.size):
        bit += np.int64(gaps[i] >> np.uint64(k))
        out[bit >> 3] |= np.uint8(1 << (bit & 7))
        bit += 1
    at = (bit + 7) >> 3  # the low bits start on the next whole byte, k at a time through `held`
    held, filled, low = np.uint64(0), np.uint64(0), (np.uint64(1) << np.uint64(k)) - np.uint64(1)
    for i in range(gaps.size):  # k <= 40: at most 7 + 40 bits are ever held
        held |= (gaps[i] & low) << filled
        filled += np.uint64(k)
        while filled >= np.uint64(8):
            out[at] = np.uint8(held & np.uint64(255))
            held >>= np.uint64(8)
            filled -= np.uint64(8)
            at += 1
    if filled:
        out[at] = np.uint8(held)
        at += 1
    return at


# how a value stream travels (see `fedrl.patch.encode_values`)
VALUES_RAW, VALUES_SIGN, VALUES_DELTA = 0, 1, 2
# What a decoding kernel found wrong, one code each across them, so that `decode_changes_into`
# hands on what the kernels it calls return; `fedrl.patch` words each.
(
    OK,
    SCATTER_ESCAPES_DIFFER,
    SCATTER_IN_NEAR_TIER,
    GAPS_ESCAPES_DIFFER,
    GAPS_BEYOND,
    GAPS_OUT_OF_ORDER,
    GAPS_SECTION_SIZE,
    RICE_SHORT,
    RICE_LONG,
    RICE_COUNT,
    RICE_LOW_PAST,
    FLAGS_SIZE,
    FLAGS_PAST_NEAR,
    NEAR_OVER_COUNT,
    FAR_VALUES_SIZE,
    NEAR_VALUES_SIZE,
) = range(16)


@njit(inline="always")
def _from_planes(planes, itemsize, count, i):
    """Entry i of `count` unsigned values stored as `itemsize` byte planes (all low bytes first)."""
    value = np.uint64(0)
    for b in range(itemsize):
        value |= np.uint64(planes[b * count + i]) << np.uint64(8 * b)
    return value


@njit(inline="always")
def _escape(itemsize):
    """The largest value `itemsize` bytes hold: in a width narrower than the values', an escape."""
    return (np.uint64(1) << np.uint64(8 * itemsize)) - np.uint64(1) if itemsize < 8 else ~np.uint64(0)


@_compiled
def planes_into(values, itemsize: int, planes, escapes) -> None:
    """`values` in a narrower width as `itemsize` byte planes into `planes` (read back by
    `_from_planes`), the width's largest value standing for any value at least that large,
    which goes into `escapes` in order (the caller counted them: see `_count_at_least`)."""
    count = values.size
    escape = _escape(itemsize)
    escaped = 0
    for i in range(count):
        if values[i] >= escape:
            escapes[escaped] = values[i]
            escaped += 1
    for b in range(itemsize):  # a plane at a time: loops LLVM vectorises
        shift = np.uint64(8 * b)
        for i in range(count):
            planes[b * count + i] = np.uint8((min(np.uint64(values[i]), escape) >> shift) & np.uint64(255))


@_compiled
def scatter_into(
    bits, positions, data, kind: int, itemsize: int, escapes, is_float, magnitude_mask, limit, old, new
):
    """Writes one value stream, as it travels in `data`, at `positions` of `bits`, the values
    there before into `old` and after into `new`. VALUES_RAW: the new bits in `itemsize` byte
    planes; VALUES_SIGN: one bit a value (least significant first), set for +1 ulp, clear for -1;
    VALUES_DELTA: zigzagged ulp distances from the old values' keys (see `distances_into`) in
    `itemsize` byte planes, the width's largest value an escape taken from `escapes` in order.

    Returns OK or what is wrong, and how many values it wrote: the escapes do not match
    the escaped values (a stream that escapes nothing has none), or a value at a position lies
    under `limit` in magnitude (a far change in the near tier; limit 0: none). On a fault the
    caller puts back the `old` values it wrote (the undo it keeps anyway): one pass, where
    checking first took two (a 1M-change patch's scatters: 7.8-9.8 ms checking first, 6.7-7.0 in
    one pass)."""
    count = positions.size
    escape = _escape(itemsize)
    top, all_ones, magnitude = _layout(bits, is_float)
    one = np.uint64(1)
    escaped = 0
    for i in range(count):
        at = positions[i]
        before = np.uint64(bits[at])
        if (before & magnitude_mask) < limit:
            return SCATTER_IN_NEAR_TIER, i
        if kind == VALUES_SIGN:
            z = one + ((np.uint64(data[i >> 3]) >> np.uint64(i & 7)) & one)
        else:
            z = _from_planes(data, itemsize, count, i)
        if kind == VALUES_RAW:
            after = z
        else:
            if kind == VALUES_DELTA and z == escape:
                if escaped == escapes.size:
                    return SCATTER_ESCAPES_DIFFER, i
                z = np.uint64(escapes[escaped])
                escaped += 1
            distance = (z >> one) ^ (all_ones if z & one else np.uint64(0))
            after = _key((_key(before, magnitude, top) + distance) & all_ones, magnitude, top)
        old[i] = before
        new[i] = after
        bits[at] = after
    return (OK if escaped == escapes.size else SCATTER_ESCAPES_DIFFER), count


@_compiled
def positions_from_gaps(planes, itemsize: int, count: int, escapes, numel: int, out) -> int:
    """Flat positions into `out` from `count` gaps stored as `itemsize` byte planes (all low
    bytes, then the next...), the first from 0; in widths under 8 bytes the largest value is an
    escape, taken from `escapes` in order. Returns OK, or what is wrong (the first of these
    wins): the escapes do not match the escaped gaps, an escaped (or 8-byte) gap lies beyond
    `numel`, or the positions leave the tensor or do not increase."""
    escaping = itemsize < 8
    escape = _escape(itemsize)
    used, beyond, repeated, position = 0, False, False, np.int64(-1)
    for i in range(count):
        gap = _from_planes(planes, itemsize, count, i)
        if escaping and gap == escape:
            if used == escapes.size:
                return GAPS_ESCAPES_DIFFER
            gap = escapes[used]
            used += 1
            beyond |= gap > np.uint64(numel)
        elif not escaping:
            beyond |= gap > np.uint64(numel)
        repeated |= i > 0 and gap == np.uint64(0)
        position = np.int64(gap) if i == 0 else position + np.int64(gap)
        out[i] = position
    if used != escapes.size:
        return GAPS_ESCAPES_DIFFER
    return _order_fault(beyond, repeated, position, count, numel)


@njit(inline="always")
def _order_fault(beyond, repeated, last, count, numel):
    """What decoded gaps say of their positions, however they travelled: GAPS_BEYOND where a
    gap lay beyond the tensor, GAPS_OUT_OF_ORDER where the `last` position leaves it or a gap
    after the first is 0, else OK."""
    if beyond:
        return GAPS_BEYOND
    if count and (last >= numel or repeated):
        return GAPS_OUT_OF_ORDER
    return OK


@_compiled
def rice_gaps_into(data, unary_bytes: int, k: int, count: int, out) -> tuple[int, int]:
    """Rice-coded gaps (see `fedrl.patch.rice_encode`): the first `unary_bytes` of `data` hold
    each gap's quotient in unary (that many 0 bits, then a 1), the rest every gap's `k` low
    bits, least significant bit first. Returns how many 1 bits the unary stream holds and where
    the last one is (-1: none); `out` gets the `count` gaps only when those are `count`."""
    ones, previous = 0, -1
    for at in range(unary_bytes):
        byte = np.uint64(data[at])
        while byte:
            bit = 8 * at + np.int64(_trailing_zeros(byte))
            if ones < count:
                out[ones] = (bit - previous - 1) << k
            previous = bit
            ones += 1
            byte &= byte - np.uint64(1)
    if ones != count:
        return ones, previous
    end = data.size
    for j in range(count):
        first = j * k
        low = np.int64(0)
        for b in range(0, k + (first & 7), 8):  # the bytes holding bits first .. first + k - 1
            at = unary_bytes + (first >> 3) + (b >> 3)
            if at < end:
                low |= np.int64(data[at]) << b
        out[j] |= (low >> (first & 7)) & ((np.int64(1) << k) - 1)
    return ones, previous


@_compiled
def gap_positions_into(data, itemsize: int, k: int, escapes, count: int, numel: int, out) -> tuple[int, int]:
    """Flat positions into `out` from `count` gaps as they travel: as `itemsize` byte planes
    (`positions_from_gaps`), or with `itemsize` 0 Rice-coded with parameter `k` (see
    `fedrl.patch.rice_encode`). A stream's size is checked against `count` before a gap is read
    (no amplification). Returns OK or what is wrong, and with RICE_COUNT how many gaps the
    quotients hold."""
    if itemsize:
        if data.size != count * itemsize:
            return GAPS_SECTION_SIZE, 0
        return positions_from_gaps(data, itemsize, count, escapes, numel, out), 0
    low_bytes = (count * k + 7) // 8
    if data.size < low_bytes:
        return RICE_SHORT, 0
    unary_bytes = data.size - low_bytes
    if unary_bytes * 8 > (numel >> k) + count + 8:
        return RICE_LONG, 0
    ones, last = rice_gaps_into(data, unary_bytes, k, count, out)
    if ones != count or (count and unary_bytes != last // 8 + 1) or (not count and unary_bytes):
        return RICE_COUNT, ones
    if low_bytes and (count * k) % 8 and data[data.size - 1] >> ((count * k) % 8):
        return RICE_LOW_PAST, 0
    beyond, repeated, position = False, False, np.int64(0)
    for i in range(count):
        beyond |= out[i] > numel
        repeated |= i > 0 and out[i] == 0
        position += out[i]
        out[i] = position
    return _order_fault(beyond, repeated, position, count, numel), 0


@njit(inline="always")
def _stream_fits(kind, itemsize, size, count):
    """Whether a value stream of `size` bytes holds `count` values (see `scatter_into`)."""
    return size == ((count + 7) // 8 if kind == VALUES_SIGN else count * itemsize)


@_compiled
def decode_changes_into(
    bits,
    is_float,
    magnitude_mask,
    limit,
    mantissa: int,
    bins: int,
    found,
    near,
    flags,
    index,
    index_itemsize: int,
    rice_k: int,
    index_escapes,
    far_values,
    far_kind: int,
    far_itemsize: int,
    far_escapes,
    near_values,
    near_kind: int,
    near_itemsize: int,
    near_escapes,
    positions,
    old,
    new,
):
    """A sparse or tiered entry's changes written into `bits` in one call, where five kernels
    and the Python between them took 0.6 ms more of a 7.4 ms link (SmolLM2's 6-layer block at
    lr 3e-6: 43 tiered tensors).

    With `limit` > 0 (tiered) the near tier's positions (`near_into`, `found` and `near`
    scratch for every value) are kept where `flags` is set; the rest of the `positions.size`
    changes are far: their gaps (`index`, see `gap_positions_into`) go to the front of
    `positions`, their values (`far_values`, see `scatter_into`) may not lie in the tier, and
    the near changes follow them, with their own stream. Each change's value before goes into
    `old` and after into `new`, in the order of `positions`.

    Returns OK or what is wrong (checked in the order of the stream), how many values the tier
    holds and how many of them changed, how many changes it wrote (what the caller puts back
    from `old` on a fault), and what `gap_positions_into` says beside its fault."""
    count = positions.size
    held, moved = 0, 0
    if limit:
        held = near_into(bits, magnitude_mask, limit, mantissa, bins, found, near)
        if flags.size != (held + 7) // 8:
            return FLAGS_SIZE, held, 0, 0, 0
        if held % 8 and flags[flags.size - 1] >> (held % 8):
            return FLAGS_PAST_NEAR, held, 0, 0, 0
        moved = flagged_into(near[:held], flags)
        if moved > count:
            return NEAR_OVER_COUNT, held, moved, 0, 0
    far = count - moved
    fault, detail = gap_positions_into(
        index, index_itemsize, rice_k, index_escapes, far, bits.size, positions[:far]
    )
    if fault:
        return fault, held, moved, 0, detail
    if not _stream_fits(far_kind, far_itemsize, far_values.size, far):
        return FAR_VALUES_SIZE, held, moved, 0, 0
    fault, wrote = scatter_into(
        bits,
        positions[:far],
        far_values,
        far_kind,
        far_itemsize,
        far_escapes,
        is_float,
        np.uint64(magnitude_mask),  # far changes lie outside the tier
        np.uint64(limit),
        old[:far],
        new[:far],
    )
    if fault:
        return fault, held, moved, wrote, 0
    positions[far:] = near[:moved]
    if not _stream_fits(near_kind, near_itemsize, near_values.size, moved):
        return NEAR_VALUES_SIZE, held, moved, far, 0
    nowhere = np.uint64(0)  # near changes lie anywhere: no magnitude is under 0
    fault, wrote = scatter_into(
        bits,
        positions[far:],
        near_values,
        near_kind,
        near_itemsize,
        near_escapes,
        is_float,  # True wherever there is a tier (a literal would compile the scatter twice)
        nowhere,
        nowhere,
        old[far:],
        new[far:],
    )
    return fault, held, moved, far + wrote, 0


@_compiled
def near_tier(base, new, mantissa: int, bins: int, runs: int, run: int) -> int:
    """The exponent below which a tensor's changes cost the fewest bits as flags over the values
    there (the rest as gaps), or 0 when that saves under 5%: see `fedrl.patch.choose_near_tier`.
    Estimated from `runs` runs of `run` values spread evenly over `base` and `new` (the whole
    tensor where it is no larger): how many values have each exponent field, and how many of
    those changed, scaled up to the tensor."""
    n = base.size
    counts, changed = np.zeros((4, bins), np.int64), np.zeros(bins, np.int64)
    runs, length = (runs, run) if n > runs * run else (1, n)
    for r in range(runs):
        start = r * (n - length) // max(runs - 1, 1)
        for at in range(start, start + length):
            exponent = (np.int64(base[at]) >> mantissa) & (bins - 1)
            counts[at & 3, exponent] += 1  # four counters a bin: no increment waits on the one before
            if base[at] != new[at]:  # rarely: a branch foreseen (1.09 -> 0.85 ms over SmolLM2's block)
                changed[exponent] += 1
    values = counts.sum(axis=0)
    scale = n / (runs * length)
    changes = changed.sum() * scale
    best, best_bits, values_under, changes_under = 0, np.inf, 0.0, 0.0
    for below in range(1, bins):  # thresholds 1 .. bins-1: the values with exponent field < below
        if values[below - 1] == 0:
            continue  # the cost of the one before, no better; most bins are empty
        values_under += values[below - 1] * scale
        changes_under += changed[below - 1] * scale
        cost = _flag_bits(changes_under, values_under) + _gap_bits(changes - changes_under, n) + 256
        if cost < best_bits:
            best, best_bits = below, cost
    return best if best_bits < 0.95 * _gap_bits(changes, n) else 0


@njit(inline="always")
def _flag_bits(ones, total) -> float:
    """About what packed flags cost, `ones` of `total` set: their entropy, and what zstd's
    byte-wise Huffman code pays over it (measured: ~0.04 bit a flag, 14% at 5% set)."""
    q = min(max(ones / max(total, 1.0), 1e-12), 1 - 1e-12)
    return total * (0.04 - (q * np.log2(q) + (1 - q) * np.log2(1 - q)))


@njit(inline="always")
def _gap_bits(changes, numel) -> float:
    """About what gaps cost for `changes` positions spread over `numel` (zstd on the gap bytes)."""
    changes = max(changes, 0)
    return changes * (np.log2(numel / max(changes, 1)) + 1.5)
