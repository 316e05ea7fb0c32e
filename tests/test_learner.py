import numpy as np
import pytest
import torch

from fedrl.frictions import Actor, Frictions
from fedrl.learner import Learner, LearnerConfig, lm_update
from fedrl.losses import PGBatch
from fedrl.models import TINY_MODELS, tiny_model
from fedrl.rollout import greedy_error, rollout, token_logprobs
from fedrl.tasks import ReversalTask


@pytest.mark.parametrize("spec", sorted(TINY_MODELS))
def test_rollouts_are_seeded_and_record_actor_logprobs(spec):
    lm, task = TINY_MODELS[spec](0, alphabet="01"), ReversalTask(length=5)
    probs = task.sample(4, np.random.default_rng(0))
    a = rollout(lm, task, probs, 3, generator=torch.Generator().manual_seed(5))
    b = rollout(lm, task, probs, 3, generator=torch.Generator().manual_seed(5))
    assert a.answers == b.answers and torch.equal(a.behaviour_logp, b.behaviour_logp)
    assert a.group.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert all(set(ans) <= {"0", "1"} and len(ans) == 5 for ans in a.answers)  # constrained decoding
    recomputed = token_logprobs(lm.model, a.input_ids, a.attention_mask, a.allowed)
    mask = a.answer_mask.bool()
    assert torch.allclose(recomputed[mask], a.behaviour_logp[mask], atol=1e-5)


@pytest.mark.parametrize("spec", sorted(TINY_MODELS))
def test_a_shared_prompt_computed_once_gives_the_same_logprobs_and_gradients(spec):
    lm, task = TINY_MODELS[spec](0, alphabet="01"), ReversalTask(length=6)
    batch = rollout(lm, task, task.sample(3, np.random.default_rng(1)), 4, generator=torch.Generator())
    batch.input_ids[5, 2] = 5  # one row's prompt differs from its group's: it gets its own prefix
    logps, grads = [], []
    for shared in (0, batch.answer_start):
        lm.model.zero_grad()
        logp = token_logprobs(lm.model, batch.input_ids, batch.attention_mask, batch.allowed, shared)
        (logp * batch.answer_mask).sum().backward()
        logps.append(logp.detach())
        grads.append([p.grad.clone() for p in lm.model.parameters()])
    assert torch.allclose(*logps, atol=1e-5)
    assert all(torch.allclose(a, b, atol=1e-4, rtol=1e-4) for a, b in zip(*grads))


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


@pytest.mark.parametrize("spec", sorted(TINY_MODELS))
def test_short_dg_reversal_run_lowers_the_error(spec):
    torch.manual_seed(0)
    task = ReversalTask(length=3, num_symbols=2)
    lm = TINY_MODELS[spec](0, alphabet="01")
    learner = Learner(list(lm.model.parameters()), LearnerConfig("dg", lr=1e-3))
    actor = Actor(TINY_MODELS[spec](0, alphabet="01"), task, Frictions(), seed=0)
    rng = np.random.default_rng(0)
    before = greedy_error(lm, task)
    for step in range(120):
        actor.sync(dict(lm.model.named_parameters()), step)
        lm_update(learner, lm.model, actor.collect(task.sample(10, rng), 10))
    after = greedy_error(lm, task)
    assert before >= 0.5 and after <= 0.25, (before, after)
