"""A tiny GPT for the friction benchmarks, in the style of the DG papers' Flax transformer.

Pre-LN blocks (LayerNorm without bias, causal multi-head attention, ReLU feed-forward),
learned absolute position embeddings, no final norm, no biases, LeCun-normal init. On token
reversal from scratch this learns about 3x faster than the rotary-position Llama tiny model,
which is why `fedrl bench dg` uses it. It is a `transformers` model (config, save/load, peft
LoRA) with a plain tuple-of-tensors KV cache, so sampling pays for few Python calls.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from fedrl.kv_cache import CACHE

MODEL_TYPE = "fedrl-tiny-gpt"


class TinyGPTConfig(PretrainedConfig):
    model_type = MODEL_TYPE

    def __init__(
        self,
        vocab_size: int = 16,
        max_positions: int = 32,
        hidden_size: int = 64,
        num_heads: int = 4,
        num_layers: int = 3,
        ff_dim: int = 128,
        **kwargs,
    ):
        if hidden_size % num_heads:
            raise ValueError(f"hidden_size {hidden_size} is not a multiple of num_heads {num_heads}")
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.ff_dim = ff_dim
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)


class Block(nn.Module):
    def __init__(self, config: TinyGPTConfig):
        super().__init__()
        d = config.hidden_size
        self.heads = config.num_heads
        self.ln_attn = nn.LayerNorm(d, bias=False)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.ln_ff = nn.LayerNorm(d, bias=False)
        self.ff_up = nn.Linear(d, config.ff_dim, bias=False)
        self.ff_down = nn.Linear(config.ff_dim, d, bias=False)

    def forward(self, x, mask, cache):
        batch, width, d = x.shape
        q, k, v = (
            t.view(batch, width, self.heads, d // self.heads).transpose(1, 2)
            for t in self.qkv(self.ln_attn(x)).split(d, dim=-1)
        )
        if cache is not None:
            k, v = torch.cat([cache[0], k], 2), torch.cat([cache[1], v], 2)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(h.transpose(1, 2).reshape(batch, width, d))
        x = x + self.ff_down(F.relu(self.ff_up(self.ln_ff(x))))
        return x, (k, v)


class TinyGPT(PreTrainedModel, GenerationMixin):  # GenerationMixin: peft's causal-LM wrapper expects it
    config_class = TinyGPTConfig
    base_model_prefix = "gpt"
    main_input_name = "input_ids"

    def __init__(self, config: TinyGPTConfig):
        super().__init__(config)
        self.token_emb = nn.Embedding(config.vocab_size, config.hidden_size)
        self.pos_emb = nn.Embedding(config.max_positions, config.hidden_size)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def _init_weights(self, module):
        # LeCun-normal (truncated, as Flax's lecun_normal): std 1/sqrt(fan_in); embeddings 1/sqrt(d).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            fan_in = module.weight.shape[1]
            std = 1 / math.sqrt(fan_in) / 0.87962566103423978
            nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self):
        return self.token_emb

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        use_cache: bool = False,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """`attention_mask` covers the cached and the new tokens (B, past + T), as in transformers;
        `logits_to_keep` > 0 projects only the last that many positions to the vocabulary. The
        KV cache goes out under the installed transformers' name for it (`kv_cache.CACHE`) and is
        taken under either name, so no caller's cache is silently dropped."""
        cached = kwargs.get("cache")
        if cached is None:
            cached = kwargs.get("past_key_values")
        batch, width = input_ids.shape
        past = 0 if cached is None else cached[0][0].shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(batch, past + width, dtype=torch.long)
        if position_ids is None:
            position_ids = torch.arange(past, past + width).expand(batch, width)
        if int(position_ids.max()) >= self.config.max_positions:
            raise ValueError(
                f"position {int(position_ids.max())} is beyond this model's {self.config.max_positions} "
                "learned positions: use shorter sequences or a model built with more max_positions"
            )
        keys = attention_mask.bool()
        # Query i sees real keys up to its own column; it always sees itself, so a pad query's row
        # is never all -inf (its output is discarded anyway).
        causal = torch.ones(width, past + width, dtype=torch.bool).tril(past)
        self_col = torch.zeros(width, past + width, dtype=torch.bool)
        self_col[:, past:] = torch.eye(width, dtype=torch.bool)
        mask = (keys[:, None, None, :] & causal) | self_col
        x = (self.token_emb(input_ids) + self.pos_emb(position_ids)) * keys[:, -width:, None]
        cache = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, mask, None if cached is None else cached[i])
            cache.append(kv)
        return CausalLMOutputWithPast(
            logits=self.output(x[:, -logits_to_keep:] if logits_to_keep else x),
            **{CACHE: tuple(cache) if use_cache else None},
        )


AutoConfig.register(MODEL_TYPE, TinyGPTConfig)
AutoModelForCausalLM.register(TinyGPTConfig, TinyGPT)
