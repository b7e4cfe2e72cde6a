"""Advantage estimators. Pure tensor math, no state; every output is detached.

Two layouts appear here:
- group layout: rewards [G, n], G prompts x n samples of each (GRPO, RLOO, REINFORCE++-baseline);
  flattened row-major, sample i of group g is row g * n + i of any [B, T] tensor (B = G * n).
- token layout: [B, T] right-padded response tokens with `mask` [B, T] (1 = trained token,
  0 = padding or environment/tool token). Masked positions are not time steps: returns and GAE
  carry across them undiscounted, and every output is 0 there.

Scalar-per-sample estimators (GRPO, RLOO) return [G, n]; the trainer broadcasts each value to the
sample's response tokens. Token-level ones (REINFORCE++, GAE) return [B, T].
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_rl.algo.whiten import masked_whiten


def _float(x: Tensor) -> Tensor:
    return x.detach().to(torch.float64 if x.dtype == torch.float64 else torch.float32)


def _check_group(rewards: Tensor) -> None:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [groups, n_samples], got shape {tuple(rewards.shape)}")


def grpo_advantages(rewards: Tensor, eps: float = 1e-6, normalize_std: bool = True) -> Tensor:
    """GRPO: each sample's reward minus its group's mean, divided by the group's std.

    rewards: [G, n] (G groups of n samples of the same prompt). Returns [G, n], one scalar per
    sample, later broadcast to its response tokens. std is the unbiased (n - 1) one, as in the
    GRPO paper's implementation; a group of equal rewards (or n = 1) gets advantage 0.
    normalize_std=False gives Dr.GRPO (mean-centred only).
    """
    _check_group(rewards)
    rewards = _float(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std or rewards.shape[1] == 1:
        return centred
    std = rewards.std(dim=1, keepdim=True, unbiased=True)
    return centred / (std + eps)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j, the leave-one-out baseline.

    rewards: [G, n]. Returns [G, n], one scalar per sample. Identity used:
    r_i - (sum - r_i) / (n - 1) = n / (n - 1) * (r_i - mean). n = 1 has no other sample: A = 0.
    """
    _check_group(rewards)
    rewards = _float(rewards)
    n = rewards.shape[1]
    if n == 1:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean(dim=1, keepdim=True)) * (n / (n - 1))


def last_valid_index(mask: Tensor) -> tuple[Tensor, Tensor]:
    """mask [B, T] -> (index [B] of each row's last valid token, has_valid [B] bool)."""
    valid = mask > 0
    t = mask.shape[1]
    idx = (t - 1) - valid.flip(1).to(torch.int64).argmax(dim=1)
    return idx, valid.any(dim=1)


def outcome_token_rewards(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Token-level rewards from one scalar reward per sample, with the KL penalty folded in.

    rewards: [B]; mask, kl: [B, T]. r_t = -kl_coef * kl_t on valid tokens, plus rewards[b] on the
    sample's last valid token (REINFORCE++ / PPO reward shaping). A fully masked sample has no
    token to hold its reward: its row is all 0 (it contributes no loss either). Returns [B, T].
    """
    r = _float(rewards)
    mask_f = mask.detach().to(r.dtype)
    out = torch.zeros_like(mask_f)
    if kl is not None:
        out = torch.where(mask_f > 0, -kl_coef * _float(kl).to(out.dtype), out)
    idx, has_valid = last_valid_index(mask)
    rows = torch.arange(mask.shape[0], device=mask.device)
    out[rows, idx] += r * has_valid.to(out.dtype)
    return out


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    """G_t = r_t + gamma * G_{t'}, t' the next valid token after t (0 past the last one).

    token_rewards, mask: [B, T]. Rewards on masked positions are ignored; masked positions carry
    the running return across undiscounted and read 0 in the output. Returns [B, T].
    """
    r = _float(token_rewards)
    m = _float(mask).to(r.dtype)
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in reversed(range(r.shape[1])):
        step = r[:, t] + gamma * running
        running = torch.where(m[:, t] > 0, step, running)
        out[:, t] = running * m[:, t]
    return out


def reinforce_plus_plus_advantages(rewards: Tensor, mask: Tensor, kl: Tensor | None = None, kl_coef: float = 0.0,
                                   gamma: float = 1.0, whiten: bool = True) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262): whitened discounted returns of token rewards.

    rewards: [B] scalar per sample; mask [B, T]; kl [B, T] per-token KL(pi_old || pi_ref) estimate
    (needs ref log-probs; None = no penalty). r_t = -kl_coef * kl_t, plus rewards[b] at the last
    valid token; G_t = sum_{k >= t} gamma^(k - t) r_k over valid tokens; A = (G - mean) / std with
    mean/std over all valid tokens of the batch (masked, unbiased std). Returns (A, G), both
    [B, T], 0 on masked positions. whiten=False returns (G, G): the trainer then whitens with
    global moments (`masked_moments` all-reduced over DP, then `masked_whiten`).
    """
    returns = discounted_returns(outcome_token_rewards(rewards, mask, kl, kl_coef), mask, gamma)
    advantages = masked_whiten(returns, mask) if whiten else returns.clone()
    return advantages, returns


def group_mean_baseline(rewards: Tensor) -> Tensor:
    """REINFORCE++-baseline's rollout half: each reward minus its group's mean.

    rewards: [G, n] -> [G, n], one scalar per sample (the RolloutManager computes it: only it sees
    whole groups; the trainer's batch is split by DP rank). n = 1 gives 0.
    """
    _check_group(rewards)
    r = _float(rewards)
    return r - r.mean(dim=1, keepdim=True)


def baseline_token_advantages(centred: Tensor, mask: Tensor, kl: Tensor | None = None,
                              kl_coef: float = 0.0) -> Tensor:
    """REINFORCE++-baseline's trainer half, before whitening: a_t = centred[b] - kl_coef * kl_t.

    centred: [B] (`group_mean_baseline`, flattened); mask, kl: [B, T]. The KL term as in slime
    (kl=None leaves it out); masked positions read 0 and their kl is never used. Returns [B, T].
    """
    r = _float(centred)
    m = _float(mask).to(r.dtype)
    adv = r.unsqueeze(1) * m
    if kl is not None:
        adv = torch.where(m > 0, adv - kl_coef * _float(kl).to(r.dtype), adv)
    return adv


def reinforce_plus_plus_baseline_advantages(rewards: Tensor, mask: Tensor, kl: Tensor | None = None,
                                            kl_coef: float = 0.0, whiten: bool = True) -> Tensor:
    """REINFORCE++-baseline: (reward - group mean) on every token, then global whitening.

    rewards: [G, n]; mask, kl: [G * n, T], sample i of group g on row g * n + i. Per token
    a_t = (r - mean_group(r)) - kl_coef * kl_t (the KL term as in slime; kl=None leaves it out),
    then whitened over all valid tokens of the batch (masked mean, unbiased std). n = 1 gives a
    zero baseline-subtracted reward (the group mean is the reward itself). Returns [G * n, T], 0 on
    masked positions; whiten=False leaves the whitening to the trainer (global moments).
    The run splits it: `group_mean_baseline` on the rollout side, `baseline_token_advantages` and
    the (global) whitening on the trainer side.
    """
    _check_group(rewards)
    if mask.shape[0] != rewards.numel():
        raise ValueError(f"mask has {mask.shape[0]} rows but rewards hold {rewards.numel()} samples")
    adv = baseline_token_advantages(group_mean_baseline(rewards).reshape(-1), mask, kl, kl_coef)
    return masked_whiten(adv, mask.to(adv.dtype)) if whiten else adv


def gae_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float,
                   lambd: float) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016) over valid tokens; right padding and masked tokens are skipped.

    rewards: [B, T] token rewards (see `outcome_token_rewards`); values: [B, T] critic values of
    the old policy; mask: [B, T]. With t' the next valid token after t (none: V = 0, A = 0):
    delta_t = r_t + gamma * V_{t'} - V_t;  A_t = delta_t + gamma * lambd * A_{t'};  R_t = A_t + V_t.
    Values and rewards on masked positions are never read, so padding may hold anything.
    Returns (advantages, returns), [B, T], 0 on masked positions; not whitened (PPO usually
    whitens A with `masked_whiten`, globally).
    """
    r = _float(rewards)
    v = _float(values).to(r.dtype)
    m = _float(mask).to(r.dtype)
    b, t_len = r.shape
    adv = torch.zeros_like(r)
    next_value = torch.zeros(b, dtype=r.dtype, device=r.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(t_len)):
        valid = m[:, t] > 0
        delta = r[:, t] + gamma * next_value - v[:, t]
        a_t = delta + gamma * lambd * next_adv
        next_adv = torch.where(valid, a_t, next_adv)
        next_value = torch.where(valid, v[:, t], next_value)
        adv[:, t] = torch.where(valid, a_t, torch.zeros_like(a_t))
    returns = torch.where(m > 0, adv + v, torch.zeros_like(adv))
    return adv, returns
