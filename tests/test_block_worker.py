import pytest
import torch

from fedrl.clients.block_worker import block_correction, overlap_seconds
from fedrl.protocol import ProtocolError, TrainInstruction, TrainReport
from fedrl.strategies.run_config import RunConfig


def test_block_correction_rebases_own_block_and_takes_global_elsewhere():
    local = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([5.0])}
    base = {"a": torch.tensor([0.5, 1.0])}  # block a's values when compute started
    new_global = {"a": torch.tensor([10.0, 20.0]), "b": torch.tensor([7.0])}
    corrected, new_base = block_correction(local, base, new_global, ["a"])
    assert torch.equal(corrected["b"], torch.tensor([7.0]))
    assert torch.equal(corrected["a"], torch.tensor([10.5, 21.0]))  # global + local progress
    assert torch.equal(new_base["a"], new_global["a"])
    # the delta reported later is exactly the local progress
    assert torch.equal(corrected["a"] - new_base["a"], local["a"] - base["a"])


def test_overlap_seconds():
    assert overlap_seconds((0, 4), (1, 2)) == 1
    assert overlap_seconds((0, 1), (2, 3)) == 0
    assert overlap_seconds((0, 3), (2, 5)) == 1


def _instruction(**kw):
    base = dict(action="train", mode="parablock", block=0, steps=2, version=0, store_url="http://127.0.0.1:1",
                principal="node-1", token="t", public_key="", model="tiny-base", task="reversal", task_params="{}",
                num_blocks=3, lora_rank=8, lora_alpha=16.0, lr=1e-3, prompts=2, samples=2, method="dg", seed=0,
                client_id=0, num_clients=1)
    base.update(kw)
    return base


def test_instruction_round_trip_and_validation():
    instr = TrainInstruction.from_record(_instruction())
    assert TrainInstruction.from_record(instr.to_record()) == instr
    with pytest.raises(ProtocolError, match="missing field"):
        TrainInstruction.from_record({k: v for k, v in _instruction().items() if k != "block"})
    with pytest.raises(ProtocolError, match="must be int"):
        TrainInstruction.from_record(_instruction(steps="many"))
    with pytest.raises(ProtocolError, match="does not fit"):
        TrainInstruction.from_record(_instruction(block=5))
    with pytest.raises(ProtocolError, match="does not fit"):
        TrainInstruction.from_record(_instruction(mode="fedavg-lora", block=0))
    with pytest.raises(ProtocolError):
        TrainInstruction.from_record(_instruction(mode="gossip"))
    with pytest.raises(ProtocolError, match="JSON"):
        TrainInstruction.from_record(_instruction(task_params="{not json"))


def test_report_rejects_a_bad_upload_key():
    fields = dict(upload_key="xyz", upload_block=0, upload_base_version=0, upload_samples=1, synced_version=0,
                  reward=0.0, loss=0.0, gate_mean=0.0, steps=1, compute_s=0.0, comm_s=0.0, overlap_s=0.0,
                  duration_s=0.0, bytes_up=0, bytes_down=0, staleness=0)
    with pytest.raises(ProtocolError, match="SHA-256"):
        TrainReport.from_record(fields)


def test_run_config_from_flower_style_keys_and_errors():
    cfg = RunConfig.from_mapping({"mode": "block-sequential", "buffer-size": 4, "sync": True})
    assert cfg.buffer_size == 4 and cfg.sync
    with pytest.raises(ProtocolError, match="unknown run config"):
        RunConfig.from_mapping({"num-server-rounds": 3})
    with pytest.raises(ProtocolError):
        RunConfig.from_mapping({"versions": 0})
    with pytest.raises(ProtocolError):
        RunConfig.from_mapping({"profiles": "[1, 2]"})
