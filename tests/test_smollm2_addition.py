"""The smollm2-addition scenario: LoRA RL of SmolLM2-135M on addition through the federation,
shrunk to a few steps of 2 clients (the accuracy itself is `fedrl sim`'s result, not a test's)."""

import json

import pytest
import torch
from cli_process import run_fedrl
from markers import needs_smollm2

from fedrl.clients.client_app import load_state
from fedrl.rollout import greedy_eval, rollout
from fedrl.sim.apps import client_app
from fedrl.sim.local_grid import LocalGrid
from fedrl.sim.scenario import load_scenario
from fedrl.sim.simulated_server import SimConfig, run_simulated
from fedrl.strategies.checkpoint import load_checkpoints
from fedrl.tasks import AdditionTask

pytestmark = needs_smollm2


def small_run(tmp_path):
    """The shipped scenario's settings and clients, with 2 clients, 2x2 rollouts, 1 step a round,
    held-out evals at the start and the end only."""
    scenario = load_scenario("smollm2-addition")
    cfg = scenario.config.replace(
        task_params=json.dumps({"max_answer_tokens": 12, "num_eval": 6}),
        prompts=2,
        samples=2,
        base_steps=1,
        max_steps=1,
        versions=3,
        buffer_size=1,
        min_nodes=2,
        eval_every=1000,  # the start and the end: what the assertions read (each eval is seconds here)
        final_eval_size=8,
        max_wall_s=0.0,
        out_dir=str(tmp_path / "run"),
    )
    profiles = json.loads(scenario.sim.profiles)[:2]
    return cfg, SimConfig(clock="virtual", step_s=1.0, profiles=json.dumps(profiles))


@pytest.mark.slow
def test_clients_hold_the_coordinators_global_state_bit_for_bit_and_the_adapter_exports(tmp_path):
    cfg, sim = small_run(tmp_path)
    grid = LocalGrid(2, client_app)
    summary = run_simulated(grid, cfg, sim)
    assert summary["versions"] >= 3 and summary["counts"]["accepted"] >= 3
    assert all("format_error" in e for e in summary["evals"])
    assert summary["final_set_eval"]["problems"] == 8

    published = {v: tensors for v, tensors, _ in load_checkpoints(tmp_path / "run" / "checkpoints")}
    held = [load_state(ctx.state) for ctx in grid.contexts.values()]
    synced = [s for s in held if s.held_version in published]
    assert synced, [s.held_version for s in held]
    for s in synced:  # what a client synced by patches is exactly what the coordinator published
        assert s.held.keys() == published[s.held_version].keys()
        assert all(torch.equal(s.held[n], published[s.held_version][n]) for n in s.held)

    # the exported adapter loads with plain transformers + peft and holds the final global state
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fedrl.models import smollm2_dir

    final = published[summary["versions"]]
    base = AutoModelForCausalLM.from_pretrained(smollm2_dir())
    model = PeftModel.from_pretrained(base, summary["adapter_dir"])
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], t) for n, t in final.items())
    # and `fedrl eval --adapter` alone (model, task and parameters from the adapter's record)
    # reproduces the coordinator's final held-out error
    done = run_fedrl("eval", "--adapter", summary["adapter_dir"])
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["greedy_error"] == summary["final_eval"]


def test_greedy_eval_tells_format_errors_from_wrong_sums():
    from fedrl.models import load_model

    lm, task = load_model("smollm2-135m"), AdditionTask(num_eval=8, max_answer_tokens=12)
    result = greedy_eval(lm, task)
    answers = rollout(lm, task, task.eval_problems(), greedy=True).answers
    assert result["format_error"] == sum(not task.is_well_formed(a) for a in answers) / 8
    wrong = sum(not task.is_correct(p, a) for p, a in zip(task.eval_problems(), answers))
    assert result["error"] == wrong / 8
    assert result["format_error"] <= result["error"]
