"""Lossless sparse weight patches (PULSE-style): changed positions plus exact new values.

A patch turns the tensors of `base_version` into those of `target_version` bit for bit.
Values never travel as floating-point deltas. Per tensor, the smallest exact form wins:
"ulp1" when every change is one step of the raw bit pattern (one sign bit per change:
the common case at RL learning rates), "bitdiff" for the integer difference of new and
base bit patterns, zigzagged and narrowed, "raw" for the new bits themselves, or "dense"
when sparse would be larger. Indices are sorted flat positions, delta-encoded into the
narrowest unsigned width with an escape list for large gaps. Multi-byte arrays travel as
byte planes, which zstd compresses far better.

Wire format:  b"FRLP" | format u8 | body length u64 LE | zstd frame (with checksum) of
              header length u32 LE | header JSON | sections
The header names base and target versions and SHA-256 state hashes, and per tensor its
shape, dtype, encoding, count and section offsets. `apply_patch` verifies everything and
returns new tensors; the base is never modified. An anchor (full sync) is a patch whose
base is empty: every tensor dense.
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import zstandard

MAGIC = b"FRLP"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sBQ")  # magic, format version, compressed body length
EMPTY_HASH = hashlib.sha256(b"fedrl-empty-state").hexdigest()

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
_WIDTHS = (np.uint8, np.uint16, np.uint32, np.uint64)


class PatchError(ValueError):
    """A patch that cannot be trusted; the subclass says why."""


class UnknownFormat(PatchError):
    pass


class TruncatedPatch(PatchError):
    pass


class CorruptPatch(PatchError):
    pass


class PatchTooLarge(PatchError):
    pass


class BaseMismatch(PatchError):
    pass


class TensorMismatch(PatchError):
    pass


class TargetMismatch(PatchError):
    pass


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

    @property
    def is_anchor(self) -> bool:
        return self.base_version is None


# ---------------------------------------------------------------- bits and hashes


def to_bits(t: torch.Tensor) -> np.ndarray:
    """The raw bit pattern of a tensor as a flat unsigned numpy array (no copy when contiguous)."""
    if t.dtype not in _BITS:
        raise TypeError(f"patches carry {sorted(_DTYPE_NAMES)} tensors, not {t.dtype}")
    int_dtype, np_dtype = _BITS[t.dtype]
    return t.detach().contiguous().view(int_dtype).reshape(-1).numpy().view(np_dtype)


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


def state_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """SHA-256 over names, dtypes, shapes and raw bytes, in sorted name order."""
    if not tensors:
        return EMPTY_HASH
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(json.dumps([name, dtype_name(t.dtype), list(t.shape)]).encode())
        h.update(memoryview(to_bits(t)))
    return h.hexdigest()


# ---------------------------------------------------------------- index and value coding


def shuffle_bytes(arr: np.ndarray) -> bytes:
    """Byte planes one after another (all low bytes, then the next...): the high planes of
    small integers are nearly constant, which zstd squeezes far better than interleaved."""
    if arr.dtype.itemsize == 1:
        return arr.tobytes()
    return np.ascontiguousarray(arr.view(np.uint8).reshape(-1, arr.dtype.itemsize).T).tobytes()


def unshuffle_bytes(data, dtype) -> np.ndarray:
    dtype = np.dtype(dtype)
    flat = _array(data, dtype).view(np.uint8)  # checks the size is a whole number of items
    if dtype.itemsize == 1:
        return flat.view(dtype)
    return np.ascontiguousarray(flat.reshape(dtype.itemsize, -1).T).view(dtype).reshape(-1)


def _narrowest(max_value: int) -> type:
    return next(w for w in _WIDTHS if max_value <= np.iinfo(w).max)


def encode_indices(idx: np.ndarray) -> tuple[bytes, str, bytes]:
    """Sorted flat indices -> gaps in the width that minimises bytes, escapes as uint64."""
    gaps = np.diff(idx, prepend=0).astype(np.uint64)
    if idx.size:
        gaps[0] = idx[0]
    best = None
    for width in _WIDTHS:
        sentinel = np.iinfo(width).max
        escapes = int(np.count_nonzero(gaps >= sentinel)) if width is not np.uint64 else 0
        size = gaps.size * np.dtype(width).itemsize + 8 * escapes
        if best is None or size < best[0]:
            best = (size, width, escapes)
    _, width, escapes = best
    if width is np.uint64:
        return shuffle_bytes(gaps), "uint64", b""
    sentinel = np.iinfo(width).max
    large = gaps >= sentinel
    small = np.where(large, sentinel, gaps).astype(width)
    return shuffle_bytes(small), np.dtype(width).name, gaps[large].tobytes() if escapes else b""


def _array(data, dtype) -> np.ndarray:
    if len(data) % np.dtype(dtype).itemsize:
        raise CorruptPatch(f"a section of {len(data)} bytes is not a whole number of {np.dtype(dtype).name}")
    return np.frombuffer(data, dtype=dtype)


def decode_indices(small: bytes, width: str, large: bytes, count: int, numel: int) -> np.ndarray:
    gaps = unshuffle_bytes(small, width)
    if gaps.size != count:
        raise CorruptPatch(f"index section holds {gaps.size} entries, header says {count}")
    out = gaps.astype(np.int64)
    if width != "uint64":
        escaped = gaps == np.iinfo(width).max
        big = _array(large, np.uint64)
        if big.size != int(np.count_nonzero(escaped)):
            raise CorruptPatch("escape list does not match the escaped gaps")
        if big.size and int(big.max()) > numel:
            raise CorruptPatch("index gap beyond the tensor")
        out[escaped] = big.astype(np.int64)
    elif count and int(gaps.max()) > numel:
        raise CorruptPatch("index gap beyond the tensor")
    idx = np.cumsum(out)
    if count and (idx[-1] >= numel or (count > 1 and np.any(out[1:] == 0))):
        raise CorruptPatch("indices out of range or not strictly increasing")
    return idx


def zigzag(diff: np.ndarray) -> np.ndarray:
    """Signed -> unsigned with small magnitudes small: 0, -1, 1, -2 ... -> 0, 1, 2, 3 ..."""
    bits = diff.dtype.itemsize * 8
    return ((diff << 1) ^ (diff >> (bits - 1))).view(diff.dtype.str.replace("i", "u"))


def unzigzag(z: np.ndarray) -> np.ndarray:
    signed = z.view(z.dtype.str.replace("u", "i"))
    return (z >> 1).view(signed.dtype) ^ -(signed & 1)


def encode_values(base_vals: np.ndarray, new_vals: np.ndarray) -> tuple[str, str, bytes]:
    """The smallest exact form: every change one ulp ("ulp1": one sign bit each), the narrowed
    zigzag integer difference of the bits ("bitdiff"), or the new raw bits ("raw")."""
    signed = new_vals.dtype.str.replace("u", "i")
    diff = zigzag(new_vals.view(signed) - base_vals.view(signed))  # wraps mod 2**bits: exact
    if diff.size and int(diff.min()) >= 1 and int(diff.max()) <= 2:
        return "ulp1", "bit", np.packbits(diff == 2).tobytes()
    width = _narrowest(int(diff.max())) if diff.size else np.uint8
    if np.dtype(width).itemsize < new_vals.dtype.itemsize:
        return "bitdiff", np.dtype(width).name, shuffle_bytes(diff.astype(width))
    return "raw", new_vals.dtype.name, shuffle_bytes(new_vals)


def decode_values(kind: str, width: str, data: bytes, base_vals: np.ndarray, count: int) -> np.ndarray:
    if kind == "ulp1":
        if len(data) != (count + 7) // 8:
            raise CorruptPatch(f"sign bits for {count} values need {(count + 7) // 8} bytes, got {len(data)}")
        up = np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=count).astype(base_vals.dtype)
        vals, width = up + 1, base_vals.dtype.name  # zigzag: 1 is -1, 2 is +1
    else:
        vals = unshuffle_bytes(data, width)
    if vals.size != count:
        raise CorruptPatch(f"value section holds {vals.size} entries, header says {count}")
    if kind == "raw":
        if vals.dtype != base_vals.dtype:
            raise CorruptPatch("raw values have the wrong width")
        return vals
    if kind not in ("bitdiff", "ulp1"):
        raise CorruptPatch(f"unknown value encoding {kind!r}")
    diff = unzigzag(vals.astype(base_vals.dtype))
    signed = base_vals.dtype.str.replace("u", "i")
    return (base_vals.view(signed) + diff.view(signed)).view(base_vals.dtype)


# ---------------------------------------------------------------- encode


def encode_patch(
    base: Mapping[str, torch.Tensor] | None,
    new: Mapping[str, torch.Tensor],
    base_version: int | None,
    target_version: int,
    level: int = 1,
    base_hash: str | None = None,
    target_hash: str | None = None,
) -> bytes:
    """Patch from `base` (None: an anchor) to `new`. Pass known hashes to skip re-hashing."""
    base = base or {}
    if base and set(base) != set(new):
        raise TensorMismatch(f"base and new name different tensors: {sorted(set(base) ^ set(new))[:3]}")
    entries, sections, offset = [], [], 0

    def add(data: bytes) -> list[int]:
        nonlocal offset
        sections.append(data)
        offset += len(data)
        return [offset - len(data), len(data)]

    for name in sorted(new):
        t = new[name]
        entry = {"name": name, "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
        new_bits = to_bits(t)
        if name in base:
            b = base[name]
            if b.dtype != t.dtype or b.shape != t.shape:
                raise TensorMismatch(
                    f"{name}: base {b.dtype}{tuple(b.shape)} vs new {t.dtype}{tuple(t.shape)}"
                )
            base_bits = to_bits(b)
            idx = np.flatnonzero(base_bits != new_bits)
            if idx.size == 0:
                entries.append({**entry, "mode": "same", "count": 0})
                continue
            small, width, large = encode_indices(idx)
            kind, vwidth, values = encode_values(base_bits[idx], new_bits[idx])
            if len(small) + len(large) + len(values) < new_bits.nbytes:
                entries.append(
                    {
                        **entry,
                        "mode": kind,
                        "count": int(idx.size),
                        "index_width": width,
                        "index": add(small),
                        "escapes": add(large),
                        "value_width": vwidth,
                        "values": add(values),
                    }
                )
                continue
        entries.append(
            {**entry, "mode": "dense", "count": int(new_bits.size), "values": add(new_bits.tobytes())}
        )

    header = {
        "format": FORMAT_VERSION,
        "base_version": base_version if base else None,
        "base_hash": (base_hash or state_hash(base)) if base else EMPTY_HASH,
        "target_version": target_version,
        "target_hash": target_hash or state_hash(new),
        "tensors": entries,
    }
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    body = b"".join([struct.pack("<I", len(header_bytes)), header_bytes, *sections])
    frame = zstandard.ZstdCompressor(level=level, write_checksum=True).compress(body)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(frame)) + frame


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
        body = zstandard.ZstdDecompressor().decompress(frame, max_output_size=declared)
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


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_hash(x) -> bool:
    return isinstance(x, str) and len(x) == 64 and all(c in "0123456789abcdef" for c in x)


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
    )
    if not ok:
        raise CorruptPatch("patch header fields are missing or of the wrong type")
    for e in raw["tensors"]:
        fine = (
            isinstance(e, dict)
            and isinstance(e.get("name"), str)
            and isinstance(e.get("dtype"), str)  # a list or dict is no key of a table: check the kind first
            and e["dtype"] in _DTYPE_NAMES
            and isinstance(e.get("mode"), str)
            and e["mode"] in ("same", "dense", "raw", "bitdiff", "ulp1")
            and _is_int(e.get("count"))
            and isinstance(e.get("shape"), list)
            and all(_is_int(s) and 0 <= s < 2**40 for s in e["shape"])
            and all(
                isinstance(e.get(k), list) and len(e[k]) == 2 and all(_is_int(x) for x in e[k])
                for k in {"same": (), "dense": ("values",)}.get(e["mode"], ("index", "escapes", "values"))
            )
        )
        if not fine:
            raise CorruptPatch(f"malformed tensor entry {str(e)[:80]}")
    names = [e["name"] for e in raw["tensors"]]
    if len(set(names)) != len(names):
        raise CorruptPatch("a tensor appears twice in the patch")
    return PatchHeader(
        raw["base_version"], raw["base_hash"], raw["target_version"], raw["target_hash"], raw["tensors"]
    )


def read_header(patch: bytes, limits: PatchLimits = PatchLimits()) -> PatchHeader:
    return _open(patch, limits)[0]


class _Sections:
    """Hands out the body's sections in order; each must start where the last one ended."""

    def __init__(self, body: memoryview):
        self.body, self.pos = body, 0

    def take(self, span, name: str) -> memoryview:
        try:
            start, size = (int(x) for x in span)
        except (TypeError, ValueError):
            raise CorruptPatch(f"{name}: bad section span {span!r}") from None
        if start != self.pos or size < 0 or start + size > len(self.body):
            raise CorruptPatch(f"{name}: section [{start}, {start + size}) is not the next part of the body")
        self.pos += size
        return self.body[start : start + size]


def apply_patch(
    base: Mapping[str, torch.Tensor] | None,
    patch: bytes,
    base_hash: str | None = None,
    limits: PatchLimits = PatchLimits(),
) -> dict[str, torch.Tensor]:
    """Verify `patch` against `base` and return the target tensors (new objects; base untouched).

    Raises a PatchError subclass naming the reason for anything that does not verify.
    """
    header, sections = _open(patch, limits)
    base = base or {}
    if not header.is_anchor:
        held = base_hash or state_hash(base)
        if held != header.base_hash:
            raise BaseMismatch(
                f"patch is for base {header.base_hash[:12]} (v{header.base_version}), held {held[:12]}"
            )
    names = [e["name"] for e in header.tensors]
    if not header.is_anchor and set(names) != set(base):
        raise TensorMismatch(f"patch names other tensors than the base: {sorted(set(names) ^ set(base))[:3]}")
    out, cursor = {}, _Sections(sections)
    for e in header.tensors:
        out[e["name"]] = _decode_tensor(e, base, cursor, header.is_anchor)
    if cursor.pos != len(sections):
        raise CorruptPatch(f"{len(sections) - cursor.pos} bytes of the body belong to no tensor")
    if state_hash(out) != header.target_hash:
        raise TargetMismatch(
            f"reconstructed state does not hash to v{header.target_version}'s {header.target_hash[:12]}"
        )
    return out


def _decode_tensor(e: dict, base, sections: _Sections, anchor: bool) -> torch.Tensor:
    name, dtype, shape, mode, count = (
        e["name"],
        _DTYPE_NAMES[e["dtype"]],
        tuple(e["shape"]),
        e["mode"],
        e["count"],
    )
    numel = math.prod(shape)  # exact: an int64 product can wrap to a size that seems to fit
    if not 0 <= count <= numel:
        raise CorruptPatch(f"{name}: count {count} outside [0, {numel}]")
    np_dtype = _BITS[dtype][1]
    if not anchor:
        b = base[name]
        if b.dtype != dtype or tuple(b.shape) != shape:
            raise TensorMismatch(f"{name}: patch has {e['dtype']}{shape}, base has {b.dtype}{tuple(b.shape)}")
    if mode == "dense":
        data = sections.take(e.get("values"), name)
        if count != numel or len(data) != numel * np.dtype(np_dtype).itemsize:
            raise CorruptPatch(f"{name}: dense section has the wrong size")
        return from_bits(_array(data, np_dtype).copy(), dtype, shape)
    if anchor:
        raise CorruptPatch(f"{name}: an anchor must carry every tensor dense")
    if mode == "same":
        return base[name].detach().clone()
    small, large = sections.take(e["index"], name), sections.take(e["escapes"], name)
    idx = decode_indices(small, _unsigned(e.get("index_width")), large, count, numel)
    width = "bit" if mode == "ulp1" else _unsigned(e.get("value_width"))
    bits = to_bits(base[name]).copy()
    bits[idx] = decode_values(mode, width, sections.take(e["values"], name), bits[idx], count)
    return from_bits(bits, dtype, shape)


def _unsigned(name) -> str:
    if not isinstance(name, str) or name not in {np.dtype(w).name for w in _WIDTHS}:
        raise CorruptPatch(f"unknown integer width {name!r}")
    return name
