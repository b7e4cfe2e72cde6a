"""The step statistics that are not sums: train/rollout_logprob_abs_diff_max over trained tokens,
combined by max over micro-batches (the DP max: test_trainer_megatron's dp2 == tp1 metrics)."""

import pytest
import torch

from slime_rl.trainer.objective import (
    MAX_STAT_KEYS,
    STAT_KEYS,
    StepInputs,
    combine_stats,
    dp_reduce_stats,
    step_metrics,
    step_sums,
)


def _inputs(old: list[list[float]]) -> StepInputs:
    return StepInputs(old=old, entropy=[[0.0] * len(r) for r in old], ref=None, advantages=None, sums={})


def test_step_sums_max_leaves_masked_tokens_out():
    # by hand: |old - rollout| = [0.5, 0.25] and [3.0 (masked), 0.125, 0.0 (masked)]
    batch = {"response_lengths": [2, 3], "loss_masks": [[1, 1], [0, 1, 0]], "advantages": [1.0, -1.0],
             "rollout_logprobs": [[-1.0, -2.0], [-1.0, -1.0, -1.0]]}
    sums = step_sums(batch, _inputs([[-1.5, -1.75], [-4.0, -1.125, -1.0]]), torch.device("cpu"), None)
    m = step_metrics(sums)
    assert m["train/rollout_logprob_abs_diff_max"] == 0.5
    assert m["train/rollout_logprob_abs_diff"] == pytest.approx((0.5 + 0.25 + 0.125) / 3)


def test_combine_stats_sums_all_but_the_max_keys():
    rows = torch.zeros(2, len(STAT_KEYS))
    rows[0, STAT_KEYS.index("tokens")], rows[1, STAT_KEYS.index("tokens")] = 3, 4
    rows[0, STAT_KEYS.index("abs_diff_max")], rows[1, STAT_KEYS.index("abs_diff_max")] = 0.75, 0.5
    out = dict(zip(STAT_KEYS, combine_stats(rows).tolist(), strict=True))
    assert out["tokens"] == 7 and out["abs_diff_max"] == 0.75


def test_dp_reduce_stats_takes_the_max_over_ranks():
    ranks = [[float(i + r) for i in range(len(STAT_KEYS))] for r in (0, 10)]  # two DP ranks' values

    def all_reduce(values, op=torch.distributed.ReduceOp.SUM):  # what dist.all_reduce gives each rank
        col = [ranks[0], ranks[1]] if len(values) == len(STAT_KEYS) else \
            [[r[STAT_KEYS.index(k)] for k in MAX_STAT_KEYS] for r in ranks]
        return [max(a, b) if op == torch.distributed.ReduceOp.MAX else a + b for a, b in zip(*col, strict=True)]

    out = dp_reduce_stats(ranks[0], all_reduce)
    i = STAT_KEYS.index("tokens")
    assert out["tokens"] == ranks[0][i] + ranks[1][i]
    assert "abs_diff_max" in MAX_STAT_KEYS and "mm_ratio_max" in MAX_STAT_KEYS
    for k in MAX_STAT_KEYS:
        assert out[k] == ranks[1][STAT_KEYS.index(k)]
