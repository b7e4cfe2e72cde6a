"""SAPO (Soft Adaptive Policy Optimization, Gao et al. 2025, arXiv 2511.20347): a soft gate on the
per-token ratio instead of PPO's hard clip.

    loss_t = -f_t(r_t) * A_t,   f_t(r) = (4 / tau_t) * sigmoid(tau_t * (r - 1)),   r_t = pi_theta / pi_old
    tau_t  = --sapo-tau-pos where A_t > 0, --sapo-tau-neg otherwise

f's slope at r = 1 is 1 (sigmoid'(0) = 1/4), so on-policy the gradient is the plain policy gradient; away
from r = 1 it fades smoothly (the faster the larger tau) rather than dropping to 0 at a band's edge.
A larger tau for negative advantages damps their updates sooner (defaults 1.0 and 1.05, as AReaL's and
Trinity-RFT's SAPO).
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_rl.algo.losses import log_ratio


def sapo_loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, tau_pos: float,
              tau_neg: float) -> Tensor:
    """Per-token SAPO loss [B, T] (no reduction; the log-ratio clamped as PPO's, `losses.log_ratio`)."""
    ratio = torch.exp(log_ratio(logp, old_logp))
    tau = torch.where(advantages > 0, torch.full_like(ratio, tau_pos), torch.full_like(ratio, tau_neg))
    return -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages
