"""BlockScheduler: which block each client trains next, and for how many local steps.

Steps are sized from each client's measured seconds per step so that the clients of a
round finish together (FedCompass's idea): K_i = target_s / s_i, clamped. A volunteer's
hardware probe gives its speed before it has reported any round, and its cap on steps per
round, which no assignment exceeds.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from fedrl.bounds import at_least

POLICIES = ("cyclic", "random", "lru")
MIN_STEP_S = 1e-6  # a floor on reported seconds per step


@dataclass
class BlockScheduler:
    num_blocks: int
    policy: str = "cyclic"
    base_steps: int = 8  # steps for a client of median speed
    min_steps: int = 1
    max_steps: int = 64
    seed: int = 0
    speed: dict[int, float] = field(default_factory=dict)  # node -> EMA seconds per step
    assigned: dict[int, int] = field(default_factory=dict)  # node -> rounds assigned so far
    last_update: list[int] = field(default_factory=list)  # block -> version it last changed
    in_flight: list[int] = field(default_factory=list)  # block -> clients training it now
    caps: dict[int, int] = field(default_factory=dict)  # node -> the most steps it takes per round

    def __post_init__(self):
        if self.policy not in POLICIES:
            raise ValueError(f"schedule must be one of {POLICIES}, got {self.policy!r}")
        if self.num_blocks < 1 or not 1 <= self.min_steps <= self.base_steps <= self.max_steps:
            raise ValueError("need num_blocks >= 1 and 1 <= min_steps <= base_steps <= max_steps")
        at_least(self, 0, "seed")
        self.last_update = self.last_update or [-1] * self.num_blocks
        self.in_flight = self.in_flight or [0] * self.num_blocks
        self._rng = np.random.default_rng(self.seed)

    def assign_block(self, node: int, rank: int) -> int:
        """`rank` is the node's position among known nodes: cyclic staggers clients across blocks."""
        count = self.assigned.get(node, 0)
        self.assigned[node] = count + 1
        if self.policy == "cyclic":
            block = (rank + count) % self.num_blocks
        elif self.policy == "random":
            block = int(self._rng.integers(self.num_blocks))
        else:  # least busy, then least recently updated
            block = min(range(self.num_blocks), key=lambda b: (self.in_flight[b], self.last_update[b], b))
        self.in_flight[block] += 1
        return block

    def release(self, block: int) -> None:
        self.in_flight[block] = max(0, self.in_flight[block] - 1)

    def record_update(self, block: int, version: int) -> None:
        self.last_update[block] = version

    def observe_speed(self, node: int, seconds_per_step: float) -> None:
        """Reported seconds per step, floored at MIN_STEP_S: no learner step is faster, and a
        client reporting 5e-324 s must not make the step count infinite (or the EMA zero)."""
        if seconds_per_step > 0 and math.isfinite(seconds_per_step):
            seconds_per_step = max(seconds_per_step, MIN_STEP_S)
            old = self.speed.get(node)
            self.speed[node] = seconds_per_step if old is None else 0.5 * old + 0.5 * seconds_per_step

    def observe_probe(self, node: int, seconds_per_step: float, steps_cap: int) -> None:
        """A node's own probe: its speed until it reports a measured one, and its cap."""
        if node not in self.speed:
            self.observe_speed(node, seconds_per_step)
        self.caps[node] = max(1, int(steps_cap))

    def steps_for(self, node: int) -> int:
        steps = self.base_steps
        if node in self.speed:
            target = self.base_steps * statistics.median(self.speed.values())
            steps = int(np.clip(round(target / self.speed[node]), self.min_steps, self.max_steps))
        return min(steps, self.caps.get(node, steps))

    def state_dict(self) -> dict:
        return {
            "speed": {str(k): v for k, v in self.speed.items()},
            "assigned": {str(k): v for k, v in self.assigned.items()},
            "last_update": list(self.last_update),
            "caps": {str(k): v for k, v in self.caps.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        self.speed = {int(k): float(v) for k, v in state["speed"].items()}
        self.assigned = {int(k): int(v) for k, v in state["assigned"].items()}
        self.last_update = [int(v) for v in state["last_update"]]
        self.caps = {int(k): int(v) for k, v in state.get("caps", {}).items()}
