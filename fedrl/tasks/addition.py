"""Two-digit addition as chat prompts: a real RL target for a small pretrained LM."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import numpy as np

from fedrl.tasks.base import Problem, check_client

EVAL_SEED = 2_000_003
_INTEGER = re.compile(r"-?\d+")


def stated_answer(text: str) -> int | None:
    """The integer the model gives as its answer: the first one after the last '=' when it
    restates the sum ("11 + 15 = 26"), else the first one it writes."""
    text = text.replace(",", "")
    if "=" in text:
        text = text.rsplit("=", 1)[1]
    match = _INTEGER.search(text)
    return int(match.group()) if match else None


@dataclass(frozen=True)
class AdditionTask:
    """'What is a + b?' with a, b in [low, high]; reward 1 when the stated answer is a + b."""

    low: int = 10
    high: int = 99
    num_eval: int = 200
    max_answer_tokens: int = 16
    name: str = field(default="addition", init=False)
    chat: bool = field(default=True, init=False)

    def __post_init__(self):
        if not 0 <= self.low <= self.high:
            raise ValueError(f"need 0 <= low <= high, got low={self.low} high={self.high}")

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        a = rng.integers(self.low, self.high + 1, size=n)
        b = rng.integers(self.low, self.high + 1, size=n)
        return [Problem(f"What is {x} + {y}? Reply with only the number.", str(x + y)) for x, y in zip(a, b)]

    def reward(self, problem: Problem, answer: str) -> float:
        return float(self.is_correct(problem, answer))

    def is_correct(self, problem: Problem, answer: str) -> bool:
        return stated_answer(answer) == int(problem.target)

    def is_well_formed(self, answer: str) -> bool:
        """An answer that states an integer; one that does not is a format error, not a wrong sum."""
        return stated_answer(answer) is not None

    def eval_problems(self) -> list[Problem]:
        return self.sample(self.num_eval, np.random.default_rng(EVAL_SEED))

    def client_split(self, num_clients: int, client_id: int) -> AdditionTask:
        """Client i draws operands from its own slice of [low, high]: different difficulties."""
        check_client(num_clients, client_id)
        edges = np.linspace(self.low, self.high + 1, num_clients + 1).astype(int)
        return replace(
            self, low=int(edges[client_id]), high=int(max(edges[client_id], edges[client_id + 1] - 1))
        )
