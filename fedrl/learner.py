"""The local learner: one optimizer step of a policy-gradient loss on the trainable parameters.

Hyperparameters live in `LearnerConfig`; the loss is picked by name from fedrl.losses.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from fedrl.bounds import at_least
from fedrl.losses import LOSSES, PGBatch
from fedrl.rollout import Rollouts, token_logprobs


@dataclass(frozen=True)
class LearnerConfig:
    method: str = "dg"  # dg, reinforce, iw_pg, ppo, decoupled_ppo
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float | None = 1.0
    loss_params: dict = field(default_factory=dict)  # e.g. {"eta": 1.0}, {"eps": 0.2}, {"cap": 5.0}
    # rows per backward pass (whole prompt groups; 0: the whole batch): the same step in less memory
    micro_batch: int = 0

    def __post_init__(self):
        if self.method not in LOSSES:
            raise ValueError(f"unknown method {self.method!r}; known: {sorted(LOSSES)}")
        at_least(self, 0, "micro_batch")

    @classmethod
    def of(cls, settings) -> LearnerConfig:
        """The learner that a run's settings (an instruction, a run config) ask for: DG's gate
        temperature and PPO's clip reach their own losses only."""
        params = {
            "dg": {"eta": settings.dg_eta},
            "ppo": {"eps": settings.ppo_clip},
            "decoupled_ppo": {"eps": settings.ppo_clip},
        }.get(settings.method, {})
        return cls(settings.method, lr=settings.lr, micro_batch=settings.micro_batch, loss_params=params)


ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")  # torch.optim.Adam's per-parameter state


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

    def moments(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Adam's state of the parameters (`names`: theirs, in order) as flat tensors
        ("NAME:step", "NAME:exp_avg", "NAME:exp_avg_sq"); parameters not yet stepped have none."""
        self._check_names(names)
        state = self.optimizer.state
        return {
            f"{n}:{k}": state[p][k].detach().clone()
            for n, p in zip(names, self.params)
            if p in state
            for k in ADAM_STATE
        }

    def restore_moments(self, names: list[str], moments: dict[str, torch.Tensor]) -> None:
        """Continue from `moments` (as `moments` returns them) where a parameter's are complete
        and fit its shape; the others start fresh."""
        self._check_names(names)
        for n, p in zip(names, self.params):
            saved = [moments.get(f"{n}:{k}") for k in ADAM_STATE]
            if any(t is None for t in saved) or any(t.shape != p.shape for t in saved[1:]):
                continue
            self.optimizer.state[p] = {k: t.clone() for k, t in zip(ADAM_STATE, saved)}

    def _check_names(self, names: list[str]) -> None:
        if len(names) != len(self.params):
            raise ValueError(f"{len(names)} names for {len(self.params)} trainable parameters")

    def update(self, batch: PGBatch) -> dict:
        return self.accumulate_and_step([batch], float(batch.mask.sum()))

    def accumulate_and_step(self, parts: Iterable[PGBatch], tokens: float) -> dict:
        """One optimizer step on a batch given as `parts` (built lazily, so one part's activations
        are alive at a time). Each part's token-mean loss is weighted by its share of the batch's
        `tokens` scored tokens: the gradient is the whole batch's token-mean loss's."""
        self.optimizer.zero_grad(set_to_none=True)
        shares, metrics, rewards, surprisals = [], [], [], []
        for part in parts:
            loss, extra = self.loss_fn(part, **self.config.loss_params)
            if not torch.isfinite(loss):
                self.optimizer.zero_grad(set_to_none=True)
                raise FloatingPointError(
                    f"non-finite {self.config.method} loss {loss.item()}; update skipped"
                )
            shares.append(float(part.mask.sum()) / max(tokens, 1.0))
            (loss * shares[-1]).backward()
            metrics.append({"loss": loss.item(), **extra})
            rewards.append(part.rewards.float())
            surprisals.append(-part.logp.detach()[part.mask.bool()])
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.config.max_grad_norm or float("inf"))
        self.optimizer.step()
        self.steps += 1
        surprisal = torch.cat(surprisals)
        return {
            **{k: sum(w * m[k] for w, m in zip(shares, metrics)) for k in metrics[0]},
            "reward": torch.cat(rewards).mean().item(),
            "surprisal_mean": surprisal.mean().item() if surprisal.numel() else 0.0,
            "surprisal_max": surprisal.max().item() if surprisal.numel() else 0.0,
            "grad_norm": float(grad_norm),
        }


def micro_batches(group: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Row indices in consecutive chunks of whole prompt groups, at most `size` rows each where a
    group fits (a group's advantage needs all its rows); size 0: one chunk."""
    rows = torch.arange(len(group))
    if size <= 0 or size >= len(group):
        return [rows]
    _, counts = torch.unique_consecutive(group, return_counts=True)
    chunks, current = [], []
    for group_rows in rows.split(counts.tolist()):
        if current and sum(map(len, current)) + len(group_rows) > size:
            chunks.append(torch.cat(current))
            current = []
        current.append(group_rows)
    return [*chunks, torch.cat(current)]


def lm_update(learner: Learner, model, batch: Rollouts) -> dict:
    """Recompute the learner's token log-probs on a scored rollout batch and take one step
    (in micro-batches of whole prompt groups when the learner is configured so)."""
    if batch.rewards is None:
        raise ValueError("score the rollouts before learning from them")

    def part(rows: torch.Tensor) -> PGBatch:
        logp = token_logprobs(
            model,
            batch.input_ids[rows],
            batch.attention_mask[rows],
            batch.allowed,
            batch.answer_start,
            batch.temperature,
        )
        return PGBatch(
            logp, batch.rewards[rows], batch.group[rows], batch.answer_mask[rows], batch.behaviour_logp[rows]
        )

    chunks = micro_batches(batch.group, learner.config.micro_batch)
    return learner.accumulate_and_step((part(rows) for rows in chunks), float(batch.answer_mask.sum()))
