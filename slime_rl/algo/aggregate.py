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

from slime_rl.config.flags import LOSS_AGG_MODES

AGG_MODES = LOSS_AGG_MODES  # the names are the flag's (config/flags.py); their math is here


def _check_name(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"--loss-agg-mode {mode!r}: unknown loss aggregation mode (one of {', '.join(AGG_MODES)})")


def check_mode(mode: str, max_len: int | None = None) -> None:
    """A known mode, and seq-mean-token-sum-norm with its constant horizon max_len >= 1."""
    _check_name(mode)
    if mode == "seq-mean-token-sum-norm" and (max_len is None or max_len < 1):
        raise ValueError("--loss-agg-mode seq-mean-token-sum-norm needs max_len, a constant horizon >= 1 "
                         "(loss_agg_max_len: the rollout's max response length)")


def sample_coefficient(mode: str, n_i: float, tokens: float, samples: float, max_len: int | None = None) -> float:
    """c_i of the module table: the weight of each trained token of sample i, from its trained-token
    count n_i and the global counts (tokens N, samples B with >= 1 trained token, horizon H).
    0 for a sample without trained tokens and when there are none at all (nothing to train).
    The one implementation of the modes: `aggregate` and the trainer's loss weights
    (trainer/loss_agg.py) both use it."""
    if n_i <= 0 or tokens <= 0:
        return 0.0
    if mode == "token-mean":
        return 1.0 / tokens
    if mode == "seq-mean-token-mean":
        return 1.0 / (samples * n_i)
    if mode == "seq-mean-token-sum":
        return 1.0 / samples
    if mode == "seq-mean-token-sum-norm":
        assert max_len is not None and max_len >= 1, "check_mode first"
        return 1.0 / (samples * max_len)
    raise AssertionError(mode)


def aggregate_denominator(mask: Tensor, mode: str) -> Tensor:
    """This micro-batch's share of the global denominator of `mode` (a count; sum it over
    micro-batches and DP ranks): valid tokens for token-mean, else samples with >= 1 valid token.
    For seq-mean-token-sum-norm the count excludes max_len, which `aggregate` multiplies in.
    mask: [B, T]. Returns a scalar float tensor.
    """
    _check_name(mode)
    m = mask.float()
    if mode == "token-mean":
        return m.sum()
    return (m.sum(dim=1) > 0).float().sum()


def aggregate(loss: Tensor, mask: Tensor, mode: str = "token-mean", denominator: Tensor | float | None = None,
              max_len: int | None = None) -> Tensor:
    """Reduce loss [B, T] (masked by mask [B, T]) to a scalar: sum_i c_i * sum_t loss_it over valid
    tokens, c_i from `sample_coefficient` (see the module table for each mode).

    denominator: the global count of the mode (token count for token-mean, sample count for the
    seq-* modes); None uses this batch's own (`aggregate_denominator`), clamped to >= 1 so an
    all-masked batch gives 0. max_len: required for seq-mean-token-sum-norm (constant length).
    Masked positions never contribute, even if the loss there is inf/nan.
    """
    check_mode(mode, max_len)
    m = mask.to(loss.dtype) if loss.is_floating_point() else mask.float()
    masked = torch.where(m > 0, loss, torch.zeros_like(loss))
    if denominator is None:
        denominator = aggregate_denominator(mask, mode).clamp(min=1)
    den = float(denominator)
    n = m.sum(dim=1).tolist()
    tokens = den if mode == "token-mean" else float(sum(n))
    coef = torch.tensor([sample_coefficient(mode, n_i, tokens, den, max_len) for n_i in n],
                        dtype=masked.dtype, device=masked.device)
    return (masked.sum(dim=1) * coef).sum()
