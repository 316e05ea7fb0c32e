"""A Flower Grid that runs the real ClientApp inside this process, one message at a time.

Flower's message types, node contexts and the ClientApp are the real ones; only Ray's worker
pool is missing. With the virtual clock the engine does not change any result (time is
simulated), so sweeps and benchmarks use it to avoid Ray's start-up and per-message cost;
`client_cpu_s` (process CPU while a ClientApp runs: its threads and the store serving it)
keeps the clients' CPU apart from the coordinator's.
"""

from __future__ import annotations

import time
import uuid

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity


class LocalGrid(Grid):
    def __init__(self, num_nodes: int, client_app):
        self.contexts = {
            i + 1: Context(
                run_id=1,
                node_id=i + 1,
                node_config={"partition-id": i, "num-partitions": num_nodes},
                state=RecordDict(),
                run_config={},
            )
            for i in range(num_nodes)
        }
        self.client_app = client_app
        self.replies: dict[str, Message] = {}
        self.client_cpu_s = 0.0
        # Messages are stamped with the running task's identity, as `flwr run` would set it
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID

    def set_run(self, run):
        pass

    @property
    def run(self):
        return None

    def create_message(self, *args, **kwargs):
        raise NotImplementedError("build Message objects directly")

    def get_nodes(self):
        return []

    def get_node_ids(self):
        return list(self.contexts)

    def reply_to(self, node: int, msg: Message) -> Message:
        start = time.process_time()
        try:
            return self.client_app(msg, self.contexts[node])
        except Exception as err:  # what Flower does when a ClientApp raises: an error reply
            return Message(Error(code=2, reason=f"ClientApp raised: {err}"), reply_to=msg)
        finally:
            self.client_cpu_s += time.process_time() - start

    def push_messages(self, msgs):
        ids = []
        for m in msgs:
            mid = uuid.uuid4().hex
            m.metadata.__dict__["_message_id"] = mid
            node = m.metadata.dst_node_id
            if node not in self.contexts:
                ids.append("")
                continue
            self.replies[mid] = self.reply_to(node, m)
            ids.append(mid)
        return ids

    def pull_messages(self, ids):
        return [self.replies.pop(i) for i in list(ids) if i in self.replies]

    def send_and_receive(self, msgs, *, timeout=None):
        return self.pull_messages(self.push_messages(msgs))
