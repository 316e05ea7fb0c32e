import json
import re
import struct
from unittest import mock

import blake3
import numpy as np
import pytest
import torch
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st
from ulp_keys import ordered

import fedrl.patch
from fedrl.patch import (
    FORMAT_VERSION,
    JOINT_NUMEL,
    PatchLimits,
    apply_patch,
    changes_hash,
    decode_indices,
    encode_indices,
    encode_patch,
    read_header,
    rice_encode,
    shuffle_bytes,
    state_hash,
    to_bits,
)
from fedrl.patch_errors import (
    BaseMismatch,
    CorruptPatch,
    PatchError,
    PatchTooLarge,
    TargetMismatch,
    TensorMismatch,
    TruncatedPatch,
    UnknownFormat,
)
from fedrl.sim.patch_fuzz import bits_equal, body_of, cases, fuzz_signed, rewrap, try_bombs, with_header

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@st.composite
def base_and_new(draw):
    """Random tensors, dtypes and change masks; special bit patterns mixed in."""
    n = draw(st.integers(1, 4))
    base, new = {}, {}
    for i in range(n):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(st.integers(1, 40), min_size=0, max_size=3)))
        seed = draw(st.integers(0, 2**31))
        g = torch.Generator().manual_seed(seed)
        b = torch.randn(shape, generator=g).to(dtype)
        frac = draw(st.sampled_from([0.0, 0.001, 0.01, 0.3, 1.0]))
        mask = torch.rand(shape, generator=g) < frac
        step = draw(st.sampled_from(["ulp", "random", "special"]))
        if step == "ulp":
            nb = torch.nextafter(b.float(), torch.full_like(b.float(), float("inf"))).to(dtype)
            nb = torch.where(nb == b, -b, nb)
        elif step == "random":
            nb = torch.randn(shape, generator=g).to(dtype)
        else:  # NaN payloads, signed zeros, infinities
            specials = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf")]).to(dtype)
            nb = specials[torch.randint(0, 5, shape, generator=g)]
        new_t = torch.where(mask, nb, b)
        base[f"t{i}"], new[f"t{i}"] = b, new_t
    return base, new


@settings(max_examples=150, deadline=None)
@given(base_and_new(), st.integers(1, 3))
def test_round_trip_is_bit_identical(pair, level):
    base, new = pair
    patch = encode_patch(base, new, 3, 4, level=level)
    assert bits_equal(apply_patch(base, patch), new)
    anchor = encode_patch(None, new, None, 4)
    assert bits_equal(apply_patch(None, anchor), new)
    assert read_header(patch).target_hash == state_hash(new)


def test_nan_payload_bits_survive():
    base = {"w": torch.zeros(8, dtype=torch.float32)}
    new = {
        "w": torch.tensor(
            np.array([0x7FC00001, 0x7FC00002, 0x80000000, 0, 1, 2, 3, 0xFF800000], dtype=np.uint32).view(
                np.float32
            )
        )
    }
    assert bits_equal(apply_patch(base, encode_patch(base, new, 0, 1)), new)


def test_modes_chosen_per_tensor():
    g = torch.Generator().manual_seed(0)
    numel = JOINT_NUMEL + 1000  # each alone: smaller tensors share a joint entry
    base = {k: torch.randn(numel, generator=g).bfloat16() for k in ("same", "ulp", "steps", "far", "dense")}
    new = {k: v.clone() for k, v in base.items()}
    new["ulp"].view(torch.int16)[::50] += 1
    new["ulp"].view(torch.int16)[1::50] -= 1
    new["steps"].view(torch.int16)[::50] += 3
    new["far"][::50] = torch.randn(len(range(0, numel, 50)), generator=g).bfloat16()
    new["dense"] = torch.randn(numel, generator=g).bfloat16()
    patch = encode_patch(base, new, 0, 1)
    names = sorted(base)
    modes = {names[e["at"]]: (e["mode"], e.get("values_as")) for e in read_header(patch).tensors}
    assert modes == {  # "same" is not listed: the base's own tensor
        "ulp": ("sparse", "sign"),
        "steps": ("sparse", "delta"),
        "far": ("sparse", "raw"),
        "dense": ("dense", None),
    }
    assert bits_equal(apply_patch(base, patch), new)


def lora_block(g: torch.Generator) -> dict[str, torch.Tensor]:
    """A tiny adapter's factors (bfloat16, 512-1,024 values each), a float32 head and one tensor
    too large to join."""
    block = {
        f"l{i}.{m}.lora_{ab}": torch.randn(*shape, generator=g).bfloat16() * 0.02
        for i in range(2)
        for m in ("q", "k", "v", "o")
        for ab, shape in (("A", (8, 64)), ("B", (64, 8)))
    }
    return block | {
        "head": torch.randn(300, generator=g),
        "big": torch.randn(JOINT_NUMEL, generator=g).bfloat16(),
    }


def test_small_tensors_of_a_dtype_travel_as_one_joint_entry(monkeypatch):
    g = torch.Generator().manual_seed(3)
    base = lora_block(g)
    new = {k: v.clone() for k, v in base.items()}
    for name in [n for n in base if "lora" in n][::2]:  # top-5% of half the factors, a few ulps each
        flat = new[name].view(torch.int16).view(-1)
        flat[torch.randperm(flat.numel(), generator=g)[:26]] += torch.randint(
            -40, 40, (26,), generator=g
        ).short()
    new["head"][7] += 1.0  # one float32 tensor: no joint entry for one changed tensor
    new["big"].view(torch.int16)[::100] += 1
    patch = encode_patch(base, new, 0, 1)
    entries = read_header(patch).tensors
    names = sorted(base)
    assert entries[0]["joint"] == "bfloat16" and [names[e["at"]] for e in entries[1:]] == ["big", "head"]
    assert bits_equal(apply_patch(base, patch), new)
    # in place: the changed members take the changes in their own storage, the rest stay as they are
    snapshot = {k: v.clone() for k, v in base.items()}
    storage = {k: v.data_ptr() for k, v in base.items()}
    out = apply_patch(base, patch, in_place=True, verify="changes")
    assert bits_equal(out, new) and all(out[k].data_ptr() == storage[k] for k in out)
    # what it bought: the same changes with every tensor alone
    monkeypatch.setattr(fedrl.patch, "JOINT_NUMEL", 0)
    alone = encode_patch(snapshot, new, 0, 1)
    assert all("at" in e for e in read_header(alone).tensors) and bits_equal(
        apply_patch(snapshot, alone), new
    )
    header_bytes = lambda p: struct.unpack_from("<I", body_of(p))[0]  # noqa: E731
    assert 2 * header_bytes(patch) < header_bytes(alone) and len(patch) < len(alone), (len(patch), len(alone))
    monkeypatch.undo()
    with pytest.raises(TensorMismatch, match="l0.q.lora_A: base torch.bfloat16"):  # a member changed dtype
        encode_patch(snapshot, {**new, "l0.q.lora_A": new["l0.q.lora_A"].float()}, 0, 1)
    # a base with no small bfloat16 tensors cannot take a joint entry, even when vouched for
    other = {k: v.half() if "lora" in k else v for k, v in snapshot.items()}
    with pytest.raises(TensorMismatch, match="joins bfloat16 tensors"):
        apply_patch(other, patch, base_hash=state_hash(snapshot))
    # a joint entry that does not verify puts every member back
    wrong = {k: v.clone() for k, v in snapshot.items()}
    wrong["l0.k.lora_A"].view(torch.int16)[0, 0] += 1  # a value the patch leaves
    held = {k: v.clone() for k, v in wrong.items()}
    with pytest.raises(TargetMismatch):
        apply_patch(wrong, patch, base_hash=state_hash(snapshot), in_place=True)
    assert bits_equal(wrong, held)


def test_specific_errors():
    base = {"w": torch.randn(64).bfloat16()}
    new = {"w": base["w"].clone()}
    new["w"].view(torch.int16)[3] += 1
    patch = encode_patch(base, new, 0, 1)
    other = {"w": torch.randn(64).bfloat16()}
    with pytest.raises(BaseMismatch):
        apply_patch(other, patch)
    with pytest.raises(TruncatedPatch):
        apply_patch(base, patch[:-5])
    with pytest.raises(CorruptPatch):
        apply_patch(base, patch + b"\0")
    with pytest.raises(UnknownFormat):
        apply_patch(base, b"NOPE" + patch[4:])
    with pytest.raises(UnknownFormat, match="format 9"):
        apply_patch(base, patch[:4] + bytes([9]) + patch[5:])
    with pytest.raises(PatchTooLarge):
        apply_patch(base, patch, limits=PatchLimits(max_patch_bytes=10))
    with pytest.raises(PatchTooLarge):
        apply_patch(base, patch, limits=PatchLimits(max_body_bytes=10))
    with pytest.raises(TensorMismatch):
        encode_patch(base, {"v": new["w"]}, 0, 1)
    renamed = {"v": base["w"].clone()}
    with pytest.raises(BaseMismatch):
        apply_patch(renamed, patch)
    with pytest.raises(TargetMismatch):  # claims the right hash, holds other tensors: the result shows it
        apply_patch(renamed, patch, base_hash=state_hash(base))
    with pytest.raises(TensorMismatch):  # fewer tensors than the patch changes
        apply_patch({}, patch, base_hash=state_hash(base))


def test_zip_bomb_is_refused_before_decompressing():
    body = b"\0" * (64 << 20)
    frame = zstandard.ZstdCompressor(level=19).compress(body)
    bomb = struct.pack("<4sBQ", b"FRLP", FORMAT_VERSION, len(frame)) + frame
    assert len(bomb) < 100_000
    with pytest.raises(PatchTooLarge):
        apply_patch(None, bomb, limits=PatchLimits(max_body_bytes=1 << 20))


# ------------------------------------------------------------------ mutation fuzzer


def _fuzz_cases():
    return [(base, patch, target) for base, _, patch, target, _ in cases()]


@pytest.mark.parametrize("verify", ["state", "changes"])
def test_mutation_fuzzer_never_yields_a_wrong_state(verify):
    """10,500 mutations of real signed patches through a client's receive path (signature,
    catalog labels, base hash, codec): each is refused with a PatchError or means what it did.
    Checking only the changes, the one thing left unchecked is the signed target hash, as a name."""
    result = fuzz_signed(10_500, seed=0, verify=verify)
    assert result["silently_applied"] == 0 and result["crashed"] == 0, result
    assert result["refused"] > 9_500, result
    assert result["refused"] + result["exact"] + result["misnamed"] == 10_500, result
    assert result["misnamed"] == 0 if verify == "state" else result["misnamed"] > 0, result
    assert set(result["mutations"]) >= {"forged", "splice", "relabel", "swapped-base", "header-kind"}


def test_bombs_in_every_stream_are_refused_before_they_cost_memory():
    rows = try_bombs(PatchLimits(max_patch_bytes=1 << 24, max_body_bytes=1 << 24))
    assert len(rows) == 6
    for row in rows:
        assert row["outcome"].startswith("refused:"), row
        assert row["peak_rss_growth"] < 64 << 20, row  # a 1 GiB body is never materialized


def test_apply_never_modifies_the_base():
    base, patch, _ = _fuzz_cases()[0]
    snapshot = {k: v.clone() for k, v in base.items()}
    apply_patch(base, patch)
    with pytest.raises(PatchError):
        apply_patch(base, patch[:-1])
    assert bits_equal(base, snapshot)
    with pytest.raises(TargetMismatch):
        body = bytearray(body_of(patch))
        body[-1] ^= 0x01  # last value byte: structure intact, content wrong
        apply_patch(base, rewrap(bytes(body)))


@pytest.mark.parametrize("bad", [["bfloat16"], {"x": 1}, "7", None, -1, True])
@pytest.mark.parametrize("case, field", [(1, "dtype"), (1, "shape"), (0, "mode"), (0, "at"), (0, "sizes")])
def test_a_header_field_of_the_wrong_kind_is_a_patch_error(bad, case, field):
    base, patch, _ = _fuzz_cases()[case]  # 0: a delta (tensors by position), 1: an anchor (by name)

    def edit(header):
        header["tensors"][0][field] = bad

    with pytest.raises(CorruptPatch, match="malformed tensor entry"):
        apply_patch(base, with_header(patch, edit))


def test_a_patch_lists_each_changed_tensor_once_in_order():
    base, patch, _ = _fuzz_cases()[0]
    joint, *alone = read_header(patch).tensors
    assert joint["joint"] == "bfloat16" and len(alone) == 4
    orders = {
        "once each, in order": ([joint, *alone[::-1]], [joint, alone[0], *alone]),
        "joint entries come first": ([*alone, joint], [joint, joint, *alone]),
        "malformed tensor entry": ([{**joint, "at": 0}, *alone], [{**joint, "joint": "complex64"}, *alone]),
        "listed alone and in its dtype's joint entry": ([joint, {**alone[0], "at": 0}, *alone[1:]],),
        "never dense": ([{**joint, "mode": "dense", "sizes": joint["sizes"][:1]}, *alone],),
    }
    for reason, tried in orders.items():
        for tensors in tried:

            def edit(header, tensors=tensors):
                header["tensors"] = tensors

            with pytest.raises(CorruptPatch, match=reason):
                apply_patch(base, with_header(patch, edit))
    _, anchor, _ = _fuzz_cases()[1]  # an anchor has no base to join tensors of

    def join(header):
        header["tensors"][0]["joint"] = "bfloat16"

    with pytest.raises(CorruptPatch, match="malformed tensor entry"):
        apply_patch(None, with_header(anchor, join))


def test_a_shape_whose_size_overflows_is_refused_before_any_allocation():
    _, anchor, _ = _fuzz_cases()[1]

    def edit(header):  # 2**64 elements, which wrap to 0 in int64: an empty dense section "fits"
        first = header["tensors"][0]
        header["tensors"] = [{**first, "shape": [2**32, 2**32], "count": 0, "sizes": [0]}]

    with pytest.raises(CorruptPatch):
        apply_patch(None, with_header(anchor, edit))


# ------------------------------------------------------------------ the streams on their own


def test_ordered_keys_follow_the_values_and_undo_themselves():
    bits = np.arange(2**16, dtype=np.uint32).astype(np.uint16)
    values = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    keys = ordered(bits, is_float=True).astype(np.int64)
    finite = np.isfinite(values)
    order = np.argsort(keys[finite], kind="stable")
    assert np.all(np.diff(values[finite][order]) >= 0)  # sorted by key is sorted by value
    assert np.array_equal(ordered(ordered(bits, True).view(np.uint16), True).view(np.uint16), bits)


def test_a_one_ulp_step_across_zero_costs_one_bit():
    base = {"w": torch.tensor([1e-40, 0.0, -0.0, 2.0], dtype=torch.float32)}
    new = {"w": base["w"].clone()}
    new["w"].view(torch.int32)[1] = np.int32(np.uint32(0x80000000).view(np.int32))  # +0 -> -0: one ulp down
    entry = read_header(encode_patch(base, new, 0, 1)).tensors[0]
    assert (entry["mode"], entry["values_as"]) == ("sparse", "sign")
    assert bits_equal(apply_patch(base, encode_patch(base, new, 0, 1)), new)


def test_a_one_percent_one_ulp_bf16_update_costs_under_eleven_bits_a_change():
    """The size the codec exists for: uniform 1% changes of one ulp, near the entropy of their
    positions (8.1 bits) plus one direction bit."""
    g, n = np.random.default_rng(0), 2**20
    base = {"w": torch.randn(n, generator=torch.Generator().manual_seed(0)).bfloat16()}
    new = {"w": base["w"].clone()}
    idx = np.sort(g.choice(n, n // 100, replace=False))
    steps = torch.from_numpy(g.choice(np.array([-1, 1], dtype=np.int16), idx.size))
    new["w"].view(torch.int16)[torch.from_numpy(idx)] += steps
    patch = encode_patch(base, new, 0, 1)
    assert bits_equal(apply_patch(base, patch), new)
    assert 8 * len(patch) / idx.size < 11
    assert read_header(patch).tensors[0]["mode"] == "sparse"  # changes that ignore size: no near tier


def test_a_small_patch_is_mostly_header_and_the_header_dictionary_pays_for_it():
    """14 tensors with a few changes each (a top-1% upload of one block): its header words cost a
    reference to the built-in dictionary, not their letters, and it still applies exactly."""
    g = torch.Generator().manual_seed(0)
    base = {f"layer.{i}.lora_{ab}": torch.randn(8, 64, generator=g) for i in range(7) for ab in "AB"}
    new = {n: t.clone() for n, t in base.items()}
    for t in new.values():
        t.view(-1)[torch.randperm(t.numel(), generator=g)[:6]] += 1e-3
    patch = encode_patch(base, new, 3, 4)
    assert bits_equal(apply_patch(base, patch), new)
    plain = zstandard.ZstdCompressor(level=19, write_checksum=True).compress(body_of(patch))
    assert len(patch) - 13 < len(plain) - 60, (len(patch), len(plain))


# ------------------------------------------------------------------ the near tier (format 5)


def optimizer_step(n: int, step: float, seed: int = 0) -> tuple[dict, dict]:
    """bf16 casts of an fp32 master before and after a step of fixed size (Adam-like): small
    weights cross many bf16 ulps, large ones rarely one."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g) * 0.02
    return {"w": master.bfloat16()}, {"w": (master + step * torch.randn(n, generator=g).sign()).bfloat16()}


def test_an_optimizer_step_goes_tiered_and_costs_less_than_gaps_alone():
    base, new = optimizer_step(1 << 18, 3e-7)  # ~98.5% of the bf16 values unchanged
    patch = encode_patch(base, new, 0, 1)
    entry = read_header(patch).tensors[0]
    assert entry["mode"] == "tiered" and entry["below"] > 0
    assert bits_equal(apply_patch(base, patch), new)
    with mock.patch.object(fedrl.patch, "choose_near_tier", return_value=0):
        gaps_only = encode_patch(base, new, 0, 1)
    assert read_header(gaps_only).tensors[0]["mode"] == "sparse"
    assert len(patch) < 0.9 * len(gaps_only), (len(patch), len(gaps_only))


@st.composite
def tiered_case(draw):
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.float64]))
    n = draw(st.integers(1, 3000))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    master = torch.randn(n, generator=g, dtype=torch.float64) * draw(st.sampled_from([1e-4, 0.02, 1.0]))
    moved = master + draw(st.sampled_from([1e-7, 1e-4, 0.1])) * torch.randn(
        n, generator=g, dtype=torch.float64
    )
    if draw(st.booleans()):  # NaN payloads, signed zeros, infinities on either side
        specials = torch.tensor([float("nan"), -0.0, 0.0, float("inf"), -float("inf")], dtype=torch.float64)
        where = torch.rand(n, generator=g) < 0.05
        moved = torch.where(where, specials[torch.randint(0, 5, (n,), generator=g)], moved)
    base, new = {"w": master.to(dtype)}, {"w": moved.to(dtype)}
    exponent_bits = {torch.bfloat16: 8, torch.float16: 5, torch.float32: 8, torch.float64: 11}[dtype]
    return base, new, draw(st.integers(1, 2**exponent_bits - 1))


@settings(max_examples=120, deadline=None)
@given(tiered_case())
def test_any_near_tier_is_bit_identical_into_new_tensors_and_in_place(case):
    base, new, below = case
    with mock.patch.object(fedrl.patch, "choose_near_tier", return_value=below):
        patch = encode_patch(base, new, 0, 1)
    assert bits_equal(apply_patch(base, patch), new)
    entries = read_header(patch).tensors
    assert not entries or entries[0]["mode"] in ("tiered", "dense")
    storage = base["w"].data_ptr()
    out = apply_patch(base, patch, in_place=True, verify="changes")
    assert bits_equal(out, new)
    # a dense entry is a new tensor; every other form writes into the base's own storage
    assert (out["w"].data_ptr() == storage) == (not entries or entries[0]["mode"] != "dense")


def test_in_place_puts_every_change_back_when_the_patch_does_not_verify():
    base, new = optimizer_step(1 << 14, 3e-7)  # tiered: near and far scatters both happen
    base["b"], new["b"] = torch.arange(50.0), torch.arange(50.0) + (torch.arange(50) % 7 == 0)
    patch = encode_patch(base, new, 0, 1)
    assert {e["mode"] for e in read_header(patch).tensors} == {"tiered", "sparse"}
    snapshot = {k: v.clone() for k, v in base.items()}
    wrong = {k: v.clone() for k, v in base.items()}
    wrong["b"][-2] += 1  # a value the patch leaves: every scatter lands, then the hash refuses
    held = {k: v.clone() for k, v in wrong.items()}
    with pytest.raises(TargetMismatch):
        apply_patch(wrong, patch, base_hash=state_hash(base), in_place=True)
    assert bits_equal(wrong, held)
    body = bytearray(body_of(patch))
    body[-1] ^= 0x01  # the last tensor's values: the first tensor is already written when it fails
    with pytest.raises(PatchError):
        apply_patch(base, rewrap(bytes(body)), in_place=True)
    assert bits_equal(base, snapshot)
    assert bits_equal(apply_patch(base, patch, in_place=True), new)


def tiered_patch(base: torch.Tensor, below: int, near_flags: bytes, far: list[int], count: int) -> bytes:
    """A hand-made tiered patch of one bf16 tensor of positive values: every change one ulp down."""
    index, width, escapes = encode_indices(np.array(far, dtype=np.int64))
    near_changes = count - len(far)
    sections = [
        near_flags,
        index,
        escapes,
        bytes((len(far) + 7) // 8),  # far direction bits: all down
        b"",
        bytes((max(near_changes, 0) + 7) // 8),  # near direction bits: all down
        b"",
    ]
    entry = {
        "at": 0,
        "mode": "tiered",
        "count": count,
        "below": below,
        "index_width": width,
        "values_as": "sign",
        "value_width": "bit",
        "near_as": "sign",
        "near_width": "bit",
        "sizes": [len(s) for s in sections],
    }
    down = base.clone()
    bits = down.view(torch.int16)
    bits[far] -= 1
    near = [i for i in range(base.numel()) if abs(float(base[i])) < 2.0 ** (below - 127)]
    flagged = np.unpackbits(np.frombuffer(near_flags, np.uint8), bitorder="little")[: len(near)]
    near_changed = [i for i, f in zip(near, flagged) if f]  # one exponent: the tier's order is by position
    bits[near_changed] -= 1
    written = to_bits(down)
    far_at, near_at = np.array(far, dtype=np.int64), np.array(near_changed, dtype=np.int64)
    header = {
        "format": FORMAT_VERSION,
        "base_version": 0,
        "base_hash": state_hash({"w": base}),
        "target_version": 1,
        "target_hash": state_hash({"w": down}),
        "changes_hash": changes_hash([far_at, written[far_at], near_at, written[near_at]]),
        "tensors": [entry],
    }
    raw = json.dumps(header).encode()
    return rewrap(struct.pack("<I", len(raw)) + raw + b"".join(sections)), down


def test_the_changes_hash_is_blake3_of_each_array_after_its_length_whatever_their_sizes():
    rng = np.random.default_rng(0)
    arrays = [  # around the size where arrays stop being joined, and empty ones
        rng.integers(0, 2**16, n, dtype=np.uint16) for n in (0, 3, 32767, 32768, 32769, 100_000, 5, 0)
    ] + [np.arange(9000, dtype=np.int64)]
    for order in (arrays, arrays[::-1], arrays[3:6]):
        reference = blake3.blake3(b"".join(struct.pack("<Q", a.nbytes) + a.tobytes() for a in order))
        assert changes_hash(order) == reference.hexdigest(length=16)


def test_checking_the_changes_hashes_no_whole_tensor_and_refuses_a_base_wrong_where_it_writes():
    base, new = optimizer_step(1 << 14, 3e-7)
    base["x"], new["x"] = torch.arange(6.0), torch.arange(6.0)  # unchanged: not listed
    new["x"][5] = 7.0
    held = state_hash(base)
    patch = encode_patch(base, new, 0, 1, base_hash=held)
    with mock.patch.object(fedrl.patch, "tensor_digest", wraps=fedrl.patch.tensor_digest) as digests:
        assert bits_equal(apply_patch(base, patch, base_hash=held, verify="changes"), new)
        assert digests.call_count == 0
        assert bits_equal(apply_patch(base, patch, base_hash=held), new)
        assert digests.call_count == len(new)  # "state": every tensor
    bits = to_bits(base["w"])
    moved = int(np.flatnonzero(bits != to_bits(new["w"]))[0])
    for where, caught in ((moved, True), (int(np.flatnonzero(bits == to_bits(new["w"]))[0]), False)):
        wrong = {k: v.clone() for k, v in base.items()}
        wrong["w"].view(torch.int16)[where] += 3
        if caught:  # new values travel relative to the base's: a wrong old value gives a wrong new one
            snapshot = {k: v.clone() for k, v in wrong.items()}
            with pytest.raises(TargetMismatch, match="decoded changes"):
                apply_patch(wrong, patch, base_hash=held, verify="changes", in_place=True)
            assert bits_equal(wrong, snapshot)  # every change put back
        else:  # vouching for a base means this: a wrong value the patch does not touch stays
            out = apply_patch(wrong, patch, base_hash=held, verify="changes")
            assert to_bits(out["w"])[where] != to_bits(new["w"])[where]
            with pytest.raises(TargetMismatch, match="reconstructed state"):
                apply_patch(wrong, patch, base_hash=held)  # the whole-state check sees it
    with pytest.raises(ValueError, match="verify"):
        apply_patch(base, patch, verify="nothing")


def test_an_anchor_is_hashed_whole_whatever_the_check():
    _, new = optimizer_step(1 << 10, 3e-7)
    anchor = encode_patch(None, new, None, 1)
    assert read_header(anchor).changes_hash is None
    lying = with_header(anchor, lambda h: h.update(target_hash="0" * 64))
    with pytest.raises(TargetMismatch, match="reconstructed state"):
        apply_patch(None, lying, verify="changes")
    with pytest.raises(CorruptPatch, match="header fields"):  # only a delta names its changes
        apply_patch(None, with_header(anchor, lambda h: h.update(changes_hash="0" * 32)))


def test_a_hand_made_tiered_patch_applies_and_each_inconsistency_is_refused():
    # values 0-4 are under 2^-10 (exponent field < 117): the near tier, 5 flag bits; 5-15 are far
    base = torch.tensor([1e-4] * 5 + [0.5] * 11, dtype=torch.bfloat16)
    patch, target = tiered_patch(base, 117, bytes([0b00101]), [9, 12], 4)
    assert bits_equal(apply_patch({"w": base}, patch), {"w": target})  # the hand-made form is right
    refused = {
        "lies in the near tier": tiered_patch(base, 117, bytes([0b00101]), [3, 12], 4),
        "flag bytes": tiered_patch(base, 117, bytes([0b00101, 0]), [9, 12], 4),
        "flag bits set past": tiered_patch(base, 117, bytes([0b10000101]), [9, 12], 4),
        "near changes, header says": tiered_patch(base, 117, bytes([0b11111]), [9], 4),
    }
    for reason, (bad, _) in refused.items():
        with pytest.raises(CorruptPatch, match=reason):
            apply_patch({"w": base}, bad)

    # the near tier's stream is read after the far changes were written: those are put back too
    def near_stream(kind: str, width: str, data: bytes):
        def edit(header, sections):
            header["tensors"][0].update(near_as=kind, near_width=width)
            sections[5] = data

        return edit

    late = {
        "w: sign bits for 2 values need 1 bytes, got 0": near_stream("sign", "bit", b""),
        # two uint8 distances, the second escaped, and no escape to take
        "w: escape list does not match the escaped values": near_stream("delta", "uint8", bytes([1, 255])),
    }
    for reason, edit in late.items():
        held = {"w": base.clone()}
        with pytest.raises(CorruptPatch, match=re.escape(reason)):
            apply_patch(held, with_sections(patch, edit), in_place=True, verify="changes")
        assert bits_equal(held, {"w": base})


def with_sections(patch: bytes, edit) -> bytes:
    """The patch with `edit(header, sections)` applied to its header and its list of sections."""
    body = body_of(patch)
    (hlen,) = struct.unpack_from("<I", body)
    header, at, sections = json.loads(body[4 : 4 + hlen]), 4 + hlen, []
    for size in (size for e in header["tensors"] for size in e["sizes"]):
        sections.append(body[at : at + size])
        at += size
    edit(header, sections)
    for e, start in zip(header["tensors"], np.cumsum([0] + [len(e["sizes"]) for e in header["tensors"]])):
        e["sizes"] = [len(x) for x in sections[start : start + len(e["sizes"])]]
    raw = json.dumps(header).encode()
    return rewrap(struct.pack("<I", len(raw)) + raw + b"".join(sections))


def test_a_value_stream_that_does_not_fit_its_header_is_refused_by_name():
    base = {"w": torch.ones(4096, dtype=torch.bfloat16)}
    new = {"w": base["w"].clone()}
    steps = new["w"].view(torch.int16)
    steps[[10, 700, 3000]] += 1
    steps[50] -= 1
    steps[2000] += 300  # escapes uint8's distances
    patch = encode_patch(base, new, 0, 1)
    entry = read_header(patch).tensors[0]
    assert (entry["mode"], entry["values_as"], entry["value_width"]) == ("sparse", "delta", "uint8")

    def entry_says(**fields):
        return lambda header, sections: header["tensors"][0].update(fields)

    def escapes(data):
        return lambda header, sections: sections.__setitem__(3, data)

    refused = {
        "w: escape list does not match the escaped values": [escapes(b""), escapes(bytes(4))],
        "sign bits for 5 values need 1 bytes, got 5": [entry_says(values_as="sign", value_width="bit")],
        "raw values are uint8, the tensor's bits are uint16": [entry_says(values_as="raw")],
        "delta values are uint16, not a width narrower than uint16": [entry_says(value_width="uint16")],
        "value section holds 4 uint8, header says 5": [
            lambda header, sections: sections.__setitem__(2, sections[2][:4])
        ],
    }
    snapshot = {"w": base["w"].clone()}
    for reason, edits in refused.items():
        for edit in edits:
            for in_place in (False, True):
                with pytest.raises(CorruptPatch, match=re.escape(reason)):
                    apply_patch(base, with_sections(patch, edit), in_place=in_place)
                assert bits_equal(base, snapshot)  # a stream refused halfway is put back
    assert bits_equal(apply_patch(base, with_sections(patch, lambda header, sections: None)), new)


def test_a_near_tier_is_only_for_floats_and_their_own_exponents():
    base, new = optimizer_step(1 << 16, 3e-7)
    patch = encode_patch(base, new, 0, 1)
    assert read_header(patch).tensors[0]["mode"] == "tiered"

    def edit(header):
        header["tensors"][0]["below"] = 256  # bfloat16's exponent field stops at 255

    with pytest.raises(CorruptPatch, match="no exponent 256"):
        apply_patch(base, with_header(patch, edit))
    as_ints = {"w": base["w"].view(torch.int16)}
    with pytest.raises(CorruptPatch, match="int16 tensor has no exponent"):
        apply_patch(as_ints, patch, base_hash=read_header(patch).base_hash)


# ------------------------------------------------------------------ Rice-coded gaps (format 6)


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(0, 2**20), max_size=300), st.integers(0, 14), st.integers(1, 2**10))
def test_rice_coded_gaps_round_trip(positions, k, room):
    idx = np.array(sorted(positions), dtype=np.int64)
    numel = int(idx[-1]) + room if idx.size else room
    data = rice_encode(np.diff(idx, prepend=0).astype(np.uint64), k)
    assert np.array_equal(decode_indices(data, f"rice{k}", b"", idx.size, numel), idx)


def test_gaps_spread_like_a_far_tier_are_rice_coded_and_clustered_ones_are_not():
    rng, n = np.random.default_rng(0), 1 << 22
    spread = np.sort(rng.choice(n, n // 300, replace=False))
    data, form, escapes = encode_indices(spread)
    assert form.startswith("rice") and escapes == b""
    assert np.array_equal(decode_indices(data, form, escapes, spread.size, n), spread)
    as_widths = shuffle_bytes(np.diff(spread, prepend=0).astype(np.uint16))
    level1 = zstandard.ZstdCompressor(level=1)
    assert len(level1.compress(data)) < 0.95 * len(level1.compress(as_widths))
    _, form, _ = encode_indices(np.arange(0, n, 7))  # a regular stride: zstd's matches win
    assert form == "uint8"


def test_a_malformed_rice_stream_is_refused_by_name():
    rng, n = np.random.default_rng(1), 1 << 16
    idx = np.sort(rng.choice(n, 500, replace=False))
    gaps = np.diff(idx, prepend=0).astype(np.uint64)
    k = 5  # 500 * 5 bits of low bits: the last byte has 4 bits of padding
    data = rice_encode(gaps, k)
    padded = bytearray(data)
    padded[-1] |= 0x80
    refused = {
        r"Rice quotients hold \d+ gaps or stray bits, header says 501": (data, 501, n, b""),
        "stray bits": (data[:3] + b"\xff" + data[4:], 500, n, b""),
        "low bits set past": (bytes(padded), 500, n, b""),
        "have no escapes": (data, 500, n, bytes(8)),
        "longer than the tensor allows": (data, 500, 1000, b""),
        "shorter than its": (data[:10], 500, n, b""),
        "out of range or not strictly increasing": (data, 500, int(idx[-1]), b""),
    }
    for reason, (bad, count, numel, escapes) in refused.items():
        with pytest.raises(CorruptPatch, match=reason):
            decode_indices(bad, f"rice{k}", escapes, count, numel)
    assert np.array_equal(decode_indices(data, f"rice{k}", b"", 500, n), idx)


def test_malformed_gaps_in_byte_planes_are_refused_by_name():
    n, idx = 1 << 20, np.append(np.arange(1, 21), 300_000)  # small gaps, and one that escapes uint8
    data, width, escapes = encode_indices(idx)
    assert width == "uint8" and escapes
    c = idx.size
    refused = {
        "escape list does not match the escaped gaps": [(data, escapes + bytes(8), c, n), (data, b"", c, n)],
        "index gap beyond the tensor": [(data, struct.pack("<Q", n + 1), c, n)],
        "out of range or not strictly increasing": [(data, escapes, c, int(idx[-1]))],
        "index section holds": [(data[:-1], escapes, c, n), (data, escapes, c + 1, n)],
    }
    repeated = shuffle_bytes(np.array([3, 0, 5], np.dtype(width)))
    refused["out of range or not strictly increasing"].append((repeated, b"", 3, n))
    for reason, inputs in refused.items():
        for bad, bad_escapes, count, numel in inputs:
            with pytest.raises(CorruptPatch, match=reason):
                decode_indices(bad, width, bad_escapes, count, numel)
    assert np.array_equal(decode_indices(data, width, escapes, c, n), idx)
    wide = shuffle_bytes(np.array([3, n], np.uint64))  # 8-byte gaps have no escapes: checked as they are
    with pytest.raises(CorruptPatch, match="index gap beyond the tensor"):
        decode_indices(wide, "uint64", b"", 2, n - 1)


@pytest.mark.parametrize("step", [1e-4, 1e-3])
def test_tiers_and_rice_codes_never_cost_a_small_adapter_version_bytes(step):
    """The tiny model's LoRA versions (512 values a tensor, bf16): the new forms must not be
    taken where they cost more. Rice codes allowed from 64 gaps made these 6% larger: a sample
    compressed alone overcharged zstd, which in the patch's frame shares its tables."""
    g = torch.Generator().manual_seed(0)
    base = {f"l{i}.lora_{ab}": torch.randn(8, 64, generator=g) * 0.05 for i in range(21) for ab in "AB"}
    new = {n: (t + step * torch.randn(t.shape, generator=g)).bfloat16() for n, t in base.items()}
    base = {n: t.bfloat16() for n, t in base.items()}
    patch = encode_patch(base, new, 3, 4)
    with (
        mock.patch.object(fedrl.patch, "RICE_MIN_GAPS", 1 << 62),
        mock.patch.object(fedrl.patch, "choose_near_tier", return_value=0),
    ):
        plain = encode_patch(base, new, 3, 4)
    assert len(patch) <= len(plain), (len(patch), len(plain))
    assert bits_equal(apply_patch(base, patch), new)
