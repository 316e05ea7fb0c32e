import numpy as np
import pytest
import torch

from fedrl.frictions import Actor, Frictions
from fedrl.learner import Learner, LearnerConfig, lm_update
from fedrl.losses import PGBatch
from fedrl.models import tiny_model
from fedrl.rollout import greedy_error, rollout
from fedrl.tasks import ReversalTask


def test_rollouts_are_seeded_and_record_actor_logprobs():
    lm, task = tiny_model(0, alphabet="01"), ReversalTask(length=5)
    probs = task.sample(4, np.random.default_rng(0))
    a = rollout(lm, task, probs, 3, generator=torch.Generator().manual_seed(5))
    b = rollout(lm, task, probs, 3, generator=torch.Generator().manual_seed(5))
    assert a.answers == b.answers and torch.equal(a.behaviour_logp, b.behaviour_logp)
    assert a.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(set(ans) <= {"0", "1"} and len(ans) == 5 for ans in a.answers)  # constrained decoding
    from fedrl.rollout import token_logprobs

    recomputed = token_logprobs(lm.model, a.input_ids, a.attention_mask, a.allowed)
    mask = a.answer_mask.bool()
    assert torch.allclose(recomputed[mask], a.behaviour_logp[mask], atol=1e-5)


def test_learner_step_changes_only_trainable_params_and_reports_metrics():
    lm = tiny_model(0, alphabet="01")
    for name, p in lm.model.named_parameters():
        p.requires_grad_("layers.2" in name)
    frozen = {n: p.clone() for n, p in lm.model.named_parameters() if not p.requires_grad}
    learner = Learner(list(lm.model.parameters()), LearnerConfig("dg"))
    task = ReversalTask(length=4)
    actor = Actor(tiny_model(0, alphabet="01"), task, Frictions(), seed=1)
    actor.sync(dict(lm.model.named_parameters()), 0)
    metrics = lm_update(learner, lm.model, actor.collect(task.sample(8, np.random.default_rng(0)), 8))
    assert {"loss", "reward", "gate_mean", "surprisal_mean", "surprisal_max", "grad_norm"} <= set(metrics)
    assert all(torch.equal(p, frozen[n]) for n, p in lm.model.named_parameters() if n in frozen)


def test_non_finite_loss_is_refused():
    p = torch.nn.Parameter(torch.zeros(1))
    learner = Learner([p], LearnerConfig("reinforce"))
    logp = (p * 0 + float("nan")).expand(2, 1)
    with pytest.raises(FloatingPointError):
        learner.update(
            PGBatch(logp, torch.tensor([1.0, 0.0]), torch.zeros(2, dtype=torch.long), torch.ones(2, 1))
        )
    assert p.item() == 0.0
    with pytest.raises(ValueError, match="unknown method"):
        LearnerConfig("sgd-magic")


def test_short_dg_reversal_run_lowers_the_error():
    torch.manual_seed(0)
    task = ReversalTask(length=3, num_symbols=2)
    lm = tiny_model(0, alphabet="01")
    learner = Learner(list(lm.model.parameters()), LearnerConfig("dg", lr=1e-3))
    actor = Actor(tiny_model(0, alphabet="01"), task, Frictions(), seed=0)
    rng = np.random.default_rng(0)
    before = greedy_error(lm, task)
    for step in range(120):
        actor.sync(dict(lm.model.named_parameters()), step)
        lm_update(learner, lm.model, actor.collect(task.sample(10, rng), 10))
    after = greedy_error(lm, task)
    assert before >= 0.5 and after <= 0.25, (before, after)
