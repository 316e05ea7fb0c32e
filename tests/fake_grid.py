"""Grids for tests of the coordinator loop without Ray, and the small run settings they use.

FakeGrid is a LocalGrid (the real ClientApp in this process) with a `script` hook that may
make a node fail (an error reply) or replace a reply (a dishonest client), and with churn:
`leave(node)` hides a node from get_node_ids (a message pushed to it gets what the
SuperLink gives for a vanished node), `join(node)` adds or brings one back, activated anew as
the SuperLink would (get_nodes: a new `last_activated_at`, listed or not before). Replies
already computed for a node that leaves still come in: late replies from departed nodes.
"""

from __future__ import annotations

import json

from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.proto.node_pb2 import NodeInfo

from fedrl.protocol import NOTICES, InstructionHead, TrainReport
from fedrl.sim.local_grid import LocalGrid
from fedrl.strategies.run_config import RunConfig


class FakeGrid(LocalGrid):
    def __init__(self, num_nodes: int, client_app, script=None):
        super().__init__(num_nodes, client_app)
        self.script = script or (lambda node, msg, reply: reply)
        self.present = set(self.contexts)
        self.activated = dict.fromkeys(self.contexts, 1)  # each node's activations so far
        self.sent: list[tuple[int, dict]] = []  # (node, whole instruction) of every message pushed
        self.settings: dict[int, dict] = {}  # the settings last sent to each node

    def get_node_ids(self):
        return sorted(self.present)

    def get_nodes(self):
        return [
            NodeInfo(node_id=n, last_activated_at=f"activation {self.activated[n]}")
            for n in sorted(self.present)
        ]

    def leave(self, node: int) -> None:
        self.present.discard(node)

    def join(self, node: int, restarted: bool = False) -> None:
        """Add a node or bring one back; `restarted`: as a new ClientApp, holding nothing."""
        if node not in self.contexts or restarted:
            self.contexts[node] = Context(
                run_id=1, node_id=node, node_config={}, state=RecordDict(), run_config={}
            )
        self.present.add(node)
        self.activated[node] = self.activated.get(node, 0) + 1

    def held(self, node: int) -> dict:
        """The global adapter a node holds, in the wire dtype versions travel in: what its
        uploads are patches against, in that dtype."""
        from fedrl.clients.client_app import load_state

        return load_state(self.contexts[node].state).held

    def reply_to(self, node, msg):
        """The node's reply, through `script` unless the message was a notice; scripts see the
        instruction whole (head + settings), as the node understood it."""
        if "settings" in msg.content.config_records:
            self.settings[node] = dict(msg.content["settings"])
        whole = {**self.settings.get(node, {}), **InstructionHead.unpack(msg.content["instruction"])}
        self.sent.append((node, whole))
        if node not in self.present:
            return Message(
                Error(code=ErrorCode.NODE_UNAVAILABLE, reason="node is not connected"), reply_to=msg
            )
        reply = super().reply_to(node, msg)
        if whole["action"] in NOTICES:  # nobody reads their answers; scripts see requests for work
            return reply
        msg.content["instruction"] = ConfigRecord(whole)
        return self.script(node, msg, reply)


def report_of(reply: Message) -> dict:
    """A reply's report as named fields (it travels packed)."""
    return TrainReport.unpack(reply.content["report"])


def with_report(msg: Message, reply: Message, **changes) -> Message:
    """The reply with its report's fields changed, unchecked: what a dishonest node would send."""
    report = TrainReport.pack({**report_of(reply), **changes})
    return Message(RecordDict({"report": ConfigRecord(report)}), reply_to=msg)


def at_protocol(record: dict, protocol: int) -> dict:
    """A packed record as a fedrl of wire protocol `protocol` would send it (the same fields)."""
    return {**record, "layout": f"{protocol}.{record['layout'].partition('.')[2]}"}


def small_config(tmp_path, **changes) -> RunConfig:
    """A run small enough for a unit test: 2 steps of 4x4 rollouts per message."""
    base = dict(
        versions=3,
        base_steps=2,
        min_steps=1,
        max_steps=4,
        prompts=4,
        samples=4,
        min_nodes=3,
        eval_every=100,
        out_dir=str(tmp_path / "run"),
        deadline_s=60.0,
        task_params=json.dumps({"length": 8, "num_eval": 32}),
    )
    return RunConfig(**{**base, **changes})


def instruction_record(**changes) -> dict:
    """A valid `train.block` instruction as it travels (a flat record), with `changes`."""
    record = dict(
        action="train",
        mode="parablock",
        block=0,
        steps=2,
        version=0,
        store_url="http://127.0.0.1:1",
        principal="node-1",
        token="t",
        public_key="",
        model="tiny-base",
        task="reversal",
        task_params="{}",
        num_blocks=3,
        lora_rank=8,
        lora_alpha=16.0,
        lr=1e-3,
        prompts=2,
        samples=2,
        method="dg",
        seed=0,
        client_id=0,
        data_shards=1,
    )
    return {**record, **changes}
