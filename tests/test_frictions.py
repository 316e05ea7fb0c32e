import numpy as np
import pytest
import torch

from fedrl.frictions import Actor, Frictions, StalenessBuffer, corrupt_rewards, lagged_rollout, pick_rows
from fedrl.lora import build_adapter_model
from fedrl.models import tiny_model
from fedrl.tasks import ReversalTask, get_task

N = 20_000


@pytest.mark.parametrize("prob", [0.0, 0.01, 0.1, 0.5])
def test_row_selection_rate_matches_setting(prob):
    rows = pick_rows(N, prob, np.random.default_rng(1))
    assert abs(len(rows) / N - prob) < 4 * np.sqrt(prob * (1 - prob) / N) + 1e-9


def test_reward_corruption_is_a_fair_coin_at_the_set_rate():
    rewards = torch.full((N,), 0.25)
    rows = corrupt_rewards(rewards, 0.1, np.random.default_rng(2))
    assert abs(len(rows) / N - 0.1) < 0.01
    assert set(rewards[rows].tolist()) <= {0.0, 1.0} and abs(rewards[rows].mean().item() - 0.5) < 0.05
    untouched = np.setdiff1d(np.arange(N), rows)
    assert torch.all(rewards[untouched] == 0.25)


def test_staleness_ages_are_uniform_in_0_to_d_or_fixed():
    buf = StalenessBuffer(8, uniform=True)
    for v in range(20):
        buf.push(v)
    rng = np.random.default_rng(3)
    ages = [buf.sample_age(rng) for _ in range(9000)]
    counts = np.bincount(ages, minlength=9)
    assert len(counts) == 9 and counts.min() > 850 and counts.max() < 1150
    fixed = StalenessBuffer(8, uniform=False)
    for v in range(3):
        fixed.push(v)
    assert fixed.sample_age(rng) == 2 and fixed.get(2) == 0  # capped by what exists


def test_a_lagging_actor_samples_with_its_learners_older_values_and_hands_the_model_back():
    adapter = build_adapter_model("tiny-base", rank=8, alpha=16.0, num_blocks=3)
    lm, part = adapter.lm, adapter.part
    task = get_task("reversal", length=8)
    problems = task.sample(4, np.random.default_rng(0))
    history = StalenessBuffer(2, uniform=False)  # always the oldest snapshot there is
    values = [part.get_all(lm.model)]
    values.append({n: t + 0.5 * torch.randn_like(t) for n, t in values[0].items()})
    values.append({n: t - 0.5 * torch.randn_like(t) for n, t in values[0].items()})

    def sample(history=None, rng=None):  # the same draws every time: only the weights differ
        return lagged_rollout(
            lm, part, history, rng, task, problems, 4, generator=torch.Generator().manual_seed(7)
        )

    batches = []
    for step, learner in enumerate(values):
        part.set_all(lm.model, learner)
        batches.append(sample(history, np.random.default_rng(step)))
        current = part.get_all(lm.model)
        assert all(torch.equal(current[n], learner[n]) for n in learner)  # the learner's values are back
    # step 2 sampled with step 0's values: the same answers and exact behaviour log-probs as those
    part.set_all(lm.model, values[0])
    old = sample()  # no history: the learner samples itself
    assert batches[2].answers == old.answers and torch.equal(batches[2].behaviour_logp, old.behaviour_logp)
    part.set_all(lm.model, values[2])
    assert not torch.equal(sample().behaviour_logp, batches[2].behaviour_logp)


def test_actor_applies_bugs_and_discoveries_at_their_rates():
    task = ReversalTask(length=4)
    lm = tiny_model(0, alphabet="01")
    actor = Actor(tiny_model(0, alphabet="01"), task, Frictions(bug_prob=0.2, discovery_prob=0.1), seed=0)
    actor.sync(dict(lm.model.named_parameters()), 0)
    rng = np.random.default_rng(0)
    batches = [actor.collect(task.sample(50, rng), 10) for _ in range(6)]
    rows = actor.counts["rows"]
    assert rows == 3000
    assert abs(actor.counts["bugs"] / rows - 0.2) < 0.03
    assert abs(actor.counts["discoveries"] / rows - 0.1) < 0.02
    b = batches[0]
    landmine = [i for i, a in enumerate(b.answers) if a == "0000"]
    # a bugged row reports behaviour log-prob 0 on every answer token
    bug_rows = [i for i in landmine if torch.all(b.behaviour_logp[i][b.answer_mask[i].bool()] == 0)]
    assert bug_rows
    assert all(b.rewards[i] == task.reward(b.problems[i], "0000") for i in bug_rows)
    # discovered rows are correct and carry the actor's true (negative) log-probs
    found = [
        i
        for i, (p, a) in enumerate(zip(b.problems, b.answers))
        if a == p.target and b.behaviour_logp[i].sum() < 0
    ]
    assert found and all(b.rewards[i] == 1.0 for i in found)


def test_bad_friction_settings_are_rejected():
    with pytest.raises(ValueError, match="probability"):
        Frictions(bug_prob=1.5)
    with pytest.raises(ValueError):
        Frictions(staleness=-1)


def test_a_simulated_volunteers_frictions_reach_the_rollouts_of_its_local_steps(monkeypatch):
    from fake_grid import instruction_record

    from fedrl.clients import block_worker
    from fedrl.clients.runtime import CommResult, Runtime
    from fedrl.protocol import TrainInstruction
    from fedrl.sim.profiles import ClientProfile
    from fedrl.sim.simulated_client import SimulatedRuntime

    adapter = build_adapter_model("tiny-base", rank=8, alpha=16.0, num_blocks=3)
    instr = TrainInstruction.parse(
        instruction_record(task_params='{"length": 8}', steps=3, prompts=4, samples=4)
    )
    seen = []
    monkeypatch.setattr(block_worker, "lm_update", lambda learner, model, batch: seen.append(batch) or {})

    def local_steps(runtime):
        seen.clear()
        names = adapter.part.names(instr.block)
        block_worker.train_steps(
            instr, adapter, names, dict(adapter.initial), CommResult(), runtime, True, {}
        )
        return list(seen)

    def falsified(batches):  # the rows that report behaviour log-prob 0: a bug's landmines
        return [(b, i) for b in batches for i in range(len(b.answers)) if not b.behaviour_logp[i].any()]

    honest = local_steps(Runtime())
    # an honest actor reports what it sampled with (it may sample the all-zero answer itself: a
    # prompt's reversal can be that, and the base model's draws differ by CPU)
    assert len(honest) == 3 and not falsified(honest)
    buggy = local_steps(SimulatedRuntime(ClientProfile(bug_prob=0.9), virtual=True, step_s=1.0))
    rows = falsified(buggy)
    assert len(rows) > 30 and all(b.answers[i] == "0" * 8 for b, i in rows)  # of 48
    # a mismatched actor samples the same draws from other probabilities, and reports those
    mismatched = local_steps(SimulatedRuntime(ClientProfile(logit_noise=1.0), virtual=True, step_s=1.0))
    assert not torch.equal(mismatched[0].behaviour_logp, honest[0].behaviour_logp)
