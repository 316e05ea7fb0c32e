"""Patches from the network, as an attacker or a broken link would send them.

`fuzz_signed` takes real signed patches (an anchor and deltas between bf16/fp16/fp32 states),
mutates them (bit flips, truncation, trailing junk, edits behind a valid zstd checksum, header
fields of the wrong kind, splices of two patches, swapped bases, forged and swapped signatures,
a genuine patch served under another version's catalog entry) and hands each to the receive
path a client runs (signature, catalog labels, base hash, codec). Every outcome is counted:
refused with a PatchError (the only acceptable failure), exact (the mutation did not change
what the patch means), silently wrong (a state or label other than the one asked for) or a
crash (any other exception). `bombs` are objects valid in form but absurd in size, one per
stream a receiver decompresses or allocates from.
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch
import zstandard

from fedrl.patch import (
    FORMAT_VERSION,
    PatchLimits,
    apply_patch,
    compress_body,
    decompress_body,
    encode_patch,
    read_header,
    state_hash,
    to_bits,
)
from fedrl.patch_chain import check_labels
from fedrl.patch_errors import PatchError
from fedrl.patch_routes import PatchRef
from fedrl.signing import SIGNATURE_BYTES, generate_signing_key, sign_patch, verify_signed_patch
from fedrl.sim.memory import reset_peak, status_bytes

PREFIX = struct.Struct("<4sBQ")  # the codec's wire prefix: magic, format, frame length


def bits_equal(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and np.array_equal(to_bits(a[k]), to_bits(b[k]))
        for k in a
    )


def body_of(patch: bytes) -> bytes:
    return decompress_body(patch[PREFIX.size :], max_output_size=1 << 30)


def rewrap(body: bytes, declared: bool = True) -> bytes:
    """A body behind a fresh, valid frame and checksum (so only the codec's own checks stand)."""
    frame = compress_body(body, declared=declared)
    return PREFIX.pack(b"FRLP", FORMAT_VERSION, len(frame)) + frame


def with_header(patch: bytes, edit: Callable[[dict], None]) -> bytes:
    body = body_of(patch)
    (hlen,) = struct.unpack_from("<I", body)
    header = json.loads(body[4 : 4 + hlen])
    edit(header)
    raw = json.dumps(header).encode()
    return rewrap(struct.pack("<I", len(raw)) + raw + body[4 + hlen :])


def cases() -> list[tuple[dict | None, int | None, bytes, dict, int]]:
    """(base, base_version, patch, target, target_version): a delta (two small tensors of it
    joint, one tiered, one with Rice-coded gaps), an anchor, another delta."""
    g = torch.Generator().manual_seed(1)
    v0 = {
        "a": torch.randn(40, 30, generator=g).bfloat16(),
        "b": torch.randn(500, generator=g).half(),
        "c": torch.randn(7, generator=g),
        "d": torch.randn(3, 3, generator=g).bfloat16(),
    }
    master = torch.randn(1 << 14, generator=g) * 0.02  # an optimizer step on it goes tiered
    v0["e"] = master.bfloat16()
    v0["f"] = torch.randn(1 << 16, generator=g).bfloat16()
    v1 = {k: v.clone() for k, v in v0.items()}
    v1["e"] = (master + 3e-7 * torch.randn(master.shape, generator=g).sign()).bfloat16()
    spread = torch.randperm(1 << 16, generator=g)[:1100]  # evenly spread changes: Rice-coded gaps
    v1["f"].view(torch.int16)[spread] += 1
    v1["a"].view(torch.int16).view(-1)[::13] += 1
    v1["d"].view(torch.int16).view(-1)[4] -= 3
    v1["b"].view(torch.int16)[::3] -= 2
    v1["b"][0] = float("nan")
    v1["c"] = torch.randn(7, generator=g)  # dense
    v2 = {k: v.clone() for k, v in v1.items()}
    v2["d"].view(torch.int16).view(-1)[0] ^= 1
    return [
        (v0, 0, encode_patch(v0, v1, 0, 1), v1, 1),
        (None, None, encode_patch(None, v1, None, 1), v1, 1),
        (v1, 1, encode_patch(v1, v2, 1, 2), v2, 2),
    ]


WRONG_KINDS = [["bfloat16"], {"x": 1}, 7, None, -1, 2**70, "", 1.5, True]


def mutate_patch(patch: bytes, other: bytes, rng: np.random.Generator) -> tuple[str, bytes]:
    """One mutation of an unsigned patch; `other` is another patch to splice from."""
    kinds = ["flip", "truncate", "append", "body-flip", "header-digit", "header-kind", "sections", "splice"]
    kind = kinds[rng.integers(len(kinds))]
    data = bytearray(patch)
    if kind == "flip":
        for _ in range(rng.integers(1, 4)):
            data[rng.integers(len(data))] ^= 1 << rng.integers(8)
        return kind, bytes(data)
    if kind == "truncate":
        return kind, bytes(data[: rng.integers(len(data))])
    if kind == "append":
        return kind, bytes(data) + rng.bytes(int(rng.integers(1, 16)))
    body = bytearray(body_of(patch))
    (hlen,) = struct.unpack_from("<I", body)
    if kind == "body-flip":  # behind a valid checksum
        body[rng.integers(len(body))] ^= 1 << rng.integers(8)
        return kind, rewrap(bytes(body))
    if kind == "header-digit":
        header = body[4 : 4 + hlen].decode()
        digits = [i for i, ch in enumerate(header) if ch.isdigit()]
        pos = digits[rng.integers(len(digits))]
        raw = (header[:pos] + str(rng.integers(10)) + header[pos + 1 :]).encode()
        return kind, rewrap(struct.pack("<I", len(raw)) + raw + bytes(body[4 + hlen :]))
    if kind == "header-kind":  # a field of the wrong type or range, anywhere in the header

        def edit(header: dict) -> None:
            if rng.random() < 0.4:
                header[list(header)[rng.integers(len(header))]] = WRONG_KINDS[rng.integers(len(WRONG_KINDS))]
            else:
                entry = header["tensors"][rng.integers(len(header["tensors"]))]
                entry[list(entry)[rng.integers(len(entry))]] = WRONG_KINDS[rng.integers(len(WRONG_KINDS))]

        return kind, with_header(patch, edit)
    if kind == "sections":
        rest = bytes(body[4 + hlen :])
        cut = (
            rest[: rng.integers(len(rest) + 1)]
            if rng.random() < 0.5
            else rest + rng.bytes(int(rng.integers(1, 9)))
        )
        return kind, rewrap(bytes(body[: 4 + hlen]) + cut)
    # splice: this patch's header over the other's sections
    other_body = body_of(other)
    (other_hlen,) = struct.unpack_from("<I", other_body)
    return kind, rewrap(bytes(body[: 4 + hlen]) + other_body[4 + other_hlen :])


def fuzz_signed(
    mutations: int, seed: int = 0, limits: PatchLimits | None = None, verify: str = "state"
) -> dict:
    """Run `mutations` mutated signed patches through the receive path; the outcome counts.
    `verify="changes"` is a sync's path: the base's hash is known and the result is not hashed
    whole, so an exact state under a target hash the signer got wrong counts as "misnamed" (a
    sync's next link refuses that name as its base, and its next sync re-hashes what it holds)."""
    limits = limits or PatchLimits()
    rng = np.random.default_rng(seed)
    key, attacker = generate_signing_key(), generate_signing_key()
    public = key.public_key()
    made = cases()
    bases = [(b, v) for b, v, *_ in made if b is not None]
    target_hashes = {v: state_hash(t) for *_, t, v in made}
    outcomes, kinds, crashes, wrong = Counter(), Counter(), [], []
    for i in range(mutations):
        base, base_version, patch, target, target_version = made[i % len(made)]
        other = made[(i + 1 + rng.integers(len(made) - 1)) % len(made)][2]
        ref = asked = PatchRef(base_version, target_version, 0, "")  # the catalog entry asked for
        signed, layer = sign_patch(patch, key), rng.random()
        if layer < 0.6:  # the coordinator's genuine signature over a mutated patch: the codec must hold
            kind, inner = mutate_patch(patch, other, rng)
            signed = sign_patch(inner, key)
        elif layer < 0.7:
            kind, signed = "forged", sign_patch(mutate_patch(patch, other, rng)[1], attacker)
        elif layer < 0.8:  # a signature taken from another genuine patch
            kind, signed = (
                "swapped-signature",
                signed[:4] + sign_patch(other, key)[4 : 4 + SIGNATURE_BYTES] + patch,
            )
        elif layer < 0.9:  # raw bytes of the envelope flipped on the wire
            kind, flipped = "envelope-flip", bytearray(signed)
            flipped[rng.integers(len(flipped))] ^= 1 << rng.integers(8)
            signed = bytes(flipped)
        else:  # a genuine patch under another catalog entry (rollback), or against another base
            kind = "relabel" if rng.random() < 0.5 else "swapped-base"
            if kind == "relabel":
                ref = PatchRef(base_version, target_version + int(rng.integers(1, 4)), 0, "")
            else:
                base = bases[rng.integers(len(bases))][0]
        kinds[kind] += 1
        try:
            inner = verify_signed_patch(signed, public)
            header = read_header(inner, limits)
            check_labels(header, ref)
            known = state_hash(base) if verify == "changes" and base is not None else None
            out = apply_patch(base, inner, base_hash=known, limits=limits, verify=verify)
        except PatchError as err:
            outcomes[f"refused:{type(err).__name__}"] += 1
            continue
        except Exception as err:  # noqa: BLE001 - counted: a crash outside the error family is a finding
            outcomes["crashed"] += 1
            crashes.append(f"{kind}: {type(err).__name__}: {str(err)[:120]}")
            continue
        # right only if it is the target state of the entry that was asked for
        exact = bits_equal(out, target) and ref == asked
        named = header.target_hash == target_hashes[target_version]
        outcomes[("exact" if named else "misnamed") if exact else "silently_applied"] += 1
        if not exact:
            wrong.append(kind)
    return {
        "tried": mutations,
        "refused": sum(n for k, n in outcomes.items() if k.startswith("refused:")),
        "exact": outcomes["exact"],
        "misnamed": outcomes["misnamed"],
        "silently_applied": outcomes["silently_applied"],
        "crashed": outcomes["crashed"],
        "crashes": crashes[:10],
        "silently_applied_by": dict(Counter(wrong)),
        "outcomes": dict(outcomes),
        "mutations": dict(kinds),
    }


def zeros_frame(size: int, declared: bool = True) -> bytes:
    """A patch prefix and a frame of `size` zero bytes (1 GiB: ~32 KB), made in 1 MiB steps."""
    compressor = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=declared)
    stream = compressor.compressobj(size=size if declared else -1)
    chunk, parts = bytes(1 << 20), []
    for _ in range(size >> 20):
        parts.append(stream.compress(chunk))
    frame = b"".join(parts) + stream.flush()
    return PREFIX.pack(b"FRLP", FORMAT_VERSION, len(frame)) + frame


def bombs(limit: int, key) -> dict[str, bytes]:
    """Objects valid in form, absurd in size, each against the receiver's `limit` on bodies;
    the last is signed by `key` (the coordinator's)."""
    body_bomb = zeros_frame(1 << 30)
    header = {
        "format": FORMAT_VERSION,
        "base_version": None,
        "base_hash": "0" * 64,
        "target_version": 1,
        "target_hash": "0" * 64,
    }

    def anchor_of(entry: dict, sections: bytes) -> bytes:
        raw = json.dumps({**header, "tensors": [entry]}).encode()
        return rewrap(struct.pack("<I", len(raw)) + raw + sections)

    dense = {"name": "w", "dtype": "float32", "mode": "dense"}
    return {
        # the frame declares a size past the limit: refused before decompressing
        "frame-declared": body_bomb,
        # a frame that does not declare its size: refused rather than streamed without bound
        "frame-undeclared": zeros_frame(64 << 20, declared=False),
        # a small body whose header claims a huge tensor: refused before allocating it
        "tensor-shape": anchor_of(
            {**dense, "shape": [1 << 20, 1 << 20], "count": 1 << 40, "sizes": [64]}, bytes(64)
        ),
        "tensor-overflow": anchor_of({**dense, "shape": [2**32, 2**32], "count": 0, "sizes": [0]}, b""),
        "sparse-count": anchor_of(
            {
                **dense,
                "mode": "sparse",
                "shape": [limit],
                "count": 1 << 40,
                "index_width": "uint8",
                "values_as": "delta",
                "value_width": "uint8",
                "sizes": [8, 0, 8, 0],
            },
            bytes(16),
        ),
        # the same bomb inside a genuinely signed envelope: the signature does not make it safe
        "signed-frame": sign_patch(body_bomb, key),
    }


def try_bombs(limits: PatchLimits) -> list[dict]:
    """Each bomb through the receive path: how it was refused and what memory it cost."""
    key, rows = generate_signing_key(), []
    for name, data in bombs(limits.max_body_bytes, key).items():
        reset_peak()
        before = status_bytes("VmHWM")
        try:
            inner = verify_signed_patch(data, key.public_key()) if name.startswith("signed") else data
            apply_patch(None, inner, limits=limits)
            outcome = "applied"
        except PatchError as err:
            outcome = f"refused:{type(err).__name__}: {str(err)[:100]}"
        except Exception as err:  # noqa: BLE001 - a crash is what this row is looking for
            outcome = f"crashed:{type(err).__name__}: {str(err)[:100]}"
        growth = status_bytes("VmHWM") - before
        rows.append({"name": name, "bytes": len(data), "outcome": outcome, "peak_rss_growth": growth})
    return rows
