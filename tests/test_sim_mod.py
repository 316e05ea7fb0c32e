"""The seam: the simulation stamps messages on the way out and its mod takes the stamp off,
so the real ClientApp sees only the real protocol; a simulated dropout is an error reply,
not an exception with a traceback."""

import json

import pytest
from fake_grid import instruction_record
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.common.constant import ErrorCode

from fedrl.protocol import TrainInstruction, split_instruction
from fedrl.sim.simulated_client import STAMP, Stamp, simulated_client

# the head of an instruction: what the mod reads (the settings travel beside it, for the app)
INSTRUCTION = split_instruction(
    TrainInstruction.parse(instruction_record(client_id=3, data_shards=4, round=1))
)[0].to_packed()


def _message(profile: dict, run: str = "r") -> Message:
    stamp = Stamp(profile=json.dumps(profile), clock="virtual", step_s=1.0, now_s=0.0, run=run)
    content = RecordDict({"instruction": ConfigRecord(INSTRUCTION), STAMP: ConfigRecord(stamp.to_record())})
    return Message(content, dst_node_id=1, message_type="train.block")


def _context() -> Context:
    return Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})


@pytest.fixture(autouse=True)
def task_identity():
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0


def test_the_real_app_never_sees_the_stamp():
    seen = []

    def real_app(msg, context):
        seen.append(set(msg.content.config_records))
        from fedrl.clients.runtime import current_runtime

        seen.append(type(current_runtime()).__name__)
        return Message(RecordDict(), reply_to=msg)

    simulated_client(_message({"name": "x"}), _context(), real_app)
    assert seen == [{"instruction"}, "SimulatedRuntime"]


def test_a_dropout_is_an_error_reply_without_running_the_app():
    def real_app(msg, context):
        raise AssertionError("a dropped-out client does no work")

    reply = simulated_client(_message({"name": "flaky", "dropout": 0.999}), _context(), real_app)
    assert reply.has_error() and reply.error.code == ErrorCode.NODE_UNAVAILABLE
    assert "dropped out" in reply.error.reason


def test_a_bad_stamp_is_a_clear_error_reply():
    msg = _message({"name": "x", "speed": "fast"})
    reply = simulated_client(msg, _context(), lambda m, c: None)
    assert reply.has_error() and "speed: Input should be a valid number" in reply.error.reason


def test_on_the_virtual_clock_a_patch_lands_by_virtual_time_not_by_the_comm_threads_wall_clock():
    """A loaded machine's comm thread may still be busy when compute reaches the step at which
    its transfer ends in virtual time: the correction must still come at that step, or one
    seed's run would not repeat. On the real clock, the thread's progress is what counts."""
    import threading

    from fedrl.clients.runtime import CommResult
    from fedrl.sim.link import make_link
    from fedrl.sim.profiles import ClientProfile
    from fedrl.sim.simulated_client import SimulatedRuntime

    profile = ClientProfile(latency_s=2.5)  # the transfer: 2.5 virtual s, 2.5 steps of 1 s

    def comm_finishing_late() -> CommResult:
        comm = CommResult()
        link = make_link(profile.link, virtual=True)
        link.virtual_s = 2.5
        threading.Timer(0.3, lambda: (comm.links.append(link), comm.done.set())).start()
        return comm

    virtual = SimulatedRuntime(profile, virtual=True, step_s=1.0)
    assert virtual.landed(comm_finishing_late(), steps_done=3)  # waits for the thread: landed by step 3
    assert not virtual.landed(comm_finishing_late(), steps_done=2)  # not yet at step 2
    assert not SimulatedRuntime(profile, virtual=False, step_s=1.0).landed(comm_finishing_late(), 3)


def test_an_actor_that_lags_across_rounds_keeps_its_snapshots_for_the_run():
    """One history per client for a whole run when its actor lags across rounds (so it may
    sample with an earlier round's weights); a fresh one per round otherwise; none without lag."""
    histories = []

    def real_app(msg, context):
        from fedrl.clients.runtime import current_runtime

        histories.append(current_runtime().actor_history())
        return Message(RecordDict(), reply_to=msg)

    across = {"name": "x", "actor_staleness": 4, "actor_lags_across_rounds": True}
    within = {"name": "x", "actor_staleness": 4}
    for profile, run in [(across, "r"), (across, "r"), (across, "s"), (within, "s"), (within, "s")]:
        simulated_client(_message(profile, run), _context(), real_app)
    simulated_client(_message({"name": "x"}), _context(), real_app)
    first, again, next_run, round_a, round_b, honest = histories
    first.push("round 1's last weights")
    assert again is first and again.get(0) == "round 1's last weights"
    assert next_run is not first and not next_run.snapshots  # a new run starts afresh
    assert round_a is not round_b and round_a.max_age == round_b.max_age == 4
    assert honest is None
