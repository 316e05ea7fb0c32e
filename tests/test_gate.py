"""The verification gate on the real tiny model: harmful updates are refused before merging."""

import json

import pytest
import torch

from fedrl.lora import build_adapter_model
from fedrl.strategies.gate import VerificationGate
from fedrl.tasks import get_task


@pytest.fixture(scope="module")
def adapter():
    return build_adapter_model("tiny-base", rank=8, alpha=16.0, num_blocks=3)


def test_the_gate_refuses_a_harmful_update_and_passes_a_harmless_one(adapter):
    task = get_task("reversal", **json.loads('{"length": 8}'))
    gate = VerificationGate(adapter, task, problems=32, tolerance=0.05, seed=0)
    state = dict(adapter.initial)
    names = adapter.part.names(1)
    g = torch.Generator().manual_seed(0)
    # LoRA's B starts at zero, so the initial adapter is the base model: perturb A and B alike
    harmful = {n: 3.0 * torch.randn(state[n].shape, generator=g) for n in names}
    before, after, reason = gate.check(0, state, {n: torch.zeros_like(state[n]) for n in names})
    assert reason is None and after == before
    before2, after2, reason = gate.check(0, state, harmful)
    assert before2 == before and gate.scored == 3  # the global state's score is cached per version
    assert after2 < before - 0.05 and "probe reward" in reason, (before, after2)
    assert gate.cpu_s > 0
