"""Byzantine clients of a simulation: what a dishonest client uploads instead of its update.

Each attack turns the honest new values of a block (`new`, trained from `base`) into what the
client hands in; the patch it uploads is still valid and exact, so only the coordinator's
checks and aggregation stand between it and the global model.
"""

from __future__ import annotations

import torch

ATTACKS = ("", "scale", "flip", "flip-x3", "ascent", "random", "nan", "stale-base")
SCALE = 100.0
IN_BOUND = 3.0  # the default clip multiple: an attacker who knows the rules stays inside it


def poison(
    kind: str,
    base: dict[str, torch.Tensor],
    new: dict[str, torch.Tensor],
    seed: int,
    first: dict[str, torch.Tensor] | None = None,
) -> dict:
    """`scale`: the update x100; `flip`: x-100; `flip-x3`: x-3 (inside the norm refusal, at the
    clip's bound: what a flipper who knows the rules sends); `ascent`: the update reversed at its
    own size (as if trained to raise the error: no norm check can tell); `random`: noise 100x
    the update's norm; `nan`: NaN in every value; `stale-base`: a liar about its base, who never
    synced after version 0 (`first`: the block's values then) and hands in its update on those
    values as if made on the version it was sent: measured against the real base, the upload
    rolls the block back by everything merged since, plus the update."""
    if kind not in ATTACKS:
        raise ValueError(f"unknown attack {kind!r}; known: {ATTACKS[1:]}")
    if not kind:
        return new
    if kind == "stale-base":
        if first is None:
            raise ValueError("the stale-base attack needs the block's values at version 0")
        return {n: (first[n].float() + new[n].float() - base[n].float()).to(v.dtype) for n, v in new.items()}
    factor = {"scale": SCALE, "flip": -SCALE, "flip-x3": -IN_BOUND, "ascent": -1.0}.get(kind)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, value in new.items():
        b, delta = base[name].float(), value.float() - base[name].float()
        if factor is not None:
            poisoned = b + factor * delta
        elif kind == "random":
            noise = torch.randn(delta.shape, generator=g)
            poisoned = b + noise * (SCALE * delta.norm() / noise.norm().clamp_min(1e-12))
        else:
            poisoned = b + delta * float("nan")
        out[name] = poisoned.to(value.dtype)
    return out
