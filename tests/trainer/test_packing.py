"""Pure functions of token-budget batching (packing.py) and loss aggregation (loss_agg.py):
no megatron, no processes. Expected values are worked out by hand in the comments."""

from __future__ import annotations

import random

import pytest

from slime_rl.trainer.loss_agg import GlobalCounts, local_counts, sample_coefficients, token_weights
from slime_rl.trainer.packing import balance_by_tokens, split_to_count, token_budget_bins


def test_token_budget_bins_first_fit_decreasing():
    # longest first: 12 -> bin0; 9 -> bin1 (21 > 14); 7 -> bin2 (19, 16 > 14); 5 -> bin1 (14)
    assert token_budget_bins([7, 12, 5, 9], 14) == [[1], [2, 3], [0]]
    assert token_budget_bins([7, 12, 5, 9], 100) == [[0, 1, 2, 3]]
    assert token_budget_bins([30, 2], 10) == [[0], [1]]  # over-budget sample runs alone


@pytest.mark.parametrize("seed", range(5))
def test_token_budget_bins_respect_budget_and_cover_all(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 50) for _ in range(40)]
    bins = token_budget_bins(lengths, 64)
    assert sorted(i for b in bins for i in b) == list(range(40))
    assert all(sum(lengths[i] for i in b) <= 64 for b in bins)
    # FFD is within 11/9 OPT + 1 of the bin count; the volume bound is a weaker, safe check
    assert len(bins) <= 11 / 9 * -(-sum(lengths) // 64) + 1


def test_token_budget_rejects_bad_budget():
    with pytest.raises(ValueError, match="max-tokens-per-gpu"):
        token_budget_bins([1], 0)


def test_split_to_count_splits_heaviest_then_pads_with_dummies():
    lengths = [10, 10, 1, 1]
    out = split_to_count([[0, 1, 2, 3]], lengths, 2)
    # 22 tokens, half 11, longest first: 0 (10), 1 no (20), 2 (11), 3 no (12) -> 11 + 11
    assert sorted(map(sorted, out)) == [[0, 2], [1, 3]]
    out = split_to_count([[0], [1]], lengths, 4)
    assert out == [[0], [1], [], []]  # nothing left to split: two empty (dummy) groups
    with pytest.raises(ValueError):
        split_to_count([[0], [1]], lengths, 1)


@pytest.mark.parametrize("seed", range(5))
def test_balance_by_tokens(seed):
    rng = random.Random(seed)
    lengths = [rng.randint(1, 100) for _ in range(32)]
    parts = balance_by_tokens(lengths, 4)
    assert sorted(i for p in parts for i in p) == list(range(32))
    assert [len(p) for p in parts] == [8] * 4
    loads = [sum(lengths[i] for i in p) for p in parts]
    naive = [sum(lengths[8 * r : 8 * r + 8]) for r in range(4)]  # contiguous split, for scale
    assert max(loads) - min(loads) <= max(lengths)
    assert max(loads) - min(loads) <= max(naive) - min(naive)
    free = balance_by_tokens(lengths, 4, equal_count=False)
    free_loads = [sum(lengths[i] for i in p) for p in free]
    assert max(free_loads) - min(free_loads) <= max(lengths)  # LPT bound
    with pytest.raises(ValueError, match="data-parallel"):
        balance_by_tokens(lengths[:5], 2)


MASKS = ([1, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1], [0, 0])  # n_i = 3, 4, 2, 0 -> N = 9, B = 3


def test_sample_coefficients_by_hand():
    tokens, samples = local_counts(MASKS)
    assert (tokens, samples) == (9.0, 3.0)
    c = GlobalCounts(tokens=tokens, samples=samples, max_len=8)
    assert sample_coefficients(MASKS, "token-mean", c) == pytest.approx([1 / 9, 1 / 9, 1 / 9, 0])
    assert sample_coefficients(MASKS, "seq-mean-token-mean", c) == pytest.approx([1 / 9, 1 / 12, 1 / 6, 0])
    assert sample_coefficients(MASKS, "seq-mean-token-sum", c) == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0])
    assert sample_coefficients(MASKS, "seq-mean-token-sum-norm", c) == pytest.approx([1 / 24] * 3 + [0])
    w = token_weights(MASKS, "seq-mean-token-mean", c)
    assert w[1] == pytest.approx([1 / 12, 1 / 12, 0, 0, 1 / 12, 1 / 12])
    # seq-mean-token-mean: weights of each counted sample sum to 1 / B
    assert [sum(r) for r in w] == pytest.approx([1 / 3, 1 / 3, 1 / 3, 0])


def test_loss_agg_errors_name_the_flag():
    c = GlobalCounts(tokens=1, samples=1)
    with pytest.raises(ValueError, match="loss-agg-mode"):
        sample_coefficients(MASKS, "mean", c)
    with pytest.raises(ValueError, match="horizon"):
        sample_coefficients(MASKS, "seq-mean-token-sum-norm", c)
