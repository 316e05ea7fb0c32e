import numpy as np
import pytest
import torch

from fedrl.frictions import Actor, Frictions
from fedrl.learner import Learner, LearnerConfig, lm_update, micro_batches
from fedrl.losses import PGBatch
from fedrl.models import TINY_MODELS, tiny_model
from fedrl.rollout import greedy_error, rollout, score, token_logprobs
from fedrl.strategies.run_config import RunConfig
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


@pytest.mark.parametrize("samples", [4, 1])
@pytest.mark.parametrize("spec", sorted(TINY_MODELS))
def test_scoring_only_the_answer_gives_the_same_logprobs_and_gradients(spec, samples):
    """With the prompt's width given, a prompt shared by S samples runs once (S > 1) and no
    prompt column is projected to the vocabulary; answers score exactly as in the full pass."""
    lm, task = TINY_MODELS[spec](0, alphabet="01"), ReversalTask(length=6)
    batch = rollout(lm, task, task.sample(3, np.random.default_rng(1)), samples, generator=torch.Generator())
    if samples > 1:
        batch.input_ids[5, 2] = 5  # one row's prompt differs from its group's: it gets its own prefix
    logps, grads = [], []
    for width in (0, batch.answer_start):
        lm.model.zero_grad()
        logp = token_logprobs(lm.model, batch.input_ids, batch.attention_mask, batch.allowed, width)
        (logp * batch.answer_mask).sum().backward()
        logps.append(logp.detach())
        grads.append([p.grad.clone() for p in lm.model.parameters()])
    answer = batch.answer_mask.bool()
    assert torch.allclose(logps[0][answer], logps[1][answer], atol=1e-5)
    assert not logps[1][:, : batch.answer_start].any()  # the prompt is not scored
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


def test_answers_sampled_at_a_temperature_are_scored_at_that_temperature():
    lm, task = tiny_model(0, alphabet="01"), ReversalTask(length=5)
    batch = rollout(
        lm, task, task.sample(4, np.random.default_rng(0)), 3, generator=torch.Generator(), temperature=0.5
    )
    assert batch.temperature == 0.5
    mask = batch.answer_mask.bool()
    args = (lm.model, batch.input_ids, batch.attention_mask, batch.allowed, batch.answer_start)
    assert torch.allclose(token_logprobs(*args, temperature=0.5)[mask], batch.behaviour_logp[mask], atol=1e-5)
    assert not torch.allclose(token_logprobs(*args)[mask], batch.behaviour_logp[mask], atol=1e-3)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        rollout(lm, task, task.sample(1, np.random.default_rng(0)), temperature=0.0)


@pytest.mark.parametrize("method", ["dg", "ppo"])
def test_micro_batches_of_whole_groups_take_the_same_step_as_the_whole_batch(method):
    """Gradient accumulation: the step's gradient (and its metrics) equals the one-pass step's.
    Compared before Adam: its first step is about lr * sign(g), so an entry whose gradient is
    float noise may step either way, more on some CPUs' kernels than others."""
    task = ReversalTask(length=4)
    batch = rollout(tiny_model(0, alphabet="01"), task, task.sample(5, np.random.default_rng(2)), 4)
    batch = score(task, batch)
    assert [len(c) for c in micro_batches(batch.group, 9)] == [8, 8, 4]  # groups of 4 are never cut
    assert [len(c) for c in micro_batches(batch.group, 3)] == [4] * 5  # a group bigger than the size: alone
    steps = []
    for micro in (0, 8):
        lm = tiny_model(0, alphabet="01")
        learner = Learner(list(lm.model.parameters()), LearnerConfig(method, micro_batch=micro))
        metrics = lm_update(learner, lm.model, batch)  # the accumulated gradient stays in .grad
        steps.append((metrics, [p.grad.detach().clone() for p in lm.model.parameters()]))
    (whole, grad_whole), (micro, grad_micro) = steps
    scale = max(float(g.abs().max()) for g in grad_whole)
    assert scale > 0 and all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-5 * scale) for a, b in zip(grad_whole, grad_micro)
    )
    assert whole.keys() == micro.keys()
    assert all(abs(whole[k] - micro[k]) < 1e-5 * max(1.0, abs(whole[k])) for k in whole)


def test_a_learner_restored_from_its_moments_takes_the_step_an_unbroken_one_takes():
    """keep_optimizer_state: a round's Adam continued from the last round's moments steps bit for
    bit as one Adam that never stopped; moments that do not fit a parameter start it fresh."""

    def batch(p: torch.nn.Parameter, rewards: list[float]) -> PGBatch:
        logp = torch.log_softmax(p, dim=-1)[:, :1].expand(4, 1)
        return PGBatch(logp, torch.tensor(rewards), torch.zeros(4, dtype=torch.long), torch.ones(4, 1))

    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    unbroken = torch.nn.Parameter(torch.arange(6.0).reshape(1, 6) / 7)
    learner = Learner([unbroken], LearnerConfig("reinforce", lr=0.1))
    for r in rewards:
        learner.update(batch(unbroken, r))

    split = torch.nn.Parameter(torch.arange(6.0).reshape(1, 6) / 7)
    moments = {}
    for r in rewards:  # a fresh learner each "round", as a node makes one
        round_learner = Learner([split], LearnerConfig("reinforce", lr=0.1))
        round_learner.restore_moments(["w"], moments)
        round_learner.update(batch(split, r))
        moments = round_learner.moments(["w"])
    assert torch.equal(split, unbroken)
    assert set(moments) == {"w:step", "w:exp_avg", "w:exp_avg_sq"} and float(moments["w:step"]) == 3

    fresh = torch.nn.Parameter(torch.zeros(2, 3))
    restarted = Learner([fresh], LearnerConfig("reinforce"))
    restarted.restore_moments(["w"], moments)  # the moments of a (1, 6) tensor do not fit (2, 3)
    assert restarted.moments(["w"]) == {}
    with pytest.raises(ValueError, match="2 names for 1 trainable parameters"):
        restarted.moments(["w", "v"])


@pytest.mark.parametrize(
    "method, params",
    [("dg", {"eta": 0.0}), ("ppo", {"eps": 0.05}), ("decoupled_ppo", {"eps": 0.05}), ("reinforce", {})],
)
def test_a_runs_gate_temperature_and_clip_reach_their_own_loss_and_no_other(method, params):
    """`dg_eta` and `ppo_clip` of a run config travel in every instruction (`LearnerSettings`)
    and become the learner's loss parameters: the step is the one the loss takes with them, not
    its default's, and a setting of one method is no error in another's run."""
    config = LearnerConfig.of(RunConfig.parse({"method": method, "dg_eta": 0.0, "ppo_clip": 0.05}))
    assert (config.method, config.loss_params) == (method, params)
    task = ReversalTask(length=4)
    actor = tiny_model(1, alphabet="01")  # another policy's answers: PPO's ratios are not all 1
    batch = score(task, rollout(actor, task, task.sample(4, np.random.default_rng(1)), 4))
    steps = []
    same = {"lr": config.lr, "micro_batch": config.micro_batch}
    by_hand = LearnerConfig(method, loss_params=params, **same)
    for learner_config in (config, by_hand, LearnerConfig(method, **same)):
        lm = tiny_model(0, alphabet="01")
        metrics = lm_update(Learner(list(lm.model.parameters()), learner_config), lm.model, batch)
        steps.append((metrics, [p.detach().clone() for p in lm.model.parameters()]))
    (ours, after), (theirs, after_by_hand), (_, after_default) = steps
    assert ours == theirs and all(torch.equal(a, b) for a, b in zip(after, after_by_hand))
    if method in ("dg", "ppo"):  # decoupled PPO's first step is at ratio 1, whatever its clip
        assert not all(torch.equal(a, b) for a, b in zip(after, after_default))


def test_a_gate_temperature_or_clip_out_of_range_is_refused_by_name():
    with pytest.raises(ValueError, match="dg_eta must be a finite number >= 0"):
        RunConfig.parse({"dg_eta": -0.5})
    with pytest.raises(ValueError, match="ppo_clip must be in \\(0, 1\\)"):
        RunConfig.parse({"ppo_clip": 1.5})
