import numpy as np
import pytest
import torch

from fedrl.frictions import Actor, Frictions, StalenessBuffer, corrupt_rewards, pick_rows
from fedrl.models import tiny_model
from fedrl.tasks import ReversalTask

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
