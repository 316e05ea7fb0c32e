"""The KV cache of a causal LM's forward, under the name the installed transformers gives it."""

from __future__ import annotations

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

# transformers 5 calls it `cache` and deprecates `past_key_values` (removed in 5.40); 4.x knows
# only `past_key_values`. Every forward in fedrl passes and reads it by this one name, so no
# version sees a deprecated argument or, worse, a cache it silently drops.
CACHE = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"


def cache_of(output):
    """The KV cache a forward with `use_cache=True` returned."""
    return getattr(output, CACHE)


def select_rows(past, index: torch.Tensor):
    """Row i of the result is row index[i] of a KV cache: a tuple of (k, v) per layer, or a
    transformers Cache (changed in place)."""
    if hasattr(past, "batch_select_indices"):
        past.batch_select_indices(index)
        return past
    return tuple(tuple(t.index_select(0, index) for t in layer) for layer in past)
