"""The client process's models: each (model, LoRA settings) built once and reused by every
message this process serves. Every message sets the weights it needs before using the
model, so messages of different nodes can share one instance. The ClientApp owns the cache."""

from __future__ import annotations

from collections import OrderedDict

from fedrl.lora import AdapterModel, build_adapter_model


class ModelCache:
    def __init__(self, size: int = 2):
        self.size = size
        self._models: OrderedDict[tuple, AdapterModel] = OrderedDict()

    def get(self, model: str, rank: int, alpha: float, num_blocks: int) -> AdapterModel:
        key = (model, rank, alpha, num_blocks)
        if key not in self._models:
            self._models[key] = build_adapter_model(model, rank, alpha, num_blocks)
            while len(self._models) > self.size:
                self._models.popitem(last=False)
        self._models.move_to_end(key)
        return self._models[key]
