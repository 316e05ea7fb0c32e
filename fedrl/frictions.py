"""Frictions: how heterogeneous actors hurt a learner, injected on purpose.

Each is a small function over a rollout batch (or the actor's weights) with one strength;
`Frictions` names which are on and `Actor` applies them in a fixed order:
stale weights -> logit noise while sampling -> bugs -> discoveries -> rewards -> reward noise.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import numpy as np
import torch

from fedrl.bounds import at_least
from fedrl.models import LoadedModel
from fedrl.rollout import Rollouts, rollout, score, token_logprobs
from fedrl.tasks.base import Problem, Task


@dataclass(frozen=True)
class Frictions:
    staleness: int = 0  # D: the actor's weights are this many learner versions old
    staleness_uniform: bool = True  # age uniform in [0, D] per batch; False: always D
    bug_prob: float = 0.0  # a row's answer becomes the landmine, behaviour log-prob falsified to 0
    reward_noise_prob: float = 0.0  # the reward becomes a fair coin flip in {0, 1}
    discovery_prob: float = 0.0  # the actor writes the correct answer
    logit_noise: float = 0.0  # std of Gaussian noise on the actor's logits (inference mismatch)

    def __post_init__(self):
        for name in ("bug_prob", "reward_noise_prob", "discovery_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a probability, got {getattr(self, name)}")
        at_least(self, 0, "staleness", "logit_noise")


class StalenessBuffer:
    """The last D+1 learner snapshots; the actor samples with one of them."""

    def __init__(self, max_age: int, uniform: bool = True):
        self.max_age, self.uniform = max_age, uniform
        self.snapshots: collections.deque = collections.deque(maxlen=max_age + 1)

    def push(self, snapshot) -> None:
        self.snapshots.append(snapshot)

    def sample_age(self, rng: np.random.Generator) -> int:
        oldest = len(self.snapshots) - 1
        age = int(rng.integers(0, self.max_age + 1)) if self.uniform else self.max_age
        return min(age, oldest)

    def get(self, age: int):
        return self.snapshots[-1 - age]


def lagged_rollout(lm: LoadedModel, part, history: StalenessBuffer | None, rng, *args, **kwargs) -> Rollouts:
    """A rollout by an actor that lags its learner: `history` holds the adapter's values at the
    learner's last steps (this one is pushed now) and the actor samples with one of them, drawn
    by the buffer's rule; the learner's values are back in the model afterwards. Behaviour
    log-probs are the lagging actor's own, so they stay exact. No history: the learner samples."""
    if history is None:
        return rollout(lm, *args, **kwargs)
    learner = part.get_all(lm.model)
    history.push(learner)
    age = history.sample_age(rng)
    if age == 0:
        return rollout(lm, *args, **kwargs)
    part.set_all(lm.model, history.get(age))
    try:
        return rollout(lm, *args, **kwargs)
    finally:
        part.set_all(lm.model, learner)


def pick_rows(n: int, prob: float, rng: np.random.Generator) -> np.ndarray:
    return np.flatnonzero(rng.random(n) < prob) if prob > 0 else np.array([], dtype=int)


def inject_bugs(batch: Rollouts, lm: LoadedModel, landmine: str, prob: float, rng) -> np.ndarray:
    """With prob `prob` a row's answer is replaced by the landmine; it reports log-prob 0."""
    rows = pick_rows(len(batch.answers), prob, rng)
    tokens = lm.answer_ids(landmine)
    for row in rows:
        batch.overwrite_answer(int(row), tokens, landmine, 0.0)
    return rows


def inject_discoveries(batch: Rollouts, lm: LoadedModel, actor_model, prob: float, rng) -> np.ndarray:
    """With prob `prob` a row's answer is the correct one, reported with the actor's true log-probs."""
    rows = pick_rows(len(batch.answers), prob, rng)
    for row in rows:
        target = batch.problems[row].target
        batch.overwrite_answer(int(row), lm.answer_ids(target), target, 0.0)
    if len(rows):
        idx = torch.as_tensor(rows)
        with torch.no_grad():
            true_logp = token_logprobs(
                actor_model, batch.input_ids[idx], batch.attention_mask[idx], batch.allowed
            )
        batch.behaviour_logp[idx] = true_logp * batch.answer_mask[idx]
    return rows


def corrupt_rewards(rewards: torch.Tensor, prob: float, rng) -> np.ndarray:
    """With prob `prob` a reward is replaced by a fair coin flip in {0, 1}."""
    rows = pick_rows(len(rewards), prob, rng)
    rewards[torch.as_tensor(rows, dtype=torch.long)] = torch.as_tensor(
        rng.integers(0, 2, len(rows)), dtype=rewards.dtype
    )
    return rows


def logit_noise_hook(sigma: float, generator: torch.Generator):
    if sigma <= 0:
        return None
    return lambda logits: logits + sigma * torch.randn(logits.shape, generator=generator)


def perturb_and_score(batch: Rollouts, lm: LoadedModel, task: Task, f: Frictions, rng) -> dict[str, int]:
    """The frictions that act on a sampled batch, in order (bugs -> discoveries -> rewards ->
    reward noise), on the model that sampled it (`lm`); returns how many rows each touched."""
    counts = {"bugs": len(inject_bugs(batch, lm, "0" * task.max_answer_tokens, f.bug_prob, rng))}
    counts["discoveries"] = len(inject_discoveries(batch, lm, lm.model, f.discovery_prob, rng))
    score(task, batch)
    counts["noisy_rewards"] = len(corrupt_rewards(batch.rewards, f.reward_noise_prob, rng))
    return counts


class Actor:
    """Produces scored rollouts for a learner, with the frictions applied.

    `actor_lm` is a separate model object whose weights are set from the staleness buffer;
    `sync(params)` records the learner's newest parameters (a dict of tensors).
    """

    def __init__(self, actor_lm: LoadedModel, task: Task, frictions: Frictions, seed: int = 0):
        self.lm, self.task, self.frictions = actor_lm, task, frictions
        self.rng = np.random.default_rng(seed)
        self.generator = torch.Generator().manual_seed(seed)
        self.buffer = StalenessBuffer(frictions.staleness, frictions.staleness_uniform)
        self.counts = collections.Counter()

    def sync(self, params: dict[str, torch.Tensor], version: int) -> None:
        self.buffer.push((version, {k: v.detach().clone() for k, v in params.items()}))

    def collect(self, problems: list[Problem], samples_per_prompt: int) -> Rollouts:
        f = self.frictions
        version, params = self.buffer.get(self.buffer.sample_age(self.rng))
        self.lm.model.load_state_dict(params, strict=False)
        batch = rollout(
            self.lm,
            self.task,
            problems,
            samples_per_prompt,
            generator=self.generator,
            logit_hook=logit_noise_hook(f.logit_noise, self.generator),
            version=version,
        )
        self.counts["rows"] += len(batch.answers)
        self.counts.update(perturb_and_score(batch, self.lm, self.task, f, self.rng))
        return batch
