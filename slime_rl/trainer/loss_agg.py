"""Loss aggregation over a whole mini-batch, exact under any micro-batching and DP split.

Every mode is a weighted token sum over the mini-batch M (all DP ranks, all micro-batches):
    L = sum_{i in M} sum_t w_it * loss_it,   w_it = mask_it * c_i,
with per-sample coefficients c_i from global counts (summed over DP before the schedule runs):
    N = sum_i n_i (trained tokens), n_i = sum_t mask_it, B = #{i : n_i > 0}, H = max_len
| mode                     | c_i           | i.e.                                           |
|--------------------------|---------------|------------------------------------------------|
| token-mean               | 1 / N         | DAPO: every trained token weighs the same      |
| seq-mean-token-mean      | 1 / (B * n_i) | mean over samples of each sample's token mean  |
| seq-mean-token-sum       | 1 / B         | mean over samples of each sample's token sum   |
| seq-mean-token-sum-norm  | 1 / (B * H)   | Dr.GRPO: token sums over a constant horizon H  |
Samples with no trained token (n_i = 0) add nothing and are not counted in B. The modes' names
are the flag's (config/flags.LOSS_AGG_MODES) and c_i is slime_rl.algo.aggregate.sample_coefficient,
which algo.aggregate uses too: one definition, one implementation. Since c_i depends only on
sample i and global counts, each micro-batch's share is known in advance and the gradient does
not depend on how M is split; steps.py then undoes megatron's 1 / (num_microbatches * dp_size) scaling.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from slime_rl.algo.aggregate import AGG_MODES as LOSS_AGG_MODES
from slime_rl.algo.aggregate import check_mode, sample_coefficient

__all__ = ["LOSS_AGG_MODES", "GlobalCounts", "check_mode", "local_counts", "sample_coefficients", "token_weights"]


def local_counts(loss_masks: Sequence[Sequence[float]]) -> tuple[float, float]:
    """(trained tokens, samples with >= 1 trained token) of this rank's part of the mini-batch."""
    sums = [float(sum(m)) for m in loss_masks]
    return sum(sums), float(sum(1 for s in sums if s > 0))


@dataclass(frozen=True)
class GlobalCounts:
    tokens: float  # N, over all DP ranks of the mini-batch
    samples: float  # B
    max_len: int | None = None  # H (seq-mean-token-sum-norm only)


def sample_coefficients(loss_masks: Sequence[Sequence[float]], mode: str,
                        counts: GlobalCounts) -> list[float]:
    """c_i per sample (see the module table); 0 for samples without trained tokens and when
    the whole mini-batch has none (nothing to train: zero loss, zero gradient)."""
    check_mode(mode, counts.max_len)
    return [sample_coefficient(mode, float(sum(m)), counts.tokens, counts.samples, counts.max_len)
            for m in loss_masks]


def token_weights(loss_masks: Sequence[Sequence[float]], mode: str,
                  counts: GlobalCounts) -> list[list[float]]:
    """w_it = mask_it * c_i, one list per sample (response length), for the micro-batch builder."""
    coefs = sample_coefficients(loss_masks, mode, counts)
    return [[float(x) * c for x in m] for m, c in zip(loss_masks, coefs, strict=True)]
