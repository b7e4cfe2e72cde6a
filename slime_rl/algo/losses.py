"""Policy- and value-loss pieces. Pure tensor math, no state.

Shapes: B samples x T response tokens (right-padded), so every [B, T] tensor here lines up with
a `loss_mask` [B, T] that is 1 on trained tokens and 0 on padding / environment tokens.
Per-token functions do no reduction: aggregate with `slime_rl.algo.aggregate` and the
denominator the trainer chooses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from slime_rl.algo.aggregate import aggregate
from slime_rl.algo.kl import kl_penalty

__all__ = ["PPO_LOG_RATIO_CLAMP", "ClipFractions", "clip_fractions", "entropy_from_logits", "explained_variance",
           "kl_penalty", "log_ratio", "masked_mean", "masked_sum", "ppo_clip_loss", "ppo_kl",
           "value_loss"]


def masked_sum(x: Tensor, mask: Tensor) -> Tensor:
    """Sum of x over the tokens where mask is 1 (a scalar). The caller picks the denominator."""
    return (x * mask).sum()


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Token-level mean over masked tokens; denominator = mask.sum() (at least 1)."""
    return (x * mask).sum() / mask.sum().clamp(min=1)


# The log-ratio log(pi / pi_old) is clamped before exp, as verl does (verl/trainer/ppo/core_algos.py:
# compute_policy_loss_vanilla clamps it to [-20, 20]; compute_policy_loss_gspo clamps the sequence
# log-ratio at 10 from above, GSPO_LOG_RATIO_MAX in algo/gspo.py): a stale or corrupted old log-prob
# then gives a large finite ratio (e^20 ~ 5e8) instead of inf/nan. Within the bound the clamp is the
# identity, value and gradient alike, so training whose ratios stay in range is unchanged.
PPO_LOG_RATIO_CLAMP = 20.0


def log_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    """log(pi / pi_old) per token, clamped to [-PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP] (no gradient outside)."""
    return torch.clamp(logp - old_logp, -PPO_LOG_RATIO_CLAMP, PPO_LOG_RATIO_CLAMP)


def _check_dual_clip(eps_clip_c: float | None) -> None:
    if eps_clip_c is not None and eps_clip_c <= 1.0:
        raise ValueError(f"--eps-clip-c (dual-clip lower bound) must be > 1.0, got {eps_clip_c}")


def ppo_clip_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_clip: float,
                  eps_clip_high: float, eps_clip_c: float | None = None) -> tuple[Tensor, Tensor]:
    """PPO clipped surrogate, per token (clip-higher when eps_clip_high > eps_clip, as in DAPO).

    logp, old_logp, advantages: [B, T]. ratio r = exp(logp - old_logp), the log-ratio clamped to
    [-20, 20] first (`log_ratio`, verl's bound);
    loss = -min(r * A, clip(r, 1 - eps_clip, 1 + eps_clip_high) * A).
    Dual clip (Ye et al. 2020, arXiv 1912.09729; verl's clip_ratio_c), when eps_clip_c = c > 1:
    for A < 0 the loss is further capped, loss = min(loss, -c * A), so a token whose ratio ran far
    above 1 cannot push an unbounded loss; tokens with A >= 0 are unchanged.
    Returns (loss [B, T], clipped [B, T] float: 1 where the (1 +/- eps) clipped branch was taken;
    `clip_fractions` splits it and counts the dual-clip tokens).
    No reduction: aggregate with the loss mask and the denominator the caller chooses.
    """
    _check_dual_clip(eps_clip_c)
    ratio = torch.exp(log_ratio(logp, old_logp))
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    if eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, (clipped < unclipped).float()


class ClipFractions(NamedTuple):
    """Per-token 0/1 indicators [B, T]; aggregate them with the loss mask for clip-fraction metrics."""

    high: Tensor  # A > 0 and r > 1 + eps_clip_high: the upper clip is active (no gradient)
    low: Tensor  # A < 0 and r < 1 - eps_clip: the lower clip is active (no gradient)
    dual: Tensor  # A < 0 and r > c: the dual-clip cap is active (no gradient); 0 without eps_clip_c


def clip_fractions(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_clip: float, eps_clip_high: float,
                   eps_clip_c: float | None = None) -> ClipFractions:
    """Which tokens each clip bound switched off, per token ([B, T] floats, detached).

    high + low equals the `clipped` output of `ppo_clip_loss` (the clipped branch is taken exactly
    when A > 0 and r > 1 + eps_high, or A < 0 and r < 1 - eps).
    """
    _check_dual_clip(eps_clip_c)
    with torch.no_grad():
        ratio = torch.exp(log_ratio(logp, old_logp))
        high = ((advantages > 0) & (ratio > 1.0 + eps_clip_high)).float()
        low = ((advantages < 0) & (ratio < 1.0 - eps_clip)).float()
        if eps_clip_c is None:
            dual = torch.zeros_like(high)
        else:
            dual = ((advantages < 0) & (ratio > eps_clip_c)).float()
    return ClipFractions(high, low, dual)


def ppo_kl(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """PPO-KL metric: masked token mean of (old_logp - logp) (the k1 estimate of KL(old || new)).

    logp, old_logp, mask: [B, T]. Denominator: valid tokens of this batch (the trainer sums the
    numerator and the count over micro-batches for a global figure). Scalar, detached.
    """
    return masked_mean((old_logp - logp).detach(), mask)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim: H = logsumexp(z) - sum softmax(z) * z.

    logits: [..., V] on the full vocabulary -> [...]. A reference implementation (tests, CPU);
    the trainer uses its own vocab-parallel one on sharded logits.
    """
    z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, value_clip: float,
               mode: str = "token-mean", denominator: Tensor | float | None = None,
               max_len: int | None = None) -> tuple[Tensor, Tensor]:
    """Clipped value loss (PPO2 / verl): 0.5 * max((V - R)^2, (clip(V, V_old +/- value_clip) - R)^2).

    values: [B, T] current critic; old_values: [B, T] critic at rollout time; returns: [B, T]
    targets (e.g. from `gae_advantages`); mask [B, T]. The per-token loss is reduced by
    `aggregate(mode, denominator, max_len)`. Returns (scalar loss, clipfrac: masked token mean of
    where the clipped error was the larger one, detached).
    """
    per_token, clipped = value_loss_terms(values, old_values, returns, value_clip)
    loss = aggregate(per_token, mask, mode, denominator, max_len)
    return loss, masked_mean(clipped, mask).detach()


def value_loss_terms(values: Tensor, old_values: Tensor, returns: Tensor, value_clip: float) -> tuple[Tensor, Tensor]:
    """The per-token pieces of `value_loss`: (0.5 * max((V - R)^2, (clip(V, V_old +/- value_clip) - R)^2),
    1.0 where the clipped error was the larger one, detached), both shaped like `values`."""
    clipped_values = old_values + torch.clamp(values - old_values, -value_clip, value_clip)
    err = (values - returns).square()
    err_clipped = (clipped_values - returns).square()
    return 0.5 * torch.maximum(err, err_clipped), (err_clipped > err).float().detach()


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[R - V] / Var[R] over valid tokens (population variances); a critic-quality metric.

    values, returns, mask: [B, T]. 1 = perfect, 0 = no better than a constant; NaN when the
    returns have zero variance (undefined). Scalar float64, detached.
    """
    m = mask.detach().to(torch.float64)
    n = m.sum().clamp(min=1)
    r = torch.where(m > 0, returns.detach().to(torch.float64), 0.0)
    d = torch.where(m > 0, r - values.detach().to(torch.float64), 0.0)

    def var(x: Tensor) -> Tensor:
        mean = (x * m).sum() / n
        return (((x - mean) * m) ** 2).sum() / n

    var_r = var(r)
    if var_r.item() == 0:
        return torch.tensor(float("nan"), dtype=torch.float64)
    return 1.0 - var(d) / var_r
