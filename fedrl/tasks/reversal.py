"""Token reversal (the DG papers' task): the answer is the prompt written backwards."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from fedrl.bounds import at_least
from fedrl.tasks.base import Problem, check_client

EVAL_SEED = 1_000_003


@dataclass(frozen=True)
class ReversalTask:
    """Prompts of H symbols from an alphabet of M ('0'..'M-1').

    reward: "first_error" = fraction of answer symbols right before the first mistake
    (the DG papers' reward_to_first_error), "fraction" = fraction right anywhere; both mixed
    with the exact-match bonus as kappa * partial + (1 - kappa) * exact.
    `symbol_probs` skews which symbols appear (the non-IID client splits).
    """

    length: int = 10
    num_symbols: int = 2
    reward_kind: str = "first_error"
    kappa: float = 1.0
    num_eval: int = 1024
    symbol_probs: tuple[float, ...] | None = None
    name: str = field(default="reversal", init=False)
    chat: bool = field(default=False, init=False)

    def __post_init__(self):
        if not 1 <= self.num_symbols <= 10:
            raise ValueError(f"num_symbols must be in [1, 10], got {self.num_symbols}")
        at_least(self, 1, "length")
        if self.reward_kind not in ("first_error", "fraction"):
            raise ValueError(f"reward_kind must be 'first_error' or 'fraction', got {self.reward_kind!r}")
        if self.symbol_probs is not None and len(self.symbol_probs) != self.num_symbols:
            raise ValueError("symbol_probs needs one probability per symbol")

    @property
    def answer_alphabet(self) -> str:
        return "0123456789"[: self.num_symbols]

    @property
    def max_answer_tokens(self) -> int:
        return self.length

    def _prompt(self, rng: np.random.Generator) -> str:
        p = None if self.symbol_probs is None else np.asarray(self.symbol_probs) / sum(self.symbol_probs)
        return "".join(str(s) for s in rng.choice(self.num_symbols, size=self.length, p=p))

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        out = []
        for _ in range(n):
            prompt = self._prompt(rng)
            out.append(Problem(prompt, prompt[::-1]))
        return out

    def reward(self, problem: Problem, answer: str) -> float:
        target = problem.target
        hits = [a == t for a, t in zip(answer, target)]
        if self.reward_kind == "first_error":
            partial = next((i for i, h in enumerate(hits) if not h), len(hits)) / len(target)
        else:
            partial = sum(hits) / len(target)
        return self.kappa * partial + (1 - self.kappa) * float(self.is_correct(problem, answer))

    def is_correct(self, problem: Problem, answer: str) -> bool:
        return answer[: len(problem.target)] == problem.target

    def eval_problems(self) -> list[Problem]:
        """All 2**H prompts when that is at most num_eval (M=2, H=10: all 1,024), else a fixed sample."""
        if self.num_symbols**self.length <= self.num_eval:
            prompts = [
                np.base_repr(i, self.num_symbols).zfill(self.length)
                for i in range(self.num_symbols**self.length)
            ]
            return [Problem(p, p[::-1]) for p in prompts]
        return replace(self, symbol_probs=None).sample(self.num_eval, np.random.default_rng(EVAL_SEED))

    def client_split(self, num_clients: int, client_id: int) -> ReversalTask:
        """Client i sees symbol frequencies skewed by its position: a label-skew-like non-IID split."""
        check_client(num_clients, client_id)
        if num_clients == 1:
            return self
        skew = 0.8 * (client_id / (num_clients - 1) - 0.5)  # in [-0.4, 0.4]
        probs = np.linspace(0.5 + skew, 0.5 - skew, self.num_symbols)
        return replace(self, symbol_probs=tuple(float(p) for p in probs / probs.sum()))
