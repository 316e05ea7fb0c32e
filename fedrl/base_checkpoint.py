"""The tiny models' base checkpoints: fedrl's own short supervised pretraining.

An easier variant of token reversal, trained with cross-entropy for a fixed budget, gives a
model that only partly solves the RL task: RL has something real to improve.
- `tiny-base` (the Llama, rotary positions): prompts of 2..7 symbols; it reverses short strings
  and partly generalises to the RL task's longer ones.
- `tiny-gpt-base` (learned positions): a position it never saw keeps its random embedding, and a
  LoRA adapter cannot change embeddings; so it sees every length up to 8, for a shorter budget.
Deterministic from the recipe (seeded, single-threaded), built once and cached.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from fedrl.models import TINY_MODELS, LoadedModel, cache_dir, publish_dir


@dataclass(frozen=True)
class BaseRecipe:
    model: str = "tiny"  # which of fedrl.models.TINY_MODELS
    seed: int = 0
    min_length: int = 2
    max_length: int = 7
    num_symbols: int = 2
    steps: int = 400
    batch_size: int = 64
    lr: float = 3e-3

    def digest(self) -> str:
        """Names the cached checkpoint: changes with the recipe and with the tiny architecture."""
        arch = TINY_MODELS[self.model](self.seed).model.config.to_json_string(use_diff=False)
        return hashlib.sha256((json.dumps(asdict(self), sort_keys=True) + arch).encode()).hexdigest()[:12]


def supervised_batch(
    recipe: BaseRecipe, rng: np.random.Generator, tokenizer
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded <bos> x <sep> reverse(x) <eos> rows; loss only on the answer and <eos>."""
    rows, prompt_lens = [], []
    for _ in range(recipe.batch_size):
        length = int(rng.integers(recipe.min_length, recipe.max_length + 1))
        text = "".join(str(s) for s in rng.integers(0, recipe.num_symbols, size=length))
        prompt = tokenizer.encode_prompt(text)
        rows.append(prompt + tokenizer.encode(text[::-1]) + [tokenizer.eos_token_id])
        prompt_lens.append(len(prompt))
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, (row, plen) in enumerate(zip(rows, prompt_lens)):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        loss_mask[i, plen : len(row)] = 1
    return ids, mask, loss_mask


def pretrain(recipe: BaseRecipe = BaseRecipe()) -> LoadedModel:
    lm = TINY_MODELS[recipe.model](seed=recipe.seed)
    model = lm.model.train()
    rng = np.random.default_rng(recipe.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: bit-reproducible from the seed
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=0.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))
            for _ in range(recipe.steps):
                ids, mask, loss_mask = supervised_batch(recipe, rng, lm.tokenizer)
                logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
                nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
                loss = (nll * loss_mask[:, 1:]).sum() / loss_mask[:, 1:].sum()
                opt.zero_grad()
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                sched.step()
    finally:
        torch.set_num_threads(threads)
    lm.model = model.eval()
    lm.spec = f"{recipe.model}-base"
    return lm


BASES = {
    "tiny-base": BaseRecipe(),
    "tiny-gpt-base": BaseRecipe(model="tiny-gpt", max_length=8, steps=100),
}


def base_dir(recipe: BaseRecipe) -> Path:
    """The cached base checkpoint for `recipe`, pretrained on first use (seconds)."""

    def build(tmp: Path) -> None:
        pretrain(recipe).save(tmp)
        (tmp / "fedrl_recipe.json").write_text(json.dumps(asdict(recipe), indent=1))

    return publish_dir(build, cache_dir() / f"{recipe.model}-base-{recipe.digest()}")
