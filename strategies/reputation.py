"""Each client's record of accepted and refused updates, and the weight it earns.

The weight is the posterior mean of a Beta(1, 1) prior over "this client's next update is
good": (accepted + 1) / (accepted + refused + 2). A new client starts at 1/2 of what a long
honest record earns; every refusal for a cause that a client controls (a harmful or malformed
update, a false claim) costs it weight, so a persistent attacker fades out of the weighted mean
even on rounds where its update passes every check. Refusals it does not control (staleness,
the store) are not held against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BLAMELESS = frozenset({"staleness", "store"})  # lateness and transport, not dishonesty


@dataclass
class Reputation:
    accepted: dict[int, int] = field(default_factory=dict)  # client id -> updates merged
    refused: dict[int, int] = field(default_factory=dict)  # client id -> updates refused for cause

    def record(self, client: int, accepted: bool, cause: str = "") -> None:
        if accepted:
            self.accepted[client] = self.accepted.get(client, 0) + 1
        elif cause not in BLAMELESS:
            self.refused[client] = self.refused.get(client, 0) + 1

    def weight(self, client: int) -> float:
        good, bad = self.accepted.get(client, 0), self.refused.get(client, 0)
        return (good + 1) / (good + bad + 2)

    def state_dict(self) -> dict:
        return {"accepted": dict(self.accepted), "refused": dict(self.refused)}

    def load_state_dict(self, state: dict) -> None:
        # JSON turns int keys into strings
        self.accepted = {int(k): int(v) for k, v in state.get("accepted", {}).items()}
        self.refused = {int(k): int(v) for k, v in state.get("refused", {}).items()}
