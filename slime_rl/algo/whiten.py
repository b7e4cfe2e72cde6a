"""Masked statistics shared by the estimators: moments and whitening over valid tokens.

Whitening in REINFORCE++ (and optionally GAE) is *global*: mean and std over every valid token of
the whole batch, not per micro-batch. `masked_moments` returns the three additive sums that make
that possible: the trainer computes them on its share, all-reduces them (SUM) over the data-parallel
group (with context parallel), and passes the result to `masked_whiten(..., moments=...)`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def masked_moments(values: Tensor, mask: Tensor) -> Tensor:
    """Additive moments of `values` over the tokens where mask is 1.

    values, mask: [B, T]. Returns float64 [3] = (sum x, sum x^2, count). Sum these across ranks /
    micro-batches (all_reduce SUM) to get the global moments for `masked_whiten`.
    """
    m = mask.detach().to(torch.float64)
    v = torch.where(m > 0, values.detach().to(torch.float64), 0.0)
    return torch.stack([(v * m).sum(), (v * v * m).sum(), m.sum()])


def masked_whiten(values: Tensor, mask: Tensor, moments: Tensor | None = None, eps: float = 1e-8) -> Tensor:
    """(x - mean) / sqrt(var + eps) with mean and var over valid tokens; padding positions -> 0.

    values, mask: [B, T]. moments: optional global (sum, sum_sq, count) from `masked_moments`
    (all-reduced); without it the statistics are this batch's, computed in two passes. var is the
    unbiased one (Bessel's n / (n - 1) when n >= 2), as in verl's and slime's whitening; with a
    single valid token (or all equal) the output is 0. No valid token at all: all zeros.
    Returns [B, T] in the dtype of `values`, detached (advantages carry no gradient).
    """
    m = mask.detach().to(torch.float64)
    v = torch.where(m > 0, values.detach().to(torch.float64), 0.0)  # padding may hold anything
    if moments is None:
        count = m.sum()
        if count.item() == 0:
            return torch.zeros_like(values).detach()
        mean = (v * m).sum() / count
        var = (((v - mean) * m) ** 2).sum() / count
    else:
        total, total_sq, count = moments.to(torch.float64).unbind()
        if count.item() == 0:
            return torch.zeros_like(values).detach()
        mean = total / count
        var = (total_sq / count - mean * mean).clamp(min=0.0)
    if count.item() >= 2:
        var = var * count / (count - 1)
    out = (v - mean) * torch.rsqrt(var + eps) * m
    return out.to(values.dtype)
