"""CISPO (MiniMax-M1, arXiv 2506.13585, eq. 4): clip the importance-sampling weight, not the update.

    J(theta) = 1 / sum_i |o_i| * sum_i sum_t sg(r^_it) * A_it * log pi_theta(o_it | q, o_i<t)
    r^_it    = clip(r_it, 1 - eps_low, 1 + eps_high),   r_it = pi_theta / pi_old (per token)

sg is the stop-gradient: every token keeps its gradient A_it * grad log pi, weighted by the clipped ratio
(PPO's clip instead drops the tokens whose ratio left the band; CISPO's point is that rare "reflection"
tokens keep contributing). The bounds are --eps-clip (eps_low) and --eps-clip-high; the paper sets no
lower bound (eps_low large): --eps-clip 1 does that here (a ratio is never below 0). TRL's `loss_type="cispo"`
bounds the weight by its `epsilon_high` itself (clamp(r, max=epsilon_high)); here the bound is 1 + --eps-clip-high,
as in the paper's notation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_rl.algo.losses import log_ratio


def cispo_weight(logp: Tensor, old_logp: Tensor, eps_clip: float, eps_clip_high: float) -> tuple[Tensor, Tensor]:
    """(the clipped ratio r^ [B, T], detached; the raw ratio r [B, T], detached)."""
    with torch.no_grad():
        ratio = torch.exp(log_ratio(logp, old_logp))
        return torch.clamp(ratio, 1.0 - eps_clip, 1.0 + eps_clip_high), ratio


def cispo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, eps_clip: float,
               eps_clip_high: float) -> tuple[Tensor, Tensor]:
    """Per-token CISPO loss -sg(r^) * A * logp [B, T] (its gradient is the paper's; its value is not a
    surrogate of the return) and the clipped indicator [B, T] (1 where r^ != r: the weight was cut, the
    token still has a gradient). No reduction."""
    weight, ratio = cispo_weight(logp, old_logp, eps_clip, eps_clip_high)
    return -weight * advantages * logp, (weight != ratio).float()
