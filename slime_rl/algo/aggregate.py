"""Loss aggregation: a per-token loss [B, T] and its mask -> one scalar, with a stated denominator.

Micro-batching and data parallelism split the batch, so a denominator computed on one micro-batch
is not the batch's. Every mode's denominator is a count the trainer can sum over micro-batches and
DP ranks (`aggregate_denominator` gives one micro-batch's share); passing the global count as
`denominator` makes sum over micro-batches of `aggregate(...)` equal the full-batch value, whatever
the split (multiply by the DP size if the gradient all-reduce averages over ranks).

| mode                      | numerator                              | denominator (global count)      |
|---------------------------|----------------------------------------|---------------------------------|
| token-mean                | sum of loss over valid tokens          | valid tokens                    |
| seq-mean-token-mean       | sum over samples of per-sample mean    | samples with >= 1 valid token   |
| seq-mean-token-sum        | sum of loss over valid tokens          | samples with >= 1 valid token   |
| seq-mean-token-sum-norm   | sum of loss over valid tokens          | samples (>= 1 valid) x max_len  |

seq-mean-token-sum-norm is Dr.GRPO's: max_len is a constant (e.g. the rollout's max response
length), not the batch's longest sample, so the scale never moves with response lengths.
"""

from __future__ import annotations

import torch
from torch import Tensor

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def _check_mode(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r} ({', '.join(AGG_MODES)})")


def aggregate_denominator(mask: Tensor, mode: str) -> Tensor:
    """This micro-batch's share of the global denominator of `mode` (a count; sum it over
    micro-batches and DP ranks): valid tokens for token-mean, else samples with >= 1 valid token.
    For seq-mean-token-sum-norm the count excludes max_len, which `aggregate` multiplies in.
    mask: [B, T]. Returns a scalar float tensor.
    """
    _check_mode(mode)
    m = mask.float()
    if mode == "token-mean":
        return m.sum()
    return (m.sum(dim=1) > 0).float().sum()


def aggregate(loss: Tensor, mask: Tensor, mode: str = "token-mean", denominator: Tensor | float | None = None,
              max_len: int | None = None) -> Tensor:
    """Reduce loss [B, T] (masked by mask [B, T]) to a scalar; see the module table for each mode.

    denominator: the global count of the mode (token count for token-mean, sample count for the
    seq-* modes); None uses this batch's own (`aggregate_denominator`), clamped to >= 1 so an
    all-masked batch gives 0. max_len: required for seq-mean-token-sum-norm (constant length).
    Masked positions never contribute, even if the loss there is inf/nan.
    """
    _check_mode(mode)
    m = mask.to(loss.dtype) if loss.is_floating_point() else mask.float()
    masked = torch.where(m > 0, loss, torch.zeros_like(loss))
    if denominator is None:
        denominator = aggregate_denominator(mask, mode).clamp(min=1)
    if mode == "seq-mean-token-mean":
        per_sample = masked.sum(dim=1) / m.sum(dim=1).clamp(min=1)
        return per_sample.sum() / denominator
    if mode == "seq-mean-token-sum-norm":
        if max_len is None or max_len <= 0:
            raise ValueError("seq-mean-token-sum-norm needs max_len, a positive constant (e.g. max response length)")
        return masked.sum() / (denominator * max_len)
    return masked.sum() / denominator
