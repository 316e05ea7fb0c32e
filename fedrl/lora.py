"""LoRA adapters through peft, with target modules chosen per architecture."""

from __future__ import annotations

from dataclasses import dataclass

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
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, config)
