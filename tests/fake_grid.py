"""A Grid that runs the real ClientApp inline: fast tests of the coordinator loop without Ray.

`script` may make a node fail (an error reply) or replace a reply (a dishonest client)."""

from __future__ import annotations

import uuid

from flwr.app import Context, Error, Message, RecordDict
from flwr.serverapp import Grid


class FakeGrid(Grid):
    def __init__(self, num_nodes: int, client_app, script=None):
        self.contexts = {
            i + 1: Context(run_id=1, node_id=i + 1, node_config={"partition-id": i, "num-partitions": num_nodes},
                           state=RecordDict(), run_config={})
            for i in range(num_nodes)
        }
        self.client_app, self.script = client_app, script or (lambda node, msg, reply: reply)
        self.replies: dict[str, Message] = {}
        self.pushed: list[Message] = []

    def set_run(self, run):
        pass

    @property
    def run(self):
        return None

    def create_message(self, *a, **k):
        raise NotImplementedError

    def get_nodes(self):
        return []

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, msgs):
        ids = []
        for m in msgs:
            mid = str(uuid.uuid4())
            m.metadata.__dict__["_message_id"] = mid
            node = m.metadata.dst_node_id
            self.pushed.append(m)
            try:
                reply = self.client_app(m, self.contexts[node])
            except Exception as err:  # what Flower does: an error reply
                reply = Message(Error(code=2, reason=f"ClientApp raised: {err}"), reply_to=m)
            self.replies[mid] = self.script(node, m, reply)
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]

    def send_and_receive(self, msgs, *, timeout=None):
        return self.pull_messages(self.push_messages(msgs))
