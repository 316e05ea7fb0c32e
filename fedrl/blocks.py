"""The block partition of a LoRA adapter: groups of consecutive transformer layers.

Block-coordinate rounds train one block at a time, exchange one block's tensors, and
aggregate per block. Names are the adapter's parameter names as `named_parameters` gives them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

_LAYER = re.compile(r"\.(?:layers|h|blocks|layer|decoder_layers)\.(\d+)\.")


def lora_parameter_names(model) -> list[str]:
    return [name for name, _ in model.named_parameters() if "lora_" in name]


def layer_index(name: str) -> int:
    match = _LAYER.search(name)
    return int(match.group(1)) if match else 0  # modules outside the layer stack join block 0


ALL_BLOCKS = -1


def adapter_difference(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> str:
    """The first way `got` is not `expected`'s tensors (a name, a shape or a dtype), in words; ""
    when it is: what makes a checkpoint or an upload belong to another adapter."""
    unmatched = sorted(set(got) ^ set(expected))
    if unmatched:
        return f"{unmatched[0]} is {'not expected' if unmatched[0] in got else 'missing'}"
    for name in sorted(expected):
        g, e = got[name], expected[name]
        if g.shape != e.shape or g.dtype != e.dtype:
            return f"{name} has shape {tuple(g.shape)} and {g.dtype}, expected {tuple(e.shape)} and {e.dtype}"
    return ""


class BlockPartition:
    """Split the LoRA parameters of `model` into `num_blocks` groups of consecutive layers."""

    def __init__(self, model, num_blocks: int):
        names = lora_parameter_names(model)
        if not names:
            raise ValueError("the model has no LoRA parameters; wrap it with fedrl.lora.add_lora first")
        num_layers = max(layer_index(n) for n in names) + 1
        if not 1 <= num_blocks <= num_layers:
            raise ValueError(
                f"num_blocks must be in [1, {num_layers}] (a block has at least one layer), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.blocks: list[list[str]] = [[] for _ in range(num_blocks)]
        for name in names:
            self.blocks[layer_index(name) * num_blocks // num_layers].append(name)
        self._block_of = {n: b for b, group in enumerate(self.blocks) for n in group}

    def names(self, block: int) -> list[str]:
        """The block's parameter names; ALL_BLOCKS: the whole adapter (fedavg-lora)."""
        if block == ALL_BLOCKS:
            return [n for group in self.blocks for n in group]
        self._check(block)
        return list(self.blocks[block])

    def block_of(self, name: str) -> int:
        return self._block_of[name]

    def get(self, model, block: int) -> dict[str, torch.Tensor]:
        """Detached copies of one block's tensors."""
        params = dict(model.named_parameters())
        return {n: params[n].detach().clone() for n in self.names(block)}

    def get_all(self, model) -> dict[str, torch.Tensor]:
        params = dict(model.named_parameters())
        return {n: params[n].detach().clone() for n in self._block_of}

    def set(self, model, block: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Write one block; refuses missing, extra or mis-shaped tensors before changing anything."""
        expected = set(self.names(block))
        if set(tensors) != expected:
            missing, extra = sorted(expected - set(tensors)), sorted(set(tensors) - expected)
            raise ValueError(
                f"block {block} tensors do not match: missing {missing[:3]}, unexpected {extra[:3]}"
            )
        self._assign(model, tensors)

    def set_all(self, model, tensors: Mapping[str, torch.Tensor]) -> None:
        unknown = sorted(set(tensors) - set(self._block_of))
        if unknown:
            raise ValueError(f"not LoRA parameters of this partition: {unknown[:3]}")
        self._assign(model, tensors)

    def make_trainable(self, model, block: int) -> list[torch.nn.Parameter]:
        """Exactly block `block` (or ALL_BLOCKS) requires grad; every other parameter is frozen."""
        keep = set(self.names(block))
        trainable = []
        for name, param in model.named_parameters():
            param.requires_grad_(name in keep)
            if name in keep:
                trainable.append(param)
        return trainable

    def _assign(self, model, tensors: Mapping[str, torch.Tensor]) -> None:
        params = dict(model.named_parameters())
        for name, value in tensors.items():
            if tuple(value.shape) != tuple(params[name].shape):
                raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(params[name].shape)}")
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value)

    def _check(self, block: int) -> None:
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"block must be in [0, {self.num_blocks}), got {block}")
