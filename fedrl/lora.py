"""LoRA adapters through peft, with target modules chosen per architecture."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from fedrl.blocks import BlockPartition
from fedrl.models import LoadedModel, load_model

# Linear layers worth adapting, by `config.model_type`.
TARGET_MODULES = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gemma": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "gpt_neox": ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"],
    "opt": ["q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"],
    "fedrl-tiny-gpt": ["qkv", "out", "ff_up", "ff_down"],
}


@dataclass(frozen=True)
class LoraSettings:
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: tuple[str, ...] | None = None  # None: chosen from the architecture


def target_modules_for(model) -> list[str]:
    model_type = getattr(model.config, "model_type", None)
    if model_type not in TARGET_MODULES:
        raise ValueError(
            f"no default LoRA targets for model_type {model_type!r}; pass LoraSettings(target_modules=...)"
        )
    return TARGET_MODULES[model_type]


def add_lora(model, settings: LoraSettings = LoraSettings(), seed: int = 0):
    """Wrap `model` in a peft LoRA adapter named 'default'; the same seed gives the same A matrices."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules or target_modules_for(model)),
        bias="none",
        task_type="CAUSAL_LM",
    )
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads transformers' deprecated `is_gradient_checkpointing` itself: nothing a user can act on
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        torch.manual_seed(seed)
        return get_peft_model(model, config)


@dataclass
class AdapterModel:
    """A base model with a LoRA adapter, its block partition and the adapter's initial values."""

    lm: LoadedModel  # .model is the PeftModel
    part: BlockPartition
    initial: dict  # name -> tensor, the freshly initialized adapter


def build_adapter_model(spec: str, rank: int, alpha: float, num_blocks: int, seed: int = 0) -> AdapterModel:
    """Load `spec` and add a LoRA adapter split into `num_blocks` blocks: a fresh instance
    owned by the caller (the coordinator keeps its own; clients share one per process)."""
    lm = load_model(spec)
    lm.model = add_lora(lm.model, LoraSettings(rank=rank, alpha=alpha), seed=seed)
    part = BlockPartition(lm.model, num_blocks)
    return AdapterModel(lm, part, {n: t.clone() for n, t in part.get_all(lm.model).items()})
