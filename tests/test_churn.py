"""Nodes that leave, join and come back; replies that are late, lost or unknown. The
coordinator treats each as an event, keeps every node's client id, and keeps running."""

import time

import pytest
from fake_grid import FakeGrid, small_config
from flwr.app import ConfigRecord, Message, RecordDict

from fedrl.clients.client_app import app as client_app
from fedrl.protocol import SETTINGS_UNKNOWN, InstructionHead
from fedrl.sim.apps import client_app as simulated_client_app
from fedrl.sim.simulated_server import SimConfig, run_simulated
from fedrl.strategies.coordinator import run_coordinator
from fedrl.strategies.membership import Membership


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


def test_membership_ids_are_append_only():
    m = Membership()
    assert m.refresh([30, 10, 20]) == ([10, 20, 30], [])
    assert [m.client_id(n) for n in (10, 20, 30)] == [0, 1, 2]
    assert m.refresh([10, 30, 5]) == ([5], [20])  # 5 joins, 20 leaves: nobody is renumbered
    assert [m.client_id(n) for n in (10, 20, 30, 5)] == [0, 1, 2, 3]
    assert m.refresh([10, 30, 5, 20]) == ([20], [])
    assert m.client_id(20) == 1  # back with its old id
    restored = Membership()
    restored.load_state_dict(m.state_dict())
    assert restored.ids == m.ids


class ChurnScript:
    """Node 2 leaves after message `leave_at`, node 4 joins after the 5th, node 2 returns after the
    8th as a restarted ClientApp (it holds neither settings nor a version). Leaving after the 3rd,
    node 2's only reply comes in after it left; after the 4th, one was handled while it was there."""

    def __init__(self, leave_at: int):
        self.grid, self.messages, self.leave_at = None, 0, leave_at

    def __call__(self, node, msg, reply):
        self.messages += 1
        if self.messages == self.leave_at:
            self.grid.leave(2)
        elif self.messages == 5:
            self.grid.join(4)
        elif self.messages == 8:
            self.grid.join(2, restarted=True)
        return reply


@pytest.mark.parametrize(
    "mode,sync,leave_at", [("parablock", False, 3), ("parablock", False, 4), ("block-sequential", True, 4)]
)
def test_nodes_leave_join_and_return_during_rounds(tmp_path, mode, sync, leave_at, monkeypatch):
    monkeypatch.setattr("fedrl.strategies.coordinator.Coordinator.refresh_every_s", 0.0)
    script = ChurnScript(leave_at)
    grid = script.grid = FakeGrid(3, client_app, script)
    summary = run_coordinator(
        grid,
        small_config(tmp_path, mode=mode, sync=sync, versions=6, buffer_size=1, base_steps=1, max_steps=1),
    )
    assert summary["versions"] >= 6
    kinds = [e["kind"] for e in summary["events"]]
    assert "left" in kinds and kinds.count("joined") >= 5  # 3 at the start, node 4, node 2 again
    ids: dict[int, set] = {}
    for node, instr in grid.sent:
        ids.setdefault(node, set()).add(instr["client_id"])
        assert instr["data_shards"] == 3  # the split never depends on who is connected
    assert ids == {1: {0}, 2: {1}, 3: {2}, 4: {3}}
    # the returning node got the settings with its first instruction: no round trip refused
    errors = [e["reason"] for e in summary["events"] if e["kind"] == "error"]
    assert not [r for r in errors if r.startswith(SETTINGS_UNKNOWN)], errors
    assert {str(n) for n in (1, 3, 4)} <= set(summary["clients"])


def test_unknown_and_duplicate_replies_are_counted_not_fatal(tmp_path):
    class DuplicatingGrid(FakeGrid):
        """Delivers every reply twice and invents one for a message nobody sent."""

        def pull_messages(self, ids):
            replies = super().pull_messages(ids)
            if replies:
                ghost = Message(RecordDict({"report": ConfigRecord({"x": 1})}), reply_to=replies[0])
                ghost.metadata.__dict__["_reply_to_message_id"] = "f" * 32
                replies += [replies[0], ghost]
            return replies

    summary = run_coordinator(DuplicatingGrid(3, client_app), small_config(tmp_path, versions=2))
    assert summary["versions"] >= 2 and summary["counts"]["unknown"] >= 2


def test_a_reply_the_grid_holds_is_not_given_up_after_a_busy_spell_past_its_watchdog(tmp_path):
    """Found under load: the clock pulls from the Grid only when no reply is due, so a reply
    that came in time sat there while the loop handled others, and its watchdog then counted
    it lost. Only a reply the Grid does not hold is lost."""
    from fedrl.strategies.coordinator import Coordinator

    grid = FakeGrid(3, client_app)
    cfg = small_config(tmp_path, mode="parablock", sync=False, watchdog_s=1.0)
    with Coordinator(grid, cfg) as coordinator:
        coordinator.dispatch(1)
        coordinator.dispatch(2)
        (held, first), (dropped, second) = coordinator.in_flight.items()
        grid.replies.pop(dropped)  # node 2's reply never comes
        first.watchdog = second.watchdog = time.monotonic() - 1  # the loop was busy that long
        coordinator.expire_overdue()
        assert coordinator.counts["lost"] == 1 and dropped not in coordinator.in_flight
        assert coordinator.in_flight[held].arrived


def test_a_lost_reply_is_given_up_at_the_wall_clock_watchdog_on_the_virtual_clock(tmp_path):
    """Before: the virtual clock waited for it (ttl 12 h) and drain() waited as long in wall time."""

    class LosingGrid(FakeGrid):
        def push_messages(self, msgs):
            heads = [InstructionHead.unpack(m.content["instruction"]) for m in msgs]  # as they travel
            ids = super().push_messages(msgs)
            for m, head, i in zip(msgs, heads, ids):
                if m.metadata.dst_node_id == 3 and head["round"] == 2:
                    self.replies.pop(i, None)  # this reply never comes
            return ids

    cfg = small_config(tmp_path, mode="parablock", sync=False, versions=4, buffer_size=1, watchdog_s=1.0)
    start = time.monotonic()
    summary = run_simulated(LosingGrid(3, simulated_client_app), cfg, SimConfig(step_s=0.5))
    assert time.monotonic() - start < 120
    assert summary["versions"] >= 4 and summary["counts"]["lost"] == 1
    assert any(e["kind"] == "lost" and e["node"] == 3 for e in summary["events"])
