"""LocalGrid with a `script` hook that may make a node fail (an error reply) or replace a
reply (a dishonest client), for tests of the coordinator loop without Ray."""

from __future__ import annotations

from fedrl.sim.local_grid import LocalGrid


class FakeGrid(LocalGrid):
    def __init__(self, num_nodes: int, client_app, script=None):
        super().__init__(num_nodes, client_app)
        self.script = script or (lambda node, msg, reply: reply)

    def reply_to(self, node, msg):
        return self.script(node, msg, super().reply_to(node, msg))
