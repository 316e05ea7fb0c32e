"""Uploads with error feedback: send the largest entries of a delta in the wire dtype, keep the rest.

A client adds what it did not send last time (its residual) to this round's delta, sends the
`density` fraction of entries largest in magnitude (all of them at density 1), rounded to the
dtype it holds the global values in, and keeps the remainder, rounding included, for the next
time it trains those tensors. What it uploads is still an exact patch: the coordinator applies
exactly the delta the patch says, and nothing is lost, only delayed (Stich et al. 2018,
"Sparsified SGD with memory"; the same error feedback DGC and PowerSGD use).
"""

from __future__ import annotations

import math

import torch

Tensors = dict[str, torch.Tensor]


def top_k_with_feedback(
    base: Tensors, new: Tensors, residual: Tensors, density: float
) -> tuple[Tensors, Tensors]:
    """(values to upload, residual to keep) for values `new` trained from `base`.

    The upload is in base's dtype (the wire dtype the client holds the global values in) and
    equals `base` except at the largest ceil(density * entries) entries of
    delta = new - base + residual (exactly that many, however many tie at the smallest of them;
    every entry at density 1), where it is base + delta rounded to that dtype. The new residual
    is exactly delta minus what was sent, rounding included, so upload - base + new_residual ==
    delta: a bfloat16 upload loses nothing, and its values are a few ulps from the base's where
    float32 values would differ in every bit."""
    delta = {n: new[n] - base[n] + residual.get(n, torch.zeros_like(new[n])) for n in new}
    entries = sum(d.numel() for d in delta.values())
    k = max(1, math.ceil(density * entries))
    chosen = None  # every entry goes (rounded) when k is all of them: no ranking to do
    if k < entries:
        magnitudes = torch.cat([d.abs().reshape(-1) for d in delta.values()])
        flat = torch.zeros(entries, dtype=torch.bool)
        flat[torch.topk(magnitudes, k, sorted=False).indices] = True  # k of them, ties or not
        chosen = dict(zip(delta, torch.split(flat, [d.numel() for d in delta.values()])))
    upload, kept = {}, dict(residual)
    for n, d in delta.items():
        sent = (base[n] + d).to(base[n].dtype)
        upload[n] = sent if chosen is None else torch.where(chosen[n].view(d.shape), sent, base[n])
        kept[n] = d - (upload[n].to(d.dtype) - base[n].to(d.dtype))  # what was sent, rounding included
    return upload, kept
