"""The local learner: one optimizer step of a policy-gradient loss on the trainable parameters.

Hyperparameters live in `LearnerConfig`; the loss is picked by name from fedrl.losses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fedrl.losses import LOSSES, PGBatch
from fedrl.rollout import Rollouts, token_logprobs


@dataclass(frozen=True)
class LearnerConfig:
    method: str = "dg"  # dg, reinforce, iw_pg, ppo, decoupled_ppo
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0
    loss_params: dict = field(default_factory=dict)  # e.g. {"eta": 1.0}, {"eps": 0.2}, {"cap": 5.0}

    def __post_init__(self):
        if self.method not in LOSSES:
            raise ValueError(f"unknown method {self.method!r}; known: {sorted(LOSSES)}")


class Learner:
    """Adam on `params` (a LoRA block, or a whole small model), with gradient clipping."""

    def __init__(self, params: list[torch.nn.Parameter], config: LearnerConfig = LearnerConfig()):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("the learner has no trainable parameters")
        self.config = config
        self.loss_fn = LOSSES[config.method]
        self.optimizer = torch.optim.Adam(self.params, lr=config.lr, betas=config.betas)
        self.steps = 0

    def update(self, batch: PGBatch) -> dict:
        loss, metrics = self.loss_fn(batch, **self.config.loss_params)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite {self.config.method} loss {loss.item()}; update skipped")
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.steps += 1
        mask = batch.mask.bool()
        surprisal = -batch.logp.detach()[mask]
        return {
            "loss": loss.item(),
            "reward": batch.rewards.float().mean().item(),
            "surprisal_mean": surprisal.mean().item() if surprisal.numel() else 0.0,
            "surprisal_max": surprisal.max().item() if surprisal.numel() else 0.0,
            "grad_norm": float(grad_norm),
            **metrics,
        }


def lm_update(learner: Learner, model, batch: Rollouts) -> dict:
    """Recompute the learner's token log-probs on a scored rollout batch and take one step."""
    if batch.rewards is None:
        raise ValueError("score the rollouts before learning from them")
    logp = token_logprobs(model, batch.input_ids, batch.attention_mask, batch.allowed, batch.answer_start)
    return learner.update(PGBatch(logp, batch.rewards, batch.group, batch.answer_mask, batch.behaviour_logp))
