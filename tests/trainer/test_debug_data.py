"""The pieces of --save-debug-train-data / --save-debug-rollout-data without a cluster: the fused
path's per-micro-batch log-probs back per sample (micro.rows_by_sample), the train file's dict, the
rollout file's dict, and the atomic torch.save. The whole loop: tests/e2e/test_debug_dumps.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from slime_rl.data import Sample
from slime_rl.observability.debug_data import save_debug_data
from slime_rl.orchestration.rollout_manager import debug_rollout_data, samples_to_batch
from slime_rl.trainer.debug_data import FUSED, SEPARATE, train_data, writes_train_data
from slime_rl.trainer.micro import rows_by_sample


def _sample(index: int, group: int, prompt: list[int], response: list[int], reward: float) -> Sample:
    return Sample(
        index=index,
        group_index=group,
        prompt="p",
        prompt_ids=prompt,
        label="7",
        response="r",
        response_ids=response,
        rollout_logprobs=[-0.5 - 0.25 * k for k in range(len(response))],
        loss_mask=[1] * (len(response) - 1) + [0],
        reward=reward,
    )


def test_rows_by_sample_maps_rows_by_sample_ids_cuts_padding_and_skips_dummies():
    lens = [3, 1, 2, 4]
    # micro-batch 1 holds samples 2, 0 (in that order), right-padded to T=3; micro-batch 2 samples 3, 1;
    # the last one is a dummy (no sample ids, one row: the equalized micro-batch count over DP)
    store = [
        {"sample_ids": [2, 0], "logp": torch.tensor([[20.0, 21.0, 9.0], [0.0, 1.0, 2.0]])},
        {"sample_ids": [3, 1], "logp": torch.tensor([[30.0, 31.0, 32.0, 33.0], [10.0, 9.0, 9.0, 9.0]])},
        {"sample_ids": [], "logp": torch.tensor([[5.0, 5.0]])},
    ]
    assert rows_by_sample(store, "logp", lens) == [[0.0, 1.0, 2.0], [10.0], [20.0, 21.0], [30.0, 31.0, 32.0, 33.0]]
    with pytest.raises(RuntimeError, match=r"samples \[1, 3\]"):
        rows_by_sample(store[:1], "logp", lens)


def test_only_tp0_cp0_of_the_last_stage_writes():
    assert writes_train_data(0, 0, 1, 2) and writes_train_data(0, 0, 0, 1)
    assert not writes_train_data(1, 0, 1, 2) and not writes_train_data(0, 1, 1, 2) and not writes_train_data(0, 0, 0, 2)


def test_train_data_per_sample():
    groups = [[_sample(0, 0, [1, 2], [3, 4, 5], 1.0), _sample(1, 0, [1, 2], [6, 7], 0.0)]]
    batch = samples_to_batch(groups)  # GRPO: a scalar advantage per sample, about +-1/sqrt(2) here
    old = [[-0.4, -0.8, -1.0], [-0.6, -0.7]]
    out = train_data(3, 1, 2, batch, old, None, FUSED)
    assert {k: v for k, v in out.items() if k != "samples"} == {
        "rollout_id": 3,
        "rank": 1,
        "dp_size": 2,
        "log_probs_from": FUSED,
    }
    first, second = out["samples"]
    assert first["tokens"] == [1, 2, 3, 4, 5] and first["response_ids"] == [3, 4, 5] and first["response_length"] == 3
    assert first["log_probs"] == old[0] and first["rollout_log_probs"] == [-0.5, -0.75, -1.0]
    assert first["loss_mask"] == [1, 1, 0] and first["reward"] == 1.0
    # a scalar estimator's advantage on every response token, as the micro-batch broadcasts it
    assert batch["advantages"][0] == pytest.approx(2**-0.5, rel=1e-5)
    assert first["advantages"] == [batch["advantages"][0]] * 3 and second["advantages"] == [batch["advantages"][1]] * 2
    # token-level advantages (REINFORCE++, PPO) as given
    tokens = train_data(0, 0, 1, batch, old, [[0.1, 0.2, 0.3], [0.4, 0.5]], SEPARATE)
    assert [s["advantages"] for s in tokens["samples"]] == [[0.1, 0.2, 0.3], [0.4, 0.5]]
    with pytest.raises(ValueError, match="sample 1: 3 old log-probs for 2 response tokens"):
        train_data(0, 0, 1, batch, [old[0], old[0]], None, FUSED)


def test_rollout_data_holds_every_sample_field_and_reads_back_with_weights_only(tmp_path):
    groups = [[_sample(0, 0, [1, 2], [3, 4], 1.0), _sample(1, 0, [1, 2], [5], 0.0)], [_sample(2, 1, [9], [8], 0.5)]]
    groups[1][0].rollout_routed_experts = np.arange(4, dtype=np.int32).reshape(2, 2)  # MoE routing: kept as lists
    path = save_debug_data(tmp_path / "a" / "b" / "rollout_5.pt", debug_rollout_data(5, groups))
    assert sorted(p.name for p in path.parent.iterdir()) == ["rollout_5.pt"]  # no temporary file left
    back = torch.load(path)  # weights_only=True
    assert back["rollout_id"] == 5 and [s["index"] for s in back["samples"]] == [0, 1, 2]
    first = back["samples"][0]
    assert (
        first["tokens"] == [1, 2, 3, 4] and first["response_length"] == 2 and first["rollout_logprobs"] == [-0.5, -0.75]
    )
    assert (first["loss_mask"], first["reward"], first["label"], first["group_index"]) == ([1, 0], 1.0, "7", 0)
    assert back["samples"][2]["rollout_routed_experts"] == [[0, 1], [2, 3]]
    save_debug_data(path, {"rollout_id": 6})  # a rerun replaces the file
    assert torch.load(path) == {"rollout_id": 6}
