import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedrl.losses import (
    PGBatch,
    decoupled_ppo_loss,
    delight_gate,
    dg_loss,
    grouped_advantage,
    iw_pg_loss,
    ppo_loss,
    reinforce_loss,
)


def tiny_case():
    # two prompts x two samples, two answer tokens each; row 3's second token is padding
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.8, 0.9], [0.1, 0.5], [0.6, 1.0]])).requires_grad_()
    rewards = torch.tensor([1.0, 0.0, 0.5, 1.5])
    group = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]])
    behaviour = torch.log(torch.tensor([[0.4, 0.25], [0.8, 0.6], [0.2, 0.5], [0.6, 1.0]]))
    return PGBatch(logp, rewards, group, mask, behaviour)


def test_grouped_advantage_subtracts_group_mean_only():
    adv = grouped_advantage(torch.tensor([1.0, 0.0, 0.5, 1.5]), torch.tensor([0, 0, 1, 1]))
    assert torch.allclose(adv, torch.tensor([0.5, -0.5, -0.5, 0.5]))


def test_dg_loss_matches_hand_computation():
    b = tiny_case()
    adv = torch.tensor([0.5, -0.5, -0.5, 0.5])
    total, n = 0.0, 7
    for i in range(4):
        for t in range(2):
            if b.mask[i, t]:
                lp = b.logp[i, t].item()
                w = 1 / (1 + math.exp(-(adv[i].item() * -lp)))
                total += w * adv[i].item() * lp
    loss, metrics = dg_loss(b)
    assert loss.item() == pytest.approx(-total / n, rel=1e-6)
    assert 0 < metrics["gate_mean"] < 1


def test_gate_is_detached_gradient_uses_w_as_a_constant():
    b = tiny_case()
    loss, _ = dg_loss(b)
    (grad,) = torch.autograd.grad(loss, b.logp)
    adv = grouped_advantage(b.rewards, b.group)[:, None]
    w = torch.sigmoid(adv * -b.logp.detach())
    expected = -(w * adv * b.mask) / b.mask.sum()
    assert torch.allclose(grad, expected, atol=1e-7)


def test_eta_to_infinity_is_half_the_pg_gradient():
    b = tiny_case()
    (g_dg,) = torch.autograd.grad(dg_loss(b, eta=1e12)[0], b.logp)
    (g_pg,) = torch.autograd.grad(reinforce_loss(b)[0], b.logp)
    assert torch.allclose(g_dg, 0.5 * g_pg, atol=1e-7)


def test_eta_zero_is_a_hard_threshold():
    adv = torch.tensor([[0.5], [-0.5], [0.0]])
    surprisal = torch.tensor([[2.0], [2.0], [2.0]])
    assert delight_gate(adv, surprisal, eta=0).flatten().tolist() == [1.0, 0.0, 0.0]
    assert torch.allclose(delight_gate(adv, surprisal, eta=1e-6), torch.tensor([[1.0], [0.0], [0.5]]))


@settings(max_examples=50, deadline=None)
@given(st.floats(0.01, 0.99), st.floats(-1, 1))
def test_rare_failures_are_suppressed_like_pi_to_the_u(prob, u):
    # a failure (U < 0) at probability pi gets w <= pi**|U|/eta
    w = delight_gate(torch.tensor([-abs(u)]), -torch.log(torch.tensor([prob])), eta=1.0).item()
    assert w <= prob ** abs(u) + 1e-6


def test_reinforce_and_iw_pg_hand_values():
    b = tiny_case()
    adv = torch.tensor([0.5, -0.5, -0.5, 0.5])[:, None]
    pg = -(adv * b.logp.detach() * b.mask).sum() / 7
    assert reinforce_loss(b)[0].item() == pytest.approx(pg.item(), rel=1e-6)
    ratio = torch.exp(b.logp.detach() - b.behaviour_logp)
    iw = -(ratio * adv * b.logp.detach() * b.mask).sum() / 7
    assert iw_pg_loss(b)[0].item() == pytest.approx(iw.item(), rel=1e-6)
    capped = -(ratio.clamp(max=1.1) * adv * b.logp.detach() * b.mask).sum() / 7
    assert iw_pg_loss(b, cap=1.1)[0].item() == pytest.approx(capped.item(), rel=1e-6)


def test_ppo_clip_hand_value():
    b = tiny_case()
    adv = torch.tensor([0.5, -0.5, -0.5, 0.5])[:, None]
    r = torch.exp(b.logp.detach() - b.behaviour_logp)
    per_token = torch.maximum(-adv * r, -adv * r.clamp(0.8, 1.2))
    # row 0 token 0: r = 1.25, U > 0 -> clipped to 1.2; row 2 token 0: r = 0.5, U < 0 -> clipped at 0.8
    assert per_token[0, 0].item() == pytest.approx(-0.5 * 1.2)
    assert per_token[2, 0].item() == pytest.approx(0.5 * 0.8)
    assert ppo_loss(b)[0].item() == pytest.approx(((per_token * b.mask).sum() / 7).item(), rel=1e-6)


def test_decoupled_ppo_masks_tokens_over_the_cap_and_weights_by_prox_over_behav():
    b = tiny_case()
    # row 1 token 1: behaviour 0.6 vs prox 0.9 -> weight 1.5; with cap 1.4 that token is masked
    loss, metrics = decoupled_ppo_loss(b, cap=1.4)
    adv = torch.tensor([0.5, -0.5, -0.5, 0.5])[:, None]
    weight = torch.exp(b.logp.detach() - b.behaviour_logp)
    keep = b.mask * (weight <= 1.4)
    expected = ((-adv * weight) * keep).sum() / keep.sum()  # ratio to prox is exactly 1 here
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
    assert metrics["masked_frac"] == pytest.approx(1 / 7)
    with pytest.raises(ValueError, match="behaviour"):
        decoupled_ppo_loss(PGBatch(b.logp, b.rewards, b.group, b.mask))


def test_dg_learns_a_two_armed_bandit():
    torch.manual_seed(0)
    logits = torch.zeros(2, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.05)
    for _ in range(300):
        probs = torch.softmax(logits, 0)
        action = torch.multinomial(probs.detach(), 32, replacement=True)
        reward = (action == 1).float() * 0.8 + torch.rand(32) * 0.2  # arm 1 is better
        logp = torch.log_softmax(logits, 0)[action][:, None]
        loss, _ = dg_loss(PGBatch(logp, reward, torch.zeros(32, dtype=torch.long), torch.ones(32, 1)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.softmax(logits, 0)[1] > 0.95
