"""scikit-learn's bundled 8x8 digits as a contextual bandit: context = image, action = class."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np

from fedrl.tasks.base import Problem, check_client

SPLIT_SEED = 3_000_003


@lru_cache(maxsize=1)
def _digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Images scaled to [0, 1] and a fixed 80/20 train/held-out split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = (data.data / 16.0).astype(np.float32)
    y = data.target.astype(np.int64)
    order = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    cut = int(0.8 * len(y))
    train, test = order[:cut], order[cut:]
    return x[train], y[train], x[test], y[test]


@dataclass(frozen=True)
class DigitsBandit:
    """Reward 1 for the right class, 0 otherwise; `classes` restricts a client's images."""

    classes: tuple[int, ...] = tuple(range(10))
    num_actions: int = 10
    max_answer_tokens: int = 1
    name: str = field(default="digits", init=False)
    chat: bool = field(default=False, init=False)

    @property
    def feature_dim(self) -> int:
        return _digits()[0].shape[1]

    def _train_indices(self) -> np.ndarray:
        return np.flatnonzero(np.isin(_digits()[1], self.classes))

    def sample(self, n: int, rng: np.random.Generator) -> list[Problem]:
        x, y, _, _ = _digits()
        idx = rng.choice(self._train_indices(), size=n)
        return [Problem(x[i], int(y[i])) for i in idx]

    def sample_arrays(self, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
        """The same draw as `sample`, as (features, labels) arrays for batched policies."""
        x, y, _, _ = _digits()
        idx = rng.choice(self._train_indices(), size=n)
        return x[idx], y[idx]

    def reward(self, problem: Problem, answer: int) -> float:
        return float(int(answer) == problem.target)

    def is_correct(self, problem: Problem, answer: int) -> bool:
        return int(answer) == problem.target

    def eval_problems(self) -> list[Problem]:
        _, _, x, y = _digits()
        return [Problem(xi, int(yi)) for xi, yi in zip(x, y)]

    def eval_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        _, _, x, y = _digits()
        return x, y

    def client_split(self, num_clients: int, client_id: int) -> DigitsBandit:
        """Label skew: client i mostly sees a window of consecutive classes."""
        check_client(num_clients, client_id)
        width = max(2, int(np.ceil(10 / num_clients)) + 1)
        start = (client_id * 10) // num_clients
        return DigitsBandit(classes=tuple(sorted({(start + k) % 10 for k in range(width)})))
