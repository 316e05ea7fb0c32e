import json
import time

import pytest
from fake_grid import FakeGrid, small_config

from fedrl.clock import RealClock
from fedrl.sim.apps import client_app
from fedrl.sim.clock import VirtualClock, round_seconds
from fedrl.sim.simulated_server import SimConfig, run_simulated


def test_round_seconds_composes_threads():
    assert round_seconds(True, 4.0, 1.5, 0.0) == (4.0, 1.5)  # comm hidden under compute
    assert round_seconds(True, 1.0, 3.0, 0.5) == (3.5, 1.0)  # compute waits for the patch
    assert round_seconds(False, 4.0, 1.5, 0.5) == (6.0, 0.0)


def test_virtual_clock_hands_out_replies_in_arrival_order_only_when_safe():
    clock = VirtualClock(lookahead=lambda earliest: earliest)
    clock.sent("a", 1.0)
    clock.sent("b", 5.0)
    clock.sent("c", 2.0)
    clock.arrived("b", "B", 6.0)
    assert clock.next_due() is None  # "a" and "c" may still arrive before t=6
    clock.arrived("c", "C", 3.0)
    assert clock.next_due() is None  # "a" could arrive at t>=1 < 3
    clock.arrived("a", "A", 4.0)
    assert [clock.next_due()[1] for _ in range(3)] == ["C", "A", "B"]
    assert clock.now() == 6.0 and clock.next_due() is None
    clock.sent("d", 10.0)  # lookahead: nothing can arrive before t=16
    clock.sent("e", 1.0)
    clock.arrived("e", "E", 2.0)
    assert clock.next_due() == ("e", "E") and clock.now() == 8.0


def test_replies_due_at_one_virtual_time_go_by_client_whatever_order_they_came_in():
    """Two clients of one profile finish at the same virtual time; the engine returns them in
    either order (Ray did), and the coordinator must see them in one order every run."""
    for came_in in (["x", "y"], ["y", "x"]):
        clock = VirtualClock(lookahead=lambda instr: instr[1], tie=lambda instr: instr[0])
        clock.sent("x", (7, 2.0))  # sent first, by the client ranked after
        clock.sent("y", (6, 2.0))
        for msg_id in came_in:
            clock.arrived(msg_id, msg_id.upper(), 2.0)
        assert [clock.next_due()[1] for _ in range(2)] == ["Y", "X"]
    clock = VirtualClock(lookahead=lambda instr: instr[1], tie=lambda instr: instr[0])
    clock.sent("x", (7, 2.0))
    clock.sent("y", (6, 2.0))
    clock.arrived("x", "X", 2.0)
    assert clock.next_due() is None  # "y" could still come at t=2, and it ranks first
    clock.arrived("y", "Y", 2.5)
    assert [clock.next_due()[1] for _ in range(2)] == ["X", "Y"] and clock.now() == 2.5


def test_a_forgotten_message_no_longer_holds_the_virtual_clock():
    clock = VirtualClock(lookahead=lambda earliest: earliest)
    clock.sent("lost", 1.0)
    clock.sent("b", 5.0)
    clock.arrived("b", "B", 6.0)
    assert clock.next_due() is None  # "lost" could still arrive at t>=1
    clock.forget("lost")
    assert clock.next_due() == ("b", "B") and clock.now() == 6.0


def test_real_clock_keeps_arrival_order():
    clock = RealClock()
    assert not clock.virtual
    clock.arrived("x", "X", 100.0)
    clock.arrived("y", "Y", 0.0)
    clock.arrived("z", "Z", 0.0)
    clock.forget("y")
    assert [clock.next_due()[1], clock.next_due()[1]] == ["X", "Z"]


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


class ScrambledGrid(FakeGrid):
    """Delivers replies late and newest first, so wall-clock order is the wrong order."""

    def pull_messages(self, ids):
        ready = [i for i in ids if i in self.replies]
        if len(ready) < 2 and len(ready) < len(ids):
            return []
        return [self.replies.pop(i) for i in reversed(ready)]


def virtual_run(tmp_path, profiles, **kw):
    """Three clients, 2 steps of 1 virtual second each at speed 1."""
    cfg = small_config(tmp_path, base_steps=2, min_steps=2, max_steps=2, prompts=2, samples=2, **kw)
    return cfg, SimConfig(clock="virtual", step_s=1.0, profiles=json.dumps(profiles))


def test_coordinator_orders_arrivals_by_virtual_time(tmp_path):
    profiles = [
        {"name": "fast", "speed": 4.0},
        {"name": "mid", "speed": 1.0},
        {"name": "slow", "speed": 0.25},
    ]
    cfg, sim = virtual_run(tmp_path, profiles, mode="parablock", sync=False, versions=6, buffer_size=1)
    summary = run_simulated(ScrambledGrid(3, client_app), cfg, sim)
    replies = [e for e in summary["events"] if e["kind"] == "reply"]
    times = [e["t"] for e in replies]
    assert times == sorted(times), "replies were handled out of virtual order"
    by_speed = {c["profile"]: c for c in summary["clients"].values()}
    # 2 steps at 1 s per step: 0.5 s for the fast client, 8 s for the slow one (no links: comm 0)
    assert by_speed["fast"]["timeline"][0]["duration_s"] == pytest.approx(0.5)
    assert by_speed["slow"]["timeline"][0]["duration_s"] == pytest.approx(8.0)
    assert by_speed["fast"]["messages"] > 4 * by_speed["slow"]["messages"] - 4
    first_slow = by_speed["slow"]["timeline"][0]["end"]
    assert first_slow == pytest.approx(8.0)
    assert summary["clock"] == "virtual" and summary["time_s"] >= 8.0


def test_virtual_deadline_cuts_stragglers_and_dropouts_are_errors(tmp_path):
    profiles = [
        {"name": "ok", "speed": 1.0},
        {"name": "straggler", "speed": 0.01},
        {"name": "flaky", "dropout": 0.99},
    ]
    cfg, sim = virtual_run(
        tmp_path, profiles, mode="block-sequential", sync=True, versions=2, deadline_s=50.0
    )
    summary = run_simulated(FakeGrid(3, client_app), cfg, sim)
    assert summary["versions"] == 2
    errors = [e["reason"] for e in summary["events"] if e["kind"] == "error"]
    assert sum("deadline 50.0 s exceeded" in r for r in errors) == 2  # the straggler, each round
    assert sum("dropped out" in r for r in errors) == 2
    assert summary["time_s"] == pytest.approx(100.0)  # each round closes at its deadline


class SlowGrid(FakeGrid):
    """Answers as FakeGrid does, on a machine that is much slower in wall-clock time."""

    def pull_messages(self, ids):
        time.sleep(0.15)
        return super().pull_messages(ids)


def test_a_virtual_run_with_dropouts_repeats_however_slow_the_machine(tmp_path):
    """A node that dropped out is tried again at the next refresh of the node list, which is
    timed on the run's clock, not the wall's: the same virtual run on a slow machine sends the
    same messages at the same virtual times."""
    profiles = [
        {"name": "ok", "speed": 1.0},
        {"name": "flaky", "dropout": 0.5},
        {"name": "slow", "speed": 0.8},
    ]
    runs = []
    for grid, name in ((FakeGrid(3, client_app), "fast"), (SlowGrid(3, client_app), "slow")):
        cfg, sim = virtual_run(
            tmp_path / name,
            profiles,
            mode="parablock",
            sync=False,
            versions=12,
            buffer_size=1,
            deadline_s=3.0,
        )
        summary = run_simulated(grid, cfg, sim)
        runs.append(
            [(e["kind"], e.get("node"), e["t"]) for e in summary["events"] if e["kind"] in ("reply", "error")]
        )
    fast, slow = runs
    dropped = [t for kind, node, t in fast if kind == "error"]
    assert dropped and any(kind == "reply" and node == 2 and t > dropped[0] for kind, node, t in fast)
    assert fast == slow
