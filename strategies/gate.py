"""A verification gate for untrusted updates: each candidate is scored before it is merged.

The coordinator holds the model. Before an update joins the buffer, the gate applies it to the
current global adapter and scores the result on a fixed probe set (problems drawn from the
task's training distribution with the run's seed, disjoint in purpose from the held-out eval):
the mean reward of greedy answers. An update that lowers it by more than `tolerance` is
rejected (cause `gate`), whatever its norm: this is what catches a valid, in-bound patch of a
harmful update, which clipping only scales. The score of the global state is cached per version,
so each update costs one greedy pass over the probe set.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import numpy as np
import torch

from fedrl.lora import AdapterModel
from fedrl.rollout import rollout
from fedrl.tasks.base import Task

PROBE_SEED = 0x6A7E  # the probe problems' stream, apart from every client's and the eval's


class VerificationGate:
    def __init__(self, adapter: AdapterModel, task: Task, problems: int, tolerance: float, seed: int):
        self.adapter, self.task, self.tolerance = adapter, task, tolerance
        self.problems = task.sample(problems, np.random.default_rng([seed, PROBE_SEED]))
        self.cached: tuple[int, float] | None = None  # (version, score of that global state)
        self.cpu_s, self.scored = 0.0, 0

    def score(self, state: Mapping[str, torch.Tensor]) -> float:
        """Mean reward of greedy answers on the probe set under `state` (higher is better)."""
        cpu = time.process_time()
        self.adapter.part.set_all(self.adapter.lm.model, state)
        batch = rollout(self.adapter.lm, self.task, self.problems, greedy=True)
        score = float(np.mean([self.task.reward(p, a) for p, a in zip(self.problems, batch.answers)]))
        self.cpu_s += time.process_time() - cpu
        self.scored += 1
        return score

    def check(
        self, version: int, state: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor]
    ) -> tuple[float, float, str | None]:
        """(score before, score with the update, why it is refused or None)."""
        if self.cached is None or self.cached[0] != version:
            self.cached = (version, self.score(state))
        before = self.cached[1]
        after = self.score({**state, **{n: state[n] + d.to(state[n].dtype) for n, d in delta.items()}})
        if after < before - self.tolerance:
            return (
                before,
                after,
                (
                    f"probe reward {before:.3f} -> {after:.3f} with this update "
                    f"(more than the tolerance {self.tolerance:g} worse)"
                ),
            )
        return before, after, None
