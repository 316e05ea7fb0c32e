"""fedrl's SuperNode timings: the options, what they set in Flower's modules, and a Flower that
lacks a name. The timings on real processes: tests/test_volunteer_processes.py (a node that
registered with its own heartbeat interval) and tests/test_deploy_processes.py."""

import os
import subprocess
import sys

import pytest

from fedrl.deploy import supernode_timing
from fedrl.deploy.supernode_timing import CappedSleep, apply, split_args, supernode_argv


def test_the_two_options_are_split_from_flower_supernodes_own_and_checked():
    timing, rest = split_args(["--superlink", "h:1", "--heartbeat-s", "12", "--port", "5"])
    assert (timing.poll_s, timing.heartbeat_s, rest) == (1.0, 12.0, ["--superlink", "h:1", "--port", "5"])
    argv = supernode_argv(["--superlink", "h:1"], poll_s=0.5, heartbeat_s=10)
    assert argv[1:3] == ["-m", "fedrl.deploy.supernode_timing"]
    timing, rest = split_args(argv[3:])  # what the SuperNode's process reads back
    assert (timing.poll_s, timing.heartbeat_s, rest) == (0.5, 10.0, ["--superlink", "h:1"])
    for bad in (["--heartbeat-s", "5"], ["--heartbeat-s", "nan"], ["--poll-s", "0"], ["--poll-s", "x"]):
        with pytest.raises(SystemExit) as exit_:
            split_args(bad)
        assert exit_.value.code == 2, bad


def test_a_capped_sleep_waits_at_most_its_cap(monkeypatch):
    slept = []
    monkeypatch.setattr(supernode_timing.time, "sleep", slept.append)
    capped = CappedSleep(0.25)
    capped.sleep(3)  # the idle SuperNode's wait
    capped.sleep(0.1)
    assert slept == [0.25, 0.1] and capped.monotonic is supernode_timing.time.monotonic


def test_apply_sets_the_message_loops_waits_and_the_heartbeat_interval():
    """In a process of its own: what it patches stays patched."""
    script = """
import os
from fedrl.deploy.supernode_timing import CappedSleep, apply
assert apply(0.25, 10.0) == ""
import flwr.supernode.start_client_internal as loop, flwr.supernode.fleet_http_connection as fleet
import flwr.supercore.heartbeat as heartbeat
assert isinstance(loop.time, CappedSleep) and loop.time.cap == 0.25
assert fleet.HEARTBEAT_DEFAULT_INTERVAL == heartbeat.HEARTBEAT_DEFAULT_INTERVAL == 10.0
assert os.environ["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] == "0.25"
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_flower_without_a_patched_name_keeps_its_own_timing(monkeypatch):
    import flwr.supercore.heartbeat as heartbeat
    import flwr.supernode.start_client_internal as loop

    before = (loop.time, heartbeat.HEARTBEAT_DEFAULT_INTERVAL)
    monkeypatch.setattr(
        supernode_timing, "PATCHED", (*supernode_timing.PATCHED, ("flwr.supercore.heartbeat", "GONE"))
    )
    assert apply(0.25, 10.0) == "this Flower's flwr.supercore.heartbeat has no GONE"
    assert (loop.time, heartbeat.HEARTBEAT_DEFAULT_INTERVAL) == before  # nothing half-patched
    monkeypatch.setattr(supernode_timing, "PATCHED", (("flwr.no_such_module", "x"),))
    assert apply(0.25, 10.0) == "this Flower has no flwr.no_such_module"
