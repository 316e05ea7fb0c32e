"""Policy-gradient losses as pure functions over token log-probs.

Shapes: `logp` (B, T) learner log-probs (differentiable), `behaviour_logp` (B, T) what the
actor reported, `rewards` (B,), `group` (B,) prompt ids for the grouped baseline, `mask`
(B, T) 1 on scored answer tokens. Every loss is a token-mean over the masked tokens and
returns (loss, metrics). The advantage is per sequence, broadcast to its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PGBatch:
    logp: torch.Tensor
    rewards: torch.Tensor
    group: torch.Tensor
    mask: torch.Tensor
    behaviour_logp: torch.Tensor | None = None


def grouped_advantage(rewards: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
    """U_i = r_i - mean of r over i's group (no division by the std), detached."""
    rewards = rewards.detach().float()
    _, inverse = torch.unique(group, return_inverse=True)
    sums = torch.zeros(int(inverse.max()) + 1).index_add_(0, inverse, rewards)
    counts = torch.zeros_like(sums).index_add_(0, inverse, torch.ones_like(rewards))
    return rewards - (sums / counts)[inverse]


def delight_gate(
    advantage: torch.Tensor, surprisal: torch.Tensor, eta: float = 1.0, lam: float = 0.0
) -> torch.Tensor:
    """w = sigmoid((U * surprisal - lam) / eta), detached; eta = 0 is the hard gate 1[chi > lam]."""
    chi = (advantage * surprisal).detach()
    if eta == 0:
        return (chi > lam).float()
    return torch.sigmoid((chi - lam) / eta)


def _token_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.float()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _require_behaviour(batch: PGBatch, name: str) -> torch.Tensor:
    if batch.behaviour_logp is None:
        raise ValueError(f"{name} needs the actor's behaviour log-probs")
    return batch.behaviour_logp.detach()


def dg_loss(batch: PGBatch, eta: float = 1.0, lam: float = 0.0) -> tuple[torch.Tensor, dict]:
    """Delightful Policy Gradient: the PG term gated per token by sigmoid(U * surprisal / eta).

    The surprisal is under the learner's current policy; no behaviour probabilities."""
    adv = grouped_advantage(batch.rewards, batch.group)[:, None]
    surprisal = -batch.logp.detach()
    gate = delight_gate(adv, surprisal, eta, lam)
    loss = -_token_mean(gate * adv * batch.logp, batch.mask)
    return loss, {"gate_mean": _token_mean(gate, batch.mask).item()}


def reinforce_loss(batch: PGBatch) -> tuple[torch.Tensor, dict]:
    """Plain REINFORCE with the grouped baseline, no off-policy correction."""
    adv = grouped_advantage(batch.rewards, batch.group)[:, None]
    return -_token_mean(adv * batch.logp, batch.mask), {}


def iw_pg_loss(batch: PGBatch, cap: float | None = None) -> tuple[torch.Tensor, dict]:
    """Token-level importance-weighted PG: gradient rho * U * grad log pi, rho = pi/pi_behav (capped)."""
    behaviour = _require_behaviour(batch, "iw_pg")
    adv = grouped_advantage(batch.rewards, batch.group)[:, None]
    ratio = torch.exp(batch.logp.detach() - behaviour)
    if cap is not None:
        ratio = ratio.clamp(max=cap)
    loss = -_token_mean(ratio * adv * batch.logp, batch.mask)
    return loss, {"ratio_mean": _token_mean(ratio, batch.mask).item()}


def ppo_loss(batch: PGBatch, eps: float = 0.2) -> tuple[torch.Tensor, dict]:
    """PPO-clip around the behaviour policy: max(-U r, -U clip(r, 1-eps, 1+eps))."""
    behaviour = _require_behaviour(batch, "ppo")
    adv = grouped_advantage(batch.rewards, batch.group)[:, None]
    ratio = torch.exp(batch.logp - behaviour)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    clipped = ((ratio - 1).abs() > eps).float()
    return _token_mean(surrogate, batch.mask), {"clip_frac": _token_mean(clipped, batch.mask).item()}


def decoupled_ppo_loss(
    batch: PGBatch, proximal_logp: torch.Tensor | None = None, eps: float = 0.2, cap: float = 5.0
) -> tuple[torch.Tensor, dict]:
    """AReaL's decoupled PPO: the trust region is around the learner's proximal policy, and the
    behaviour weight pi_prox / pi_behav is a constant; tokens whose weight exceeds `cap` are masked.

    `proximal_logp` defaults to the learner's log-probs at the start of this step (detached).
    """
    behaviour = _require_behaviour(batch, "decoupled_ppo")
    prox = batch.logp.detach() if proximal_logp is None else proximal_logp.detach()
    adv = grouped_advantage(batch.rewards, batch.group)[:, None]
    behav_weight = torch.exp(prox - behaviour)
    keep = batch.mask.float() * (behav_weight <= cap).float()
    ratio = torch.exp(batch.logp - prox)
    surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps)) * behav_weight
    masked = 1 - _token_mean(keep, batch.mask).item()
    return _token_mean(surrogate, keep), {"masked_frac": masked}


LOSSES = {
    "dg": dg_loss,
    "reinforce": reinforce_loss,
    "iw_pg": iw_pg_loss,
    "ppo": ppo_loss,
    "decoupled_ppo": decoupled_ppo_loss,
}
