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


def _message(profile: dict) -> Message:
    content = RecordDict(
        {
            "instruction": ConfigRecord(INSTRUCTION),
            STAMP: ConfigRecord(
                Stamp(profile=json.dumps(profile), clock="virtual", step_s=1.0, now_s=0.0).to_record()
            ),
        }
    )
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
