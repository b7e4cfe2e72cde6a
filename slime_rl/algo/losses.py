"""Policy-loss pieces. Pure tensor math, no state.

Shapes: B samples x T response tokens (right-padded), so every [B, T] tensor here lines up with
a `loss_mask` [B, T] that is 1 on trained tokens and 0 on padding / environment tokens.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of x over the tokens where mask is 1 (a scalar). The caller picks the denominator."""
    return (x * mask).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Token-level mean over masked tokens; denominator = mask.sum() (at least 1)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_clip: float,
                  eps_clip_high: float) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate, per token (clip-higher when eps_clip_high > eps_clip, as in DAPO).

    logp, old_logp, advantages: [B, T]. ratio r = exp(logp - old_logp);
    loss = -min(r * A, clip(r, 1 - eps_clip, 1 + eps_clip_high) * A).
    Returns (loss [B, T], clipped [B, T] float: 1 where the clipped branch was taken).
    No reduction: aggregate with the loss mask and the denominator the caller chooses.
    """
    ratio = torch.exp(logp - old_logp)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    return loss, (clipped < unclipped).float()


def kl_penalty(logp: Tensor, ref_logp: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi, [B, T] -> [B, T].

    With log r = ref_logp - logp (Schulman's estimators, http://joschu.net/blog/kl-approx.html):
      k1 = -log r;  k2 = (log r)^2 / 2;  k3 = r - 1 - log r (unbiased, >= 0).
    low_var_kl is k3 with log r clamped to [-20, 20] and the result to [-10, 10], as verl does,
    so one extreme token cannot dominate the loss.
    """
    log_ratio = ref_logp - logp
    if kind == "k1":
        return -log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.exp(log_ratio) - 1 - log_ratio
    if kind == "low_var_kl":
        lr = torch.clamp(log_ratio, -20, 20)
        return torch.clamp(torch.exp(lr) - 1 - lr, -10, 10)
    raise ValueError(f"unknown KL estimator {kind!r} (k1, k2, k3, low_var_kl)")
