"""What every task provides: seeded problems, a verifiable reward, a fixed held-out set."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True)
class Problem:
    """One prompt and the answer that earns full reward.

    `prompt` is text for language tasks and a feature vector for the digits bandit.
    """

    prompt: Any
    target: Any


class Task(Protocol):
    name: str
    # Language tasks: how many answer tokens a policy may write; bandits: 1 (one action).
    max_answer_tokens: int
    # Chat tasks are shown to chat models through their chat template.
    chat: bool

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]: ...

    def reward(self, problem: Problem, answer: Any) -> float: ...

    def is_correct(self, problem: Problem, answer: Any) -> bool: ...

    def eval_problems(self) -> list[Problem]: ...

    def client_split(self, num_clients: int, client_id: int) -> Task: ...


def error_rate(task: Task, problems: Sequence[Problem], answers: Sequence[Any]) -> float:
    """Fraction of problems whose answer is not exactly right (the held-out metric)."""
    if len(problems) != len(answers):
        raise ValueError(f"{len(problems)} problems but {len(answers)} answers")
    wrong = sum(not task.is_correct(p, a) for p, a in zip(problems, answers))
    return wrong / max(len(problems), 1)


def check_client(num_clients: int, client_id: int) -> None:
    if num_clients < 1 or not 0 <= client_id < num_clients:
        raise ValueError(f"client_id must be in [0, {num_clients}), got {client_id} of {num_clients}")
