"""Which nodes take part, under stable identities.

A node gets a client id the first time it is seen and keeps it for the run, whatever other
nodes do: ids are append-only, so a node's data shard and history never change because
another node came or went, and a node that leaves and comes back is the same client.
"""

from __future__ import annotations


class Membership:
    def __init__(self):
        self.ids: dict[int, int] = {}  # node id -> client id, append-only
        self.present: set[int] = set()

    def client_id(self, node: int) -> int:
        if node not in self.ids:
            self.ids[node] = len(self.ids)
        return self.ids[node]

    def refresh(self, node_ids) -> tuple[list[int], list[int]]:
        """Take the nodes connected now; returns (joined, left) since the last refresh. New
        nodes are numbered in sorted order, so one set of nodes always gets the same ids."""
        now = set(node_ids)
        joined, left = sorted(now - self.present), sorted(self.present - now)
        for node in joined:
            self.client_id(node)
        self.present = now
        return joined, left

    def known(self, node: int) -> bool:
        return node in self.ids

    def state_dict(self) -> dict:
        return {"ids": [[node, cid] for node, cid in self.ids.items()]}

    def load_state_dict(self, state: dict) -> None:
        self.ids = {int(node): int(cid) for node, cid in state["ids"]}
