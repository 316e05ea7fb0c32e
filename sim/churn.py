"""Churn: nodes leave, new ones join and the ones that left come back, during a run.

`ChurnGrid` is the in-process Grid (fedrl.sim.local_grid) with a schedule counted in replies
the coordinator has pulled: after `period` of them a fraction of the nodes leaves, the next
time one of them is sent a message (its reply becomes Flower's NODE_UNAVAILABLE error, as when
a machine goes away mid-round); after another `period` as many new nodes join; after a third
the ones that left come back under their old node ids (a SuperNode restarted with its state).
Each phase lasts until the coordinator has looked at the node list at least once, so it sees
every change; it learns of them only through `get_node_ids` and the replies.
"""

from __future__ import annotations

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode

from fedrl.sim.local_grid import LocalGrid

PHASES = ("left", "joined", "returned")


class ChurnGrid(LocalGrid):
    def __init__(self, num_nodes: int, client_app, fraction: float = 0.3, period: int = 4):
        self.movers = max(1, round(fraction * num_nodes))
        super().__init__(num_nodes + self.movers, client_app)  # the joiners' contexts wait, hidden
        self.period = period
        self.leavers = list(range(num_nodes - self.movers + 1, num_nodes + 1))
        self.joiners = list(range(num_nodes + 1, num_nodes + self.movers + 1))
        self.hidden = set(self.joiners)
        self.pulled, self.seen = 0, False  # seen: the node list was read since the last change
        self.log: list[dict] = []  # what happened, to which nodes, after how many replies
        self.failed_in_flight = 0

    def get_node_ids(self):
        self.seen = True
        return [n for n in self.contexts if n not in self.hidden]

    def _due(self) -> bool:
        return len(self.log) < len(PHASES) and self.pulled >= (len(self.log) + 1) * self.period and self.seen

    def _record(self, what: str, nodes: list[int]) -> None:
        self.log.append({"after_replies": self.pulled, "what": what, "nodes": list(nodes)})
        self.seen = False

    def push_messages(self, msgs: list[Message]):
        ids = []
        for m in msgs:
            node = m.metadata.dst_node_id
            if node in self.hidden:  # gone: Flower would not deliver it
                ids.append("")
                continue
            [mid] = super().push_messages([m])
            if not self.log and node in self.leavers and self._due():
                # the leavers go now, this one with the message just delivered: its reply never
                # comes, Flower answers NODE_UNAVAILABLE instead
                reason = f"node {node} went offline before its reply was sent"
                self.replies[mid] = Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason=reason), reply_to=m)
                self.failed_in_flight += 1
                self.hidden |= set(self.leavers)
                self._record("left", self.leavers)
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        replies = super().pull_messages(ids)
        self.pulled += len(replies)
        if self.log and self._due():  # joins and returns happen between rounds
            what = PHASES[len(self.log)]
            nodes = self.joiners if what == "joined" else self.leavers
            self.hidden -= set(nodes)
            self._record(what, nodes)
        return replies
