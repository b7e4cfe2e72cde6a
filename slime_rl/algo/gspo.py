"""GSPO (Zheng et al. 2025, arXiv 2507.18071): clip a sequence-level importance ratio.

s_i = (pi(y_i | x) / pi_old(y_i | x)) ^ (1 / |y_i|) = exp(mean over the sample's valid tokens of
(logp - old_logp)). The per-token form (the paper's GSPO-token) is
s_{i,t} = sg[s_i] * pi(y_{i,t}) / sg[pi(y_{i,t})], i.e. exp(sg[log s_i] + logp_t - sg[logp_t]):
its value is s_i on every token of sample i and its gradient is s_i * grad logp_t. With one
advantage per sample this has the value and the gradient of the sequence-level objective (s_i on every
token, its gradient s_i / |y_i| * sum_t grad logp_t spread over the |y_i| tokens) under any aggregation
over tokens, and it lets GSPO reuse the per-token loss and aggregation path. So EasyR1's two loss types,
`gspo` (the sequence-level ratio on each token) and `gspo_token` (this form), are one loss here with GRPO's
advantages, the only ones EasyR1 pairs them with (tests/algo/test_cispo_sapo.py checks both forms).
Needs the whole response of a sample on one rank (context parallel: gather the sums first).

The log of the token ratio is clamped at GSPO_LOG_RATIO_MAX = 10 from above before exp, as verl's
compute_policy_loss_gspo does (verl/trainer/ppo/core_algos.py; PPO's per-token bound there is 20,
algo/losses.py): the identity (value and gradient) below 10, a finite e^10 ~ 2.2e4 above it.
"""

from __future__ import annotations

import torch
from torch import Tensor

GSPO_LOG_RATIO_MAX = 10.0


def gspo_seq_log_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """log s_i = sum_t mask * (logp - old_logp) / max(1, sum_t mask), per sample.

    logp, old_logp, mask: [B, T] -> [B] (0 for a fully masked sample). Differentiable in logp.
    """
    m = mask.to(logp.dtype)
    diff = torch.where(m > 0, logp - old_logp, torch.zeros_like(logp))
    return diff.sum(dim=1) / m.sum(dim=1).clamp(min=1)


def gspo_token_ratio(logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """s_{i,t} = exp(min(sg[log s_i] + logp_t - sg[logp_t], GSPO_LOG_RATIO_MAX)): value s_i, gradient
    s_i * grad logp_t (while log s_i <= 10).

    logp, old_logp, mask: [B, T] -> [B, T] (the value at masked positions is s_i too; mask it).
    """
    log_s = gspo_seq_log_ratio(logp.detach(), old_logp, mask)
    return torch.exp(torch.clamp(log_s.unsqueeze(1) + logp - logp.detach(), max=GSPO_LOG_RATIO_MAX))


def gspo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, eps_clip: float,
              eps_clip_high: float, eps_clip_c: float | None = None) -> tuple[Tensor, Tensor]:
    """GSPO clipped surrogate, per token: -min(s_{i,t} * A_i, clip(s_{i,t}, 1 - eps, 1 + eps_high) * A_i).

    logp, old_logp, mask: [B, T]; advantages: [B, T] (the sample's scalar broadcast) or [B].
    The paper's clip ranges are tiny (3e-4 / 4e-4): s_i is a per-token geometric mean. With eps_clip_c = c
    (PPO's dual clip, --eps-clip-c), a negative advantage's loss is capped at -c * A, as EasyR1 applies it to
    its gspo / gspo_token losses (verl's GSPO has no dual clip: leave it None). Returns (loss [B, T], clipped
    [B, T] float: 1 where the clipped branch was taken -- the same for every token of a sample). Aggregate
    with seq-mean-token-mean (`aggregate`), as the paper does.
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1).expand_as(logp)
    ratio = gspo_token_ratio(logp, old_logp, mask)
    unclipped = ratio * advantages
    clipped = torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    if eps_clip_c is not None:
        loss = torch.where(advantages < 0, torch.minimum(loss, -eps_clip_c * advantages), loss)
    return loss, (clipped < unclipped).float()
