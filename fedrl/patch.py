"""Lossless sparse weight patches (PULSE-style): changed positions plus exact new values.

A patch turns the tensors of `base_version` into those of `target_version` bit for bit.
Values never travel as floating-point deltas. A changed tensor is "sparse" (or "dense" when
that is smaller): its changed flat positions as gaps (in the narrowest unsigned width with
the large gaps escaped, or Rice-coded), and its new values in the smallest exact form: one direction bit
per change when every change is one ulp ("sign": the common case at RL learning rates), the
ulp distance zigzagged into the narrowest width with the rest escaped ("delta"), or the new
bits ("raw").
A float tensor can also be "tiered": whether a value moves depends on its size, since an
optimizer step of a fixed size crosses many ulps of a small weight and rarely one of a large
one (in SmolLM2's bf16 blocks at RL learning rates, weights under 2^-10 change 70-100% of the
time, the rest 0.1-3%). The receiver knows every base value, so the encoder names an exponent
`below` which values form the "near" tier: their changes travel as one flag bit per near value
(ordered by exponent, then position) with their values in a stream of their own, the other
changes as gaps. On SmolLM2's patches at least 99% sparse a
change then costs 3-10 bits instead of 12-16.
Ulp distances are taken between order-preserving integer keys of the floats, so a step
across zero is small too. Multi-byte arrays travel as byte planes, which zstd squeezes.

Wire format:  b"FRLP" | format u8 | body length u64 LE | zstd frame (with checksum) of
              header length u32 LE | header JSON | sections
The frame is compressed against a small built-in dictionary of the header's own words (a zstd
raw-content dictionary): a patch of a few hundred changes is mostly header, and its keys and
encodings then cost a reference instead of their letters (about 100 bytes of a 900-byte
upload). Small bodies take zstd's strongest level, which costs microseconds at their size.
The header names base and target versions and BLAKE3 state hashes, and per carried tensor
its encoding, count and section sizes (the sections follow one another in header order).
An anchor (full sync) is a patch whose base is empty: every tensor dense, with its name,
shape and dtype. A patch against a base lists only the tensors that changed, each by its
position among the base's sorted names: the base already knows names, shapes and dtypes, and
the target hash covers every tensor, the unchanged ones too. On small patches that halves
the header, which was about half the bytes. Small tensors (under JOINT_NUMEL values) go
further: where two or more of one dtype changed, they travel as one "joint" entry, read as one
flat tensor in name order (see `joint_members`), and the header names none of them. Such a
patch also names a BLAKE3 of what it writes (`changes_hash`: per entry the positions and new
bits, see `changes_hash`). `apply_patch` checks it, then by default rebuilds and hashes the
whole target ("state"); a receiver that vouches for its base (it verified it, and a link of a
chain starts from the state the last link made) can check the changes alone ("changes"): the
cost of a link is then that of its changes and the near tier's pass, not a hash of every byte.
New values travel relative to the base's, so a base that is wrong where the patch writes still
fails the check; a base wrong only where nothing changes does not, which is what vouching
means. It returns new tensors, or with `in_place` writes into the base's own; either way a
patch that does not verify leaves the base bit for bit as it was.
"""

from __future__ import annotations

import itertools
import json
import math
import struct
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import blake3
import numpy as np
import torch
import zstandard

from fedrl import patch_kernels
from fedrl.patch_errors import (
    BaseMismatch,
    CorruptPatch,
    PatchTooLarge,
    TargetMismatch,
    TensorMismatch,
    TruncatedPatch,
    UnknownFormat,
)

MAGIC = b"FRLP"
# 8: joint entries of small tensors (7: the changes hash; 6: near tiers by exponent, Rice-coded
# gaps; 5: tiered tensors; 4: the header dictionary; 3: only changed tensors, by position; 2: ulp
# keys, BLAKE3)
FORMAT_VERSION = 8
_PREFIX = struct.Struct("<4sBQ")  # magic, format version, compressed body length
EMPTY_HASH = blake3.blake3(b"fedrl-empty-state").hexdigest()

# Raw bit views of the float dtypes a patch can carry (and the integer dtypes, as themselves).
_BITS = {
    torch.bfloat16: (torch.int16, np.uint16),
    torch.float16: (torch.int16, np.uint16),
    torch.float32: (torch.int32, np.uint32),
    torch.float64: (torch.int64, np.uint64),
    torch.int8: (torch.int8, np.uint8),
    torch.uint8: (torch.uint8, np.uint8),
    torch.int16: (torch.int16, np.uint16),
    torch.int32: (torch.int32, np.uint32),
    torch.int64: (torch.int64, np.uint64),
}
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in _BITS}
_FLOAT_LAYOUT = {  # mantissa and exponent bits: where a value's size sits in its bit pattern
    torch.bfloat16: (7, 8),
    torch.float16: (10, 5),
    torch.float32: (23, 8),
    torch.float64: (52, 11),
}
_WIDTHS = (np.uint8, np.uint16, np.uint32, np.uint64)
# looked up once: np.iinfo and a dtype's name cost microseconds a call, and an encode asks
# hundreds of times
_LARGEST = {width: int(np.iinfo(width).max) for width in _WIDTHS}
_ITEMSIZE = {width: np.dtype(width).itemsize for width in _WIDTHS}
_NAME = {width: np.dtype(width).name for width in _WIDTHS}

# What headers say over and over, in the words and order encode_patch writes them. Part of the
# format: changing it changes FORMAT_VERSION.
_HEADER_WORDS = zstandard.ZstdCompressionDict(
    (
        "".join(  # first: words nearer the end cost shorter offsets, and small uploads are sparse
            f'{{"at":1,"mode":"tiered","count":1,"below":{below},"index_width":"{index}","values_as":"sign",'
            f'"value_width":"bit","near_as":"delta","near_width":"uint16","sizes":[1,0,1,0,1,0,1]}},'
            for index in ("uint16", "uint8")
            for below in (118, 119)
        )
        + "".join(  # a LoRA adapter's small patches: one joint entry
            f'{{"joint":"{dtype}","mode":"sparse","count":1,"index_width":"uint8","values_as":"delta",'
            f'"value_width":"{width}","sizes":[1,0,1,0]}}],'
            for dtype in ("float32", "bfloat16")
            for width in ("uint8", "uint16")
        )
        + f'{{"format":{FORMAT_VERSION},"base_version":null,"base_hash":"",'
        '"target_version":0,"target_hash":"","changes_hash":"","tensors":['
        '{"name":"","shape":[],"dtype":"bfloat16","mode":"dense","count":0,"sizes":[0]},'
        '{"at":0,"mode":"dense","count":0,"sizes":[0]},'
        + "".join(
            f'{{"at":1,"mode":"sparse","count":1,"index_width":"{index}","values_as":"{kind}",'
            f'"value_width":"{width}","sizes":[1,0,1,0]}},'
            for index in ("uint16", "uint8")
            for kind, width in (
                ("sign", "bit"),
                ("delta", "uint8"),
                ("delta", "uint16"),
                ("raw", "uint16"),
                ("raw", "uint32"),
            )
        )
    ).encode(),
    dict_type=zstandard.DICT_TYPE_RAWCONTENT,
)
SMALL_BODY = 1 << 16  # bodies up to this size compress at zstd's strongest level


def compress_body(body: bytes, level: int | None = None, declared: bool = True) -> bytes:
    """A patch body as its zstd frame (checksummed; `declared`: with its size, which readers require)."""
    level = level if level is not None else (19 if len(body) <= SMALL_BODY else 1)
    compressor = zstandard.ZstdCompressor(
        level=level, dict_data=_HEADER_WORDS, write_checksum=True, write_content_size=declared
    )
    return compressor.compress(body)


def decompress_body(frame: bytes, max_output_size: int) -> bytes:
    decompressor = zstandard.ZstdDecompressor(dict_data=_HEADER_WORDS)
    return decompressor.decompress(frame, max_output_size=max_output_size)


@dataclass(frozen=True)
class PatchLimits:
    """Bounds checked before any allocation: no zip bombs."""

    max_patch_bytes: int = 2**32
    max_body_bytes: int = 2**34


@dataclass(frozen=True)
class PatchHeader:
    base_version: int | None
    base_hash: str
    target_version: int
    target_hash: str
    tensors: list[dict]
    changes_hash: str | None = None  # None in an anchor: its target hash covers every byte it carries

    @property
    def is_anchor(self) -> bool:
        return self.base_version is None


# ---------------------------------------------------------------- bits and hashes


def to_bits(t: torch.Tensor) -> np.ndarray:
    """The raw bit pattern of a tensor as a flat unsigned numpy array (no copy when contiguous)."""
    if t.dtype not in _BITS:
        raise TypeError(f"patches carry {sorted(_DTYPE_NAMES)} tensors, not {t.dtype}")
    int_dtype, np_dtype = _BITS[t.dtype]
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.view(int_dtype).numpy().view(np_dtype).reshape(-1)  # numpy's reshape: a third of torch's cost


_NUMPY_OF = {
    torch.int8: np.int8,
    torch.uint8: np.uint8,
    torch.int16: np.int16,
    torch.int32: np.int32,
    torch.int64: np.int64,
}


def from_bits(bits: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    int_dtype = _BITS[dtype][0]
    return torch.from_numpy(np.ascontiguousarray(bits).view(_NUMPY_OF[int_dtype])).view(dtype).reshape(shape)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_digest(name: str, t: torch.Tensor) -> bytes:
    h = blake3.blake3(json.dumps([name, dtype_name(t.dtype), list(t.shape)]).encode())
    h.update(to_bits(t).view(np.uint8))
    return h.digest()


def combine_digests(digests: Mapping[str, bytes]) -> str:
    return blake3.blake3(b"".join(digests[name] for name in sorted(digests))).hexdigest()


def state_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """BLAKE3 over each tensor's BLAKE3 (of name, dtype, shape and raw bytes) in sorted name
    order: 3-4x SHA-256's speed on one core, and the codec hashes each tensor right after it
    touched it, while its bytes are still in cache."""
    if not tensors:
        return EMPTY_HASH
    return combine_digests({name: tensor_digest(name, t) for name, t in tensors.items()})


CHANGES_HASH_BYTES = 16  # a check on decoding, in a signed header: 128 bits (256 cost 20 bytes more a patch)


def changes_hash(written: Iterable[np.ndarray]) -> str:
    """BLAKE3 of what a patch writes, in header order: per entry its flat positions (int64; a
    joint entry's in its members read as one) and new bits (far changes, then the near tier's in
    its order; a dense tensor: its bits alone), each array (flat, contiguous) after its length in
    bytes."""
    h = _ChangesHash()
    for arr in written:
        h.add(arr)
    return h.hexdigest()


class _ChangesHash:
    """`changes_hash`, an array at a time. Small arrays are hashed joined (172 arrays the sizes
    of a SmolLM2 block's changes: 0.51 ms as two updates each, 0.16 joined); one over JOIN_BYTES
    goes at once, alone (joining a 1M-change patch's arrays cost about 6 ms more)."""

    JOIN_BYTES = 1 << 16

    def __init__(self):
        self.hash, self.pending = blake3.blake3(), []

    def add(self, arr: np.ndarray) -> None:
        self.pending.append(_LENGTH.pack(arr.nbytes))
        if arr.nbytes < self.JOIN_BYTES:
            self.pending.append(arr.view(np.uint8))
            return
        self.hash.update(b"".join(self.pending))
        self.hash.update(arr.view(np.uint8))
        self.pending = []

    def flush(self) -> None:
        """Hashes what is pending: the arrays added so far may change after."""
        self.hash.update(b"".join(self.pending))
        self.pending = []

    def hexdigest(self) -> str:
        self.flush()
        return self.hash.hexdigest(length=CHANGES_HASH_BYTES)


_LENGTH = struct.Struct("<Q")


# ---------------------------------------------------------------- whole-tensor passes


class _Scratch(threading.local):
    """Reused per-thread buffers for whole-tensor temporaries. A fresh multi-megabyte numpy
    array page-faults on every call: `bits & mask` on SmolLM2's blocks took 26 ms allocating
    its result and 4 ms into a buffer that exists (a memcpy of the same bytes: 4 ms)."""

    LARGEST = 1 << 26  # bytes kept per slot; a larger temporary is allocated and let go

    def __init__(self):
        self.buffers: dict[str, np.ndarray] = {}

    def get(self, slot: str, size: int, dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        need = size * dtype.itemsize
        buf = self.buffers.get(slot)
        if buf is None or buf.size < need:
            buf = np.empty(need, np.uint8)
            if need <= self.LARGEST:
                self.buffers[slot] = buf
        return buf[:need].view(dtype)


_SCRATCH = _Scratch()


def changed_positions(base_bits: np.ndarray, new_bits: np.ndarray) -> np.ndarray:
    """Sorted flat positions where two bit patterns differ (a per-thread buffer that the next
    tensor's encoding overwrites)."""
    out = _SCRATCH.get("positions", base_bits.size, np.int64)
    return out[: patch_kernels.changed_into(base_bits, new_bits, out)]


def _near_pass(bits: np.ndarray, dtype: torch.dtype, below: int) -> tuple:
    """What the near tier's passes (`patch_kernels.near_into`, `tier_into`) take after `bits`:
    the tier's magnitude mask and bound (see `_near_limits`), the mantissa's bits, the
    exponent's bins, and a per-thread buffer for their scratch, which the next call overwrites.

    The tier lists its values by exponent, then by position. How often a value moves, and by how
    many ulps, follows its exponent, so flags and values of one exponent sit together and zstd
    codes each run near its own rate: on SmolLM2's lr 3e-6 patches at least 99% sparse, in
    position order they were 4-48% larger (flags alone in position order: 1-28%)."""
    mantissa, exponent = _FLOAT_LAYOUT[dtype]
    magnitude_mask, limit = _near_limits(bits, dtype, below)
    return magnitude_mask, limit, mantissa, 1 << exponent, _SCRATCH.get("found", bits.size, np.int64)


def tier_changes(base_bits: np.ndarray, new_bits: np.ndarray, dtype: torch.dtype, below: int) -> tuple:
    """A tiered tensor's changes (`patch_kernels.tier_into`, one pass over base and new): the
    near tier's flags; the near values that changed, in the tier's order, and their bits before
    and after; and the far changes (the last four in per-thread buffers that the next tensor's
    encoding overwrites)."""
    size, word = base_bits.size, base_bits.dtype
    near, far = _SCRATCH.get("near", size + 1, np.int64), _SCRATCH.get("far", size, np.int64)
    values = _SCRATCH.get("values", 2 * (size + 1), word).reshape(2, size + 1)
    flags = _SCRATCH.get("flags", (size + 7) // 8, np.uint8)
    held, moved, outside = patch_kernels.tier_into(
        base_bits,
        new_bits,
        *_near_pass(base_bits, dtype, below),
        _SCRATCH.get("kept", 2 * size, word).reshape(2, size),
        flags,
        near,
        values,
        far,
    )
    return (
        flags[: (held + 7) // 8].tobytes(),
        near[:moved],
        values[0, :moved],
        values[1, :moved],
        far[:outside],
    )


# ---------------------------------------------------------------- index coding


def encode_indices(idx: np.ndarray) -> tuple[bytes, str, bytes]:
    """Sorted flat indices -> their gaps, in the width that minimises bytes (escapes as uint64)
    or Rice-coded ("riceK") when that is smaller still: zstd's byte-wise Huffman code pays up to
    a bit and a half a gap over the entropy of gaps spread as evenly as a sparse tier's far
    changes (geometric), where a Rice code pays a few hundredths; on clustered gaps zstd wins."""
    gaps, counted = np.empty(idx.size, np.uint64), np.zeros(len(_WIDTHS) - 1, np.int64)
    patch_kernels.gaps_into(idx, gaps, counted)
    escaped = [*counted.tolist(), 0]  # Python ints: numpy's scalars and argmin cost 10 µs a tensor
    sizes = [gaps.size * _ITEMSIZE[w] + 8 * e for w, e in zip(_WIDTHS, escaped)]
    at = sizes.index(min(sizes))  # the first of the smallest
    width, escapes = _WIDTHS[at], escaped[at]
    if width is np.uint64:
        return shuffle_bytes(gaps), "uint64", b""
    if gaps.size >= RICE_MIN_GAPS:
        k, rice_bits = _rice_parameter(gaps)
        if rice_bits < 0.97 * (_zstd_bits(gaps, width) + 64 * escapes):
            return rice_encode(gaps, k), f"rice{k}", b""
    planes, large = _narrowed(gaps, width, escapes)
    return planes, _NAME[width], large


def _narrowed(values: np.ndarray, width, escapes: int) -> tuple[bytes, bytes]:
    """`values` as byte planes of `width`, and the `escapes` of them at least its largest value
    (which stands for each) in their own width."""
    planes, large = np.empty(values.size * _ITEMSIZE[width], np.uint8), np.empty(escapes, values.dtype)
    patch_kernels.planes_into(values, _ITEMSIZE[width], planes, large)
    return planes.tobytes(), large.tobytes()


RICE_MIN_GAPS = 1024  # below, a sample compressed alone overcharges zstd (a frame shares its tables)
_RICE_FORMS = {f"rice{k}": k for k in range(41)}


def _zstd_bits(gaps: np.ndarray, width, sample: int = 8192) -> float:
    """About what zstd makes of the gaps' byte planes in `width`: a sample compressed, scaled up
    (their order-0 entropy flatters zstd by up to a bit and a half a gap)."""
    part = gaps[:sample]
    planes, _ = _narrowed(part, width, int(np.count_nonzero(part >= _LARGEST[width])))
    return 8 * len(zstandard.ZstdCompressor(level=1).compress(planes)) * gaps.size / part.size


def _rice_parameter(gaps: np.ndarray) -> tuple[int, int]:
    """The Rice parameter k that codes `gaps` in the fewest bits, and that many bits."""
    centre = min(int(np.log2(max(float(gaps.mean()), 1.0))), max(_RICE_FORMS.values()) - 1)
    candidates = range(max(0, centre - 2), centre + 2)
    costs = {k: int(np.sum(gaps >> np.uint64(k))) + gaps.size * (k + 1) for k in candidates}
    k = min(costs, key=costs.get)
    return k, costs[k]


def rice_encode(gaps: np.ndarray, k: int) -> bytes:
    """Each gap g as g >> k in unary (that many 0 bits, then a 1) in one bit stream, then every
    g's k low bits in another: both streams decode with whole-array operations."""
    unary_bits = int(np.sum(gaps >> np.uint64(k))) + gaps.size
    out = np.zeros((unary_bits + 7) // 8 + (gaps.size * k + 7) // 8, np.uint8)
    return out[: patch_kernels.rice_into(gaps, k, out)].tobytes()


def decode_indices(small, width: str, large, count: int, numel: int) -> np.ndarray:
    """Inverse of `encode_indices`: the `count` sorted flat positions in a tensor of `numel`
    values, refusing any stream that is not exactly that (see `patch_kernels.gap_positions_into`)."""
    out = np.empty(count, np.int64)
    fault, detail = patch_kernels.gap_positions_into(*_index_stream(width, small, large), count, numel, out)
    if fault:
        raise CorruptPatch(_gaps_refused(fault, detail, width, len(small), count))
    return out


def _index_stream(width: str, small, large) -> tuple[np.ndarray, int, int, np.ndarray]:
    """How `patch_kernels.gap_positions_into` reads an entry's gaps: their section, bytes a gap
    (0: Rice-coded), the Rice parameter and the escapes."""
    data = np.frombuffer(small, np.uint8)
    if width in _RICE_FORMS:
        if len(large):
            raise CorruptPatch("Rice-coded gaps have no escapes")
        return data, 0, _RICE_FORMS[width], _NO_ESCAPES
    itemsize = _ITEMSIZE_OF[width]
    return data, itemsize, 0, _array(large, np.uint64) if itemsize < 8 else _NO_ESCAPES


_NO_ESCAPES = np.frombuffer(b"", np.uint64)  # read-only, as sections are (see _NO_BYTES)
_GAP_FAULTS = {
    patch_kernels.GAPS_ESCAPES_DIFFER: "escape list does not match the escaped gaps",
    patch_kernels.GAPS_BEYOND: "index gap beyond the tensor",
    patch_kernels.GAPS_OUT_OF_ORDER: "indices out of range or not strictly increasing",
    patch_kernels.RICE_LONG: "Rice quotients longer than the tensor allows",
    patch_kernels.RICE_LOW_PAST: "Rice low bits set past the last gap",
}


def _gaps_refused(fault: int, detail: int, width: str, size: int, count: int) -> str:
    """What is wrong with `count` gaps in `width` (a section of `size` bytes), in words."""
    if fault == patch_kernels.GAPS_SECTION_SIZE:
        return f"index section holds {size / _ITEMSIZE_OF[width]:g} {width}, header says {count}"
    if fault == patch_kernels.RICE_SHORT:
        low_bytes = (count * _RICE_FORMS[width] + 7) // 8
        return f"Rice section of {size} bytes is shorter than its {low_bytes} bytes of low bits"
    if fault == patch_kernels.RICE_COUNT:
        return f"Rice quotients hold {detail} gaps or stray bits, header says {count}"
    return _GAP_FAULTS[fault]


# ---------------------------------------------------------------- value coding


def shuffle_bytes(arr: np.ndarray) -> bytes:
    """Byte planes one after another (all low bytes, then the next...): the high planes of
    small integers are nearly constant, which zstd squeezes far better than interleaved."""
    if arr.dtype.itemsize == 1:
        return arr.tobytes()
    return np.ascontiguousarray(arr.view(np.uint8).reshape(-1, arr.dtype.itemsize).T).tobytes()


def _array(data, dtype) -> np.ndarray:
    if len(data) % np.dtype(dtype).itemsize:
        raise CorruptPatch(f"a section of {len(data)} bytes is not a whole number of {np.dtype(dtype).name}")
    return np.frombuffer(data, dtype=dtype)


def encode_values(before: np.ndarray, after: np.ndarray, is_float: bool) -> tuple[str, str, bytes, bytes]:
    """The smallest exact form of changed values, given their bits `before` and `after`: one
    direction bit each when every change is one ulp ("sign", the common case at RL learning
    rates), the zigzagged ulp distance in the narrowest width with the rest escaped ("delta"),
    or the new bits themselves ("raw")."""
    # wraps mod 2**bits, and so does decoding: exact for any pair of bit patterns
    full = after.dtype
    narrower = _WIDTHS[: _WIDTHS.index(full.type)]
    z, escapes = np.empty(after.size, full), np.zeros(len(narrower), np.int64)
    lowest, highest = patch_kernels.distances_into(before, after, is_float, z, escapes)
    if z.size == 0 or (lowest >= 1 and highest <= 2):
        return "sign", "bit", np.packbits(z == 2, bitorder="little").tobytes(), b""
    best = (None, z.size * full.itemsize)  # None: the new bits themselves
    for width, escaped in zip(narrower, escapes):
        size = z.size * _ITEMSIZE[width] + int(escaped) * full.itemsize
        if size < best[1]:
            best = (width, size)
    width = best[0]
    if width is None:
        return "raw", _NAME[full.type], shuffle_bytes(after), b""
    planes, large = _narrowed(z, width, int(escapes[narrower.index(width)]))
    return "delta", _NAME[width], planes, large


_VALUE_KINDS = {
    "raw": patch_kernels.VALUES_RAW,
    "sign": patch_kernels.VALUES_SIGN,
    "delta": patch_kernels.VALUES_DELTA,
}
_ITEMSIZE_OF = {_NAME[width]: _ITEMSIZE[width] for width in _WIDTHS}


def _value_stream(name: str, kind: str, width: str, data, escapes, full: np.dtype) -> tuple:
    """How `patch_kernels.scatter_into` reads a stream of values for a tensor of the unsigned
    dtype `full`, as it travels (see `encode_values`; the header's check knows the pair of kind
    and width): its bytes, its kind's code, bytes per value and escapes, once its width is
    known to fit the tensor (its size is checked against its count as it is read)."""
    itemsize = 0 if kind == "sign" else _ITEMSIZE_OF[width]
    if kind == "raw" and itemsize != full.itemsize:
        raise CorruptPatch(f"{name}: raw values are {width}, the tensor's bits are {full.name}")
    if kind == "delta" and itemsize >= full.itemsize:
        raise CorruptPatch(f"{name}: delta values are {width}, not a width narrower than {full.name}")
    return np.frombuffer(data, np.uint8), _VALUE_KINDS[kind], itemsize, _array(escapes, full)


def _stream_refused(kind: str, width: str, size: int, count: int) -> str:
    """A stream of `size` bytes that does not hold `count` values, in words."""
    if kind == "sign":
        return f"sign bits for {count} values need {(count + 7) // 8} bytes, got {size}"
    return f"value section holds {size / _ITEMSIZE_OF[width]:g} {width}, header says {count}"


# ---------------------------------------------------------------- the near tier


def _near_limits(bits: np.ndarray, dtype: torch.dtype, below: int) -> tuple:
    """The mask of a value's magnitude bits, in `bits`'s word, and the bound under which a value
    is in the near tier: its exponent field is under `below` (|value| < 2^(below - bias)), and
    its bits without the sign are ordered like its size."""
    mantissa, exponent = _FLOAT_LAYOUT[dtype]
    word = bits.dtype.type
    return word((1 << (mantissa + exponent)) - 1), word(below << mantissa)


NEAR_MIN_NUMEL = 1024  # smaller tensors get no near tier
SAMPLE_RUN = 1024  # the tier's estimate reads runs of this many values: 8-16 a tensor (`_sample_runs`)


def _sample_runs(numel: int) -> int:
    """Runs for the tier's estimate: one per 32,768 values, at least 8 and at most 16. Sixteen on
    every tensor of SmolLM2's block read 15% of its 110,592-value projections (as long as their
    one pass); this rule made its lr 3e-6 patches 0.17% larger in all (at most 1.1%), and eight
    runs on every tensor up to 12% larger."""
    return min(16, max(8, numel // 32768))


def choose_near_tier(base_bits: np.ndarray, new_bits: np.ndarray, dtype: torch.dtype) -> int:
    """The exponent `below` which a tensor's changes travel as flags (0: no near tier).

    Estimated before the changes are found, so that one pass finds them and the tier's values
    (`tier_changes`): from runs of SAMPLE_RUN values spread over the tensor, how many values
    sit under each exponent and how many of them changed (`patch_kernels.near_tier`).
    Against a choice from every change, SmolLM2's patches took 0.77% more bytes in all at lr
    3e-6 (at most 3.6%), and 0.87% at lr 1e-6, up to 29% on the sparsest (99.88%: a small
    tensor's runs then hold a dozen changes, too few to price the tier's edge; what was tried is
    in docs/patches-and-bytes.md). A wrong guess costs bytes, never exactness."""
    if dtype not in _FLOAT_LAYOUT or base_bits.size < NEAR_MIN_NUMEL:
        return 0
    mantissa, exponent = _FLOAT_LAYOUT[dtype]
    runs = _sample_runs(base_bits.size)
    return patch_kernels.near_tier(base_bits, new_bits, mantissa, 1 << exponent, runs, SAMPLE_RUN)


# ---------------------------------------------------------------- encode


def encode_patch(
    base: Mapping[str, torch.Tensor] | None,
    new: Mapping[str, torch.Tensor],
    base_version: int | None,
    target_version: int,
    level: int | None = None,
    base_hash: str | None = None,
    target_hash: str | None = None,
) -> bytes:
    """Patch from `base` (None: an anchor) to `new`. Pass known hashes to skip re-hashing; `level`:
    zstd's (None: by the body's size)."""
    base = base or {}
    if base and set(base) != set(new):
        raise TensorMismatch(f"base and new name different tensors: {sorted(set(base) ^ set(new))[:3]}")
    names = sorted(new)
    hash_it = target_hash is None
    digests: dict[str, bytes] = {}  # each taken right after the tensor was encoded, while in cache
    entries, sections, written = [], [], _ChangesHash()

    def carry(entry: dict, parts: list[bytes], writes: list[np.ndarray]) -> None:
        entries.append({**entry, "sizes": [len(data) for data in parts]})
        sections.extend(parts)
        for arr in writes:
            written.add(arr)
        written.flush()  # `writes` may be scratch that the next tensor's encoding overwrites

    joined: set[str] = set()
    for dtype, members in joint_members(base).items() if base else ():
        joint = _encode_joint(base, new, members)
        if joint is not None:
            carry({"joint": dtype_name(dtype), **joint[0]}, *joint[1:])
            joined.update(members)
            digests.update({n: tensor_digest(n, new[n]) for n in members if hash_it})
    for at, name in enumerate(names):
        if name in joined:
            continue
        t = new[name]
        entry, parts, writes = _encode_tensor(name, base.get(name), t)
        if hash_it:
            digests[name] = tensor_digest(name, t)
        if entry is None:
            continue  # unchanged: the base's own tensor
        identity = (
            {"at": at} if base else {"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
        )
        carry({**identity, **entry}, parts, writes)
    target_hash = target_hash or combine_digests(digests)
    header = {
        "format": FORMAT_VERSION,
        "base_version": base_version if base else None,
        "base_hash": (base_hash or state_hash(base)) if base else EMPTY_HASH,
        "target_version": target_version,
        "target_hash": target_hash,
        **({"changes_hash": written.hexdigest()} if base else {}),
        "tensors": entries,
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([struct.pack("<I", len(header_bytes)), header_bytes, *sections])
    frame = compress_body(body, level)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(frame)) + frame


JOINT_NUMEL = 1 << 14  # tensors under this size share one entry per dtype (format 8): a LoRA
# factor of rank 8 on SmolLM2 has 4,608 or 12,288 values; larger tensors keep their own near tier


def joint_members(base: Mapping[str, torch.Tensor]) -> dict[torch.dtype, list[str]]:
    """Per dtype, the small tensors a joint entry covers: every one of that dtype under
    JOINT_NUMEL values, in name order, read as one flat tensor. Both sides know them from the
    base, so a joint entry names none of them: on the tiny adapter's top-5% version patches the
    compressed header went from about 296 to 165 bytes of 1,430 (the three hashes stay)."""
    members: dict[torch.dtype, list[str]] = {}
    for name in sorted(base):
        t = base[name]
        if t.numel() < JOINT_NUMEL:
            members.setdefault(t.dtype, []).append(name)
    return members


def _encode_joint(
    base: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], members: list[str]
) -> tuple[dict, list[bytes], list[np.ndarray]] | None:
    """The members' changes as one entry, or None where fewer than two of them changed or their
    changes cost as much as the changed tensors dense (then each goes alone, as before)."""
    for name in members:
        _check_alike(name, base[name], new[name])
    base_bits = np.concatenate([to_bits(base[n]) for n in members])
    new_bits = np.concatenate([to_bits(new[n]) for n in members])
    encoded = _encode_changes(base_bits, new_bits, base[members[0]].dtype)
    if encoded is None:
        return None
    entry, parts, writes = encoded
    ends = np.cumsum([base[n].numel() for n in members])
    touched = np.unique(np.searchsorted(ends, np.concatenate(writes[0::2]), side="right"))
    if touched.size < 2:
        return None
    dense = sum(to_bits(base[members[i]]).nbytes for i in touched)
    return (entry, parts, writes) if sum(len(data) for data in parts) < dense else None


def _check_alike(name: str, b: torch.Tensor, t: torch.Tensor) -> None:
    if b.dtype != t.dtype or b.shape != t.shape:
        raise TensorMismatch(f"{name}: base {b.dtype}{tuple(b.shape)} vs new {t.dtype}{tuple(t.shape)}")


def _encode_tensor(
    name: str, b: torch.Tensor | None, t: torch.Tensor
) -> tuple[dict | None, list[bytes], list[np.ndarray]]:
    """One tensor's encoding (None: unchanged), its sections in order and what it writes (for the
    changes hash)."""
    new_bits = to_bits(t)
    if b is not None:
        _check_alike(name, b, t)
        encoded = _encode_changes(to_bits(b), new_bits, t.dtype)
        if encoded is None:
            return None, [], []
        entry, parts, written = encoded
        if sum(len(data) for data in parts) < new_bits.nbytes:
            return entry, parts, written
    return {"mode": "dense", "count": int(new_bits.size)}, [new_bits.tobytes()], [new_bits]


def _encode_changes(
    base_bits: np.ndarray, new_bits: np.ndarray, dtype: torch.dtype
) -> tuple[dict, list[bytes], list[np.ndarray]] | None:
    """A tensor's changes as "sparse" (gaps and values) or "tiered" (near flags, then the same),
    and what it writes: positions and new bits, far then near; None where nothing changed."""
    below = choose_near_tier(base_bits, new_bits, dtype)
    if below:
        flags, near, near_before, near_after, idx = tier_changes(base_bits, new_bits, dtype, below)
        count = idx.size + near.size
    else:
        idx = changed_positions(base_bits, new_bits)
        count = idx.size
    if count == 0:
        return None
    entry: dict = {"mode": "tiered" if below else "sparse", "count": count}
    if below:
        entry["below"] = below
    index, index_width, index_escapes = encode_indices(idx)  # idx: the far changes, where tiered
    far_after = new_bits[idx]
    kind, width, values, escapes = encode_values(base_bits[idx], far_after, dtype.is_floating_point)
    entry.update(index_width=index_width, values_as=kind, value_width=width)
    sparse = [index, index_escapes, values, escapes]  # the order of _SECTIONS
    written = [idx, far_after]
    if not below:
        return entry, sparse, written
    near_as, near_width, near_values, near_escapes = encode_values(near_before, near_after, True)
    entry.update(near_as=near_as, near_width=near_width)
    written += [near, near_after]
    return entry, [flags, *sparse, near_values, near_escapes], written


# ---------------------------------------------------------------- decode


def _open(patch: bytes, limits: PatchLimits) -> tuple[PatchHeader, memoryview]:
    if len(patch) > limits.max_patch_bytes:
        raise PatchTooLarge(f"patch of {len(patch)} bytes exceeds the limit of {limits.max_patch_bytes}")
    if len(patch) < _PREFIX.size:
        raise TruncatedPatch(f"{len(patch)} bytes is shorter than the patch prefix")
    magic, fmt, length = _PREFIX.unpack_from(patch)
    if magic != MAGIC:
        raise UnknownFormat(f"not a fedrl patch (magic {magic!r})")
    if fmt != FORMAT_VERSION:
        raise UnknownFormat(f"patch format {fmt} is not supported (this fedrl reads format {FORMAT_VERSION})")
    frame = patch[_PREFIX.size :]
    if len(frame) < length:
        raise TruncatedPatch(f"patch body has {len(frame)} of {length} bytes")
    if len(frame) > length:
        raise CorruptPatch(f"{len(frame) - length} unexpected bytes after the patch body")
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError:
        declared = -1
    if declared < 0:
        raise CorruptPatch("patch body does not declare its size")
    if declared > limits.max_body_bytes:
        raise PatchTooLarge(
            f"patch body would decompress to {declared} bytes (limit {limits.max_body_bytes})"
        )
    try:
        body = decompress_body(frame, max_output_size=declared)
    except zstandard.ZstdError as err:
        raise CorruptPatch(f"patch body does not decompress: {err}") from None
    if len(body) != declared or len(body) < 4:
        raise CorruptPatch("patch body has the wrong size")
    (hlen,) = struct.unpack_from("<I", body)
    if 4 + hlen > len(body):
        raise CorruptPatch("patch header runs past the body")
    try:
        raw = json.loads(body[4 : 4 + hlen])
    except (ValueError, UnicodeDecodeError) as err:
        raise CorruptPatch(f"unreadable patch header: {err}") from None
    return _check_header(raw), memoryview(body)[4 + hlen :]


_SPARSE_SECTIONS = ("index", "index_escapes", "values", "value_escapes")
_SECTIONS = {
    "dense": ("values",),
    "sparse": _SPARSE_SECTIONS,
    "tiered": ("near_flags", *_SPARSE_SECTIONS, "near_values", "near_escapes"),  # sparse, plus the near tier
}
_WIDTH_NAMES = set(_NAME.values())
_VALUE_FORMS = {("sign", "bit")} | {(kind, width) for kind in ("delta", "raw") for width in _WIDTH_NAMES}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_hash(x, size: int = 32) -> bool:
    return isinstance(x, str) and len(x) == 2 * size and all(c in "0123456789abcdef" for c in x)


def _names_itself(e: dict) -> bool:
    """An anchor's entry: the tensor's name, dtype and shape (no base to take them from)."""
    return (
        "joint" not in e
        and isinstance(e.get("name"), str)
        and isinstance(e.get("dtype"), str)  # a list or dict is no key of a table: check the kind first
        and e["dtype"] in _DTYPE_NAMES
        and isinstance(e.get("shape"), list)
        and all(_is_int(s) and 0 <= s < 2**40 for s in e["shape"])
    )


def _names_position(e: dict) -> bool:
    """A patch's entry: one tensor by its position among the base's sorted names, or the joint
    entry of a dtype's small tensors (see `joint_members`), never both."""
    if "joint" in e:
        return "at" not in e and isinstance(e["joint"], str) and e["joint"] in _DTYPE_NAMES
    return _is_int(e.get("at")) and e["at"] >= 0


def _check_header(raw) -> PatchHeader:
    """Every field has the type and range it must have, before anything is allocated."""
    ok = (
        isinstance(raw, dict)
        and raw.get("format") == FORMAT_VERSION
        and "base_version" in raw
        and (raw["base_version"] is None or _is_int(raw["base_version"]))
        and _is_int(raw.get("target_version"))
        and _is_hash(raw.get("base_hash"))
        and _is_hash(raw.get("target_hash"))
        and isinstance(raw.get("tensors"), list)
        and (
            _is_hash(raw.get("changes_hash"), CHANGES_HASH_BYTES)
            if raw["base_version"] is not None
            else "changes_hash" not in raw
        )
    )
    if not ok:
        raise CorruptPatch("patch header fields are missing or of the wrong type")
    anchor = raw["base_version"] is None
    for e in raw["tensors"]:
        fine = (
            isinstance(e, dict)
            and isinstance(e.get("mode"), str)
            and e["mode"] in _SECTIONS
            and _is_int(e.get("count"))
            and isinstance(e.get("sizes"), list)
            and len(e["sizes"]) == len(_SECTIONS[e["mode"]])
            and all(_is_int(x) and x >= 0 for x in e["sizes"])
            and (_names_itself(e) if anchor else _names_position(e))
            and (
                e["mode"] == "dense"
                or (
                    (str(e.get("values_as")), str(e.get("value_width"))) in _VALUE_FORMS
                    and (
                        str(e.get("index_width")) in _WIDTH_NAMES or str(e.get("index_width")) in _RICE_FORMS
                    )
                )
            )
            and (
                e["mode"] != "tiered"
                or (
                    (str(e.get("near_as")), str(e.get("near_width"))) in _VALUE_FORMS
                    # below float64's widest exponent field; the dtype's own is checked with its sections
                    and _is_int(e.get("below"))
                    and 0 < e["below"] < 2**11
                )
            )
        )
        if not fine:
            raise CorruptPatch(f"malformed tensor entry {str(e)[:80]}")
    if anchor:
        names = [e["name"] for e in raw["tensors"]]
        if len(set(names)) != len(names):
            raise CorruptPatch("a tensor appears twice in the patch")
    else:
        joint = [e["joint"] for e in raw["tensors"] if "joint" in e]
        alone = [e["at"] for e in raw["tensors"][len(joint) :] if "at" in e]
        if len(joint) + len(alone) != len(raw["tensors"]) or len(set(joint)) != len(joint):
            raise CorruptPatch("joint entries come first, one per dtype, then tensors by position")
        if any(a >= b for a, b in itertools.pairwise(alone)):
            raise CorruptPatch("changed tensors are not listed once each, in order")
        if any(e["mode"] == "dense" for e in raw["tensors"][: len(joint)]):
            raise CorruptPatch("a joint entry carries changes, never dense values")
    return PatchHeader(
        raw["base_version"],
        raw["base_hash"],
        raw["target_version"],
        raw["target_hash"],
        raw["tensors"],
        raw.get("changes_hash"),
    )


def read_header(patch: bytes, limits: PatchLimits = PatchLimits()) -> PatchHeader:
    return _open(patch, limits)[0]


class _Sections:
    """Hands out the body's sections in order, each as long as the header says."""

    def __init__(self, body: memoryview):
        self.body, self.pos = body, 0

    def take(self, size: int, name: str) -> memoryview:
        if self.pos + size > len(self.body):
            raise CorruptPatch(f"{name}: a section of {size} bytes runs past the body")
        self.pos += size
        return self.body[self.pos - size : self.pos]


VERIFY = ("state", "changes")


def apply_patch(
    base: Mapping[str, torch.Tensor] | None,
    patch: bytes,
    base_hash: str | None = None,
    limits: PatchLimits = PatchLimits(),
    in_place: bool = False,
    verify: str = "state",
) -> dict[str, torch.Tensor]:
    """Verify `patch` against `base` and return the target tensors: new objects, base untouched;
    with `in_place`, the base's own tensors where they can take the changes (what a chain of
    patches does to a state it owns: no copy of the whole state per link).

    The changes hash is always checked. `verify="state"` also hashes the whole result against
    the target hash; "changes" names the result by the target hash unhashed, for a caller whose
    `base` is the state `base_hash` names (an anchor is always hashed whole: it has no base).

    Raises a PatchError subclass naming the reason for anything that does not verify; the base
    is then as it was, bit for bit, in place or not.
    """
    if verify not in VERIFY:
        raise ValueError(f"verify is one of {VERIFY}, not {verify!r}")
    header, sections = _open(patch, limits)
    base = {} if header.is_anchor else (base or {})
    if not header.is_anchor:
        held = base_hash or state_hash(base)
        if held != header.base_hash:
            raise BaseMismatch(
                f"patch is for base {header.base_hash[:12]} (v{header.base_version}), held {held[:12]}"
            )
    whole = verify == "state" or header.is_anchor
    specs = _tensor_specs(header, base)
    cursor = _Sections(sections)
    parts = [
        _checked_sections(spec, e, cursor, header.is_anchor) for (spec, _), e in zip(specs, header.tensors)
    ]
    if cursor.pos != len(sections):
        raise CorruptPatch(f"{len(sections) - cursor.pos} bytes of the body belong to no tensor")
    undo: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (bits, positions, old values)
    written = None if header.is_anchor else _ChangesHash()  # an anchor is hashed whole instead
    digests: dict[str, bytes] = {}
    try:
        decoded = {}
        for (spec, members), e, p in zip(specs, header.tensors, parts):
            if "joint" in e:
                made = _decode_joint(spec, members, e, base, p, in_place, undo, written)
            else:
                made = {spec[0]: _decode_tensor(spec, e, base.get(spec[0]), p, in_place, undo, written)}
            decoded.update(made)
            if whole:
                digests.update({name: tensor_digest(name, t) for name, t in made.items()})  # while in cache
        if not header.is_anchor and written.hexdigest() != header.changes_hash:
            raise TargetMismatch(
                f"decoded changes do not hash to v{header.target_version}'s {header.changes_hash[:12]}"
            )
        for name in base.keys() - decoded.keys():  # unchanged: the base's own, or a copy of it
            t = base[name] if in_place else base[name].detach().clone(memory_format=torch.contiguous_format)
            decoded[name] = t
            if whole:
                digests[name] = tensor_digest(name, t)
        if whole and combine_digests(digests) != header.target_hash:
            raise TargetMismatch(
                f"reconstructed state does not hash to v{header.target_version}'s {header.target_hash[:12]}"
            )
    except BaseException:
        for bits, positions, old in reversed(undo):
            bits[positions] = old
        raise
    return dict(sorted(decoded.items()))


_Spec = tuple[str, torch.dtype, tuple[int, ...]]  # a carried tensor's name, dtype and shape


def _tensor_specs(header: PatchHeader, base: Mapping[str, torch.Tensor]) -> list[tuple[_Spec, list[str]]]:
    """Who each entry is, and the tensors it writes: an anchor says so itself; a patch names
    positions among the base's sorted names, or a dtype whose small tensors it reads as one."""
    if header.is_anchor:
        return [
            ((e["name"], _DTYPE_NAMES[e["dtype"]], tuple(e["shape"])), [e["name"]]) for e in header.tensors
        ]
    order = sorted(base)
    joint = joint_members(base) if any("joint" in e for e in header.tensors) else {}
    specs, joined = [], set()
    for e in header.tensors:
        if "joint" in e:
            dtype = _DTYPE_NAMES[e["joint"]]
            members = joint.get(dtype)
            if not members:
                raise TensorMismatch(f"patch joins {e['joint']} tensors, the base has none to join")
            joined.update(members)
            numel = sum(base[n].numel() for n in members)
            specs.append(((f"joint {e['joint']}", dtype, (numel,)), members))
            continue
        if e["at"] >= len(order):
            raise TensorMismatch(f"patch changes tensor #{e['at']}, the base holds {len(order)}")
        name = order[e["at"]]
        if name in joined:
            raise CorruptPatch(f"{name} is listed alone and in its dtype's joint entry")
        specs.append(((name, base[name].dtype, tuple(base[name].shape)), [name]))
    return specs


def _checked_sections(spec: _Spec, e: dict, sections: _Sections, anchor: bool) -> dict[str, memoryview]:
    """The entry's sections, once its count is known to fit its tensor."""
    name, dtype, shape = spec
    mode, count = e["mode"], e["count"]
    numel = math.prod(shape)  # exact: an int64 product can wrap to a size that seems to fit
    if not 0 <= count <= numel:
        raise CorruptPatch(f"{name}: count {count} outside [0, {numel}]")
    if anchor and mode != "dense":
        raise CorruptPatch(f"{name}: an anchor must carry every tensor dense")
    if mode == "dense" and count != numel:
        raise CorruptPatch(f"{name}: a dense tensor carries all {numel} values, header says {count}")
    if mode != "dense" and count == 0:
        raise CorruptPatch(f"{name}: a {mode} tensor with no changes")
    if mode == "tiered" and not (dtype in _FLOAT_LAYOUT and e["below"] < 1 << _FLOAT_LAYOUT[dtype][1]):
        raise CorruptPatch(f"{name}: a {dtype_name(dtype)} tensor has no exponent {e['below']} to tier below")
    return {key: sections.take(size, name) for key, size in zip(_SECTIONS[mode], e["sizes"])}


def _decode_tensor(
    spec: _Spec,
    e: dict,
    b: torch.Tensor | None,
    parts: dict[str, memoryview],
    in_place: bool,
    undo: list,
    written: _ChangesHash | None,
) -> torch.Tensor:
    """One tensor rebuilt from its sections, what it writes added to the `written` hash. In
    place, the changes go into `b` itself (when contiguous) and each scatter's old values onto
    `undo`, so that a later failure can put them back."""
    name, dtype, shape = spec
    mode, count = e["mode"], e["count"]
    np_dtype = _BITS[dtype][1]
    if mode == "dense":
        if len(parts["values"]) != count * np.dtype(np_dtype).itemsize:
            raise CorruptPatch(f"{name}: dense section has the wrong size")
        values = _array(parts["values"], np_dtype)
        if written is not None:
            written.add(values)
        t = from_bits(values.copy(), dtype, shape)
    else:
        own = in_place and b.is_contiguous()
        t = b.detach() if own else b.detach().clone(memory_format=torch.contiguous_format)
        _decode_changes(name, to_bits(t), dtype, e, parts, undo if own else [], written)  # a copy: no undo
    return t


def _decode_joint(
    spec: _Spec,
    members: list[str],
    e: dict,
    base: Mapping[str, torch.Tensor],
    parts: dict[str, memoryview],
    in_place: bool,
    undo: list,
    written: _ChangesHash,
) -> dict[str, torch.Tensor]:
    """A joint entry's changed members: decoded into a copy of the members read as one, then
    each changed member copied out of it, or (in place) its changes scattered into its own bits."""
    bits = np.concatenate([to_bits(base[n]) for n in members])
    positions = _decode_changes(spec[0], bits, spec[1], e, parts, [], written)
    starts = np.cumsum([0] + [base[n].numel() for n in members])
    which = np.searchsorted(starts, positions, side="right") - 1
    made = {}
    for i in np.unique(which):
        name, b, start = members[i], base[members[i]], starts[i]
        if in_place and b.is_contiguous():
            own = to_bits(b.detach())  # a view: the scatter writes into b
            at = positions[which == i]
            local = at - start
            undo.append((own, local, own[local]))
            own[local] = bits[at]
            made[name] = b.detach()
        else:
            made[name] = from_bits(bits[start : starts[i + 1]].copy(), spec[1], b.shape)
    return made


def _decode_changes(
    name: str,
    bits: np.ndarray,
    dtype: torch.dtype,
    e: dict,
    parts: dict,
    undo: list,
    written: _ChangesHash,
) -> np.ndarray:
    """A sparse or tiered entry's changes written into `bits` in one kernel
    (`patch_kernels.decode_changes_into`), the old values onto `undo`, what it writes added to
    `written`; returns the positions written (far changes, then the near tier's)."""
    count, word = e["count"], bits.dtype.type
    tiered = e["mode"] == "tiered"
    far_values = _value_stream(
        name, e["values_as"], e["value_width"], parts["values"], parts["value_escapes"], bits.dtype
    )
    if tiered:
        tier = (*_near_pass(bits, dtype, e["below"]), _SCRATCH.get("positions", bits.size, np.int64))
        flags = np.frombuffer(parts["near_flags"], np.uint8)
        near_values = _value_stream(
            name, e["near_as"], e["near_width"], parts["near_values"], parts["near_escapes"], bits.dtype
        )
    else:  # no tier: nothing is near, and its stream is empty
        tier = (word(0), word(0), 0, 1, _NO_POSITIONS, _NO_POSITIONS)
        flags = _NO_BYTES
        near_values = (_NO_BYTES, patch_kernels.VALUES_SIGN, 0, np.frombuffer(b"", bits.dtype))
    positions = np.empty(count, np.int64)
    old, new = np.empty(count, bits.dtype), np.empty(count, bits.dtype)
    fault, held, moved, wrote, detail = patch_kernels.decode_changes_into(
        bits,
        dtype.is_floating_point,
        *tier,
        flags,
        *_index_stream(e["index_width"], parts["index"], parts["index_escapes"]),
        *far_values,
        *near_values,
        positions,
        old,
        new,
    )
    undo.append((bits, positions[:wrote], old[:wrote]))  # a fault stops it part way: `apply_patch` undoes
    if fault:
        raise CorruptPatch(f"{name}: {_changes_refused(fault, held, moved, detail, e, parts)}")
    far = count - moved
    for part in (slice(0, far), slice(far, count)) if tiered else (slice(0, count),):
        written.add(positions[part])
        written.add(new[part])
    return positions


# Read-only, as sections are: a kernel compiles once per signature, and writable arrays would
# make a second one.
_NO_POSITIONS, _NO_BYTES = np.empty(0, np.int64), np.frombuffer(b"", np.uint8)
_CHANGES_FAULTS = {
    patch_kernels.FLAGS_PAST_NEAR: "flag bits set past the near values",
    patch_kernels.SCATTER_ESCAPES_DIFFER: "escape list does not match the escaped values",
    patch_kernels.SCATTER_IN_NEAR_TIER: "a change listed by position lies in the near tier",
}


def _changes_refused(fault: int, held: int, moved: int, detail: int, e: dict, parts: dict) -> str:
    """What `decode_changes_into` found wrong with an entry, in words: `held` near values, of
    which `moved` flagged."""
    far = e["count"] - moved
    if fault == patch_kernels.FLAGS_SIZE:
        return f"{held} near values need {(held + 7) // 8} flag bytes, got {len(parts['near_flags'])}"
    if fault == patch_kernels.NEAR_OVER_COUNT:
        return f"{moved} near changes, header says {e['count']} in all"
    if fault == patch_kernels.FAR_VALUES_SIZE:
        return _stream_refused(e["values_as"], e["value_width"], len(parts["values"]), far)
    if fault == patch_kernels.NEAR_VALUES_SIZE:
        return _stream_refused(e["near_as"], e["near_width"], len(parts["near_values"]), moved)
    if fault in _CHANGES_FAULTS:
        return _CHANGES_FAULTS[fault]
    return _gaps_refused(fault, detail, e["index_width"], len(parts["index"]), far)
