"""--load-debug-rollout-data in the real loop (Ray, two Megatron ranks on gloo as DP=2): run A generates
two steps with the built-in engine and saves its rollouts and train data; run B replays A's rollout
files from the same checkpoint with the same seed, starting no engine. The trainer sees the same
batches, so its old log-probs (what --save-debug-train-data holds) are A's, step after step."""

from __future__ import annotations

import json

import pytest
import ray
import torch

from slime_rl.config import build_config
from slime_rl.train import preflight, train
from tests.e2e.test_loop import argv
from tests.loop_checks import digit_data_fixture

digit_data = digit_data_fixture(32, seed=1)

STEPS, DP = 2, 2


def _actors(class_name: str) -> int:
    """Actors of that class this Ray instance has ever started (dead ones included): read from the GCS,
    which Ray's public state API reaches only through the dashboard, off in these tests."""
    return sum(a["ActorClassName"] == class_name for a in ray._private.state.actors().values())


def _train_files(folder, step: int) -> list[dict]:
    return [torch.load(folder / f"train_{step}_rank{r}.pt") for r in range(DP)]


@pytest.mark.slow
def test_replay_trains_on_the_saved_rollouts_without_engines(ray_session, tiny_qwen2, digit_data, tmp_path):
    # DP=2, 16 samples per rollout in two optimizer steps of 8 (old log-probs from a forward-only pass);
    # rewards differ within every group, so step 0's update moves the weights step 1 is trained from
    common = ["--tensor-model-parallel-size", "1", "--custom-rm-path", "tests.plugins.example_reward:index_reward"]
    dump_a, dump_b = tmp_path / "a", tmp_path / "b"
    rows_a = train(*preflight(build_config(
        argv(tiny_qwen2, digit_data, tmp_path / "run_a", steps=STEPS) + common
        + ["--save-debug-rollout-data", str(dump_a / "rollout_{rollout_id}.pt"),
           "--save-debug-train-data", str(dump_a / "train_{rollout_id}_rank{rank}.pt")])))
    engines_before, ranks_before = _actors("EngineActor"), _actors("RankActor")
    assert engines_before >= 1  # the observable sees run A's engine

    cfg = build_config(
        argv(tiny_qwen2, digit_data, tmp_path / "run_b", steps=STEPS) + common
        + ["--load-debug-rollout-data", str(dump_a / "rollout_{rollout_id}.pt"),
           "--save-debug-train-data", str(dump_b / "train_{rollout_id}_rank{rank}.pt")])
    cfg, plan = preflight(cfg)
    assert plan.engines == () and len(plan.bundles) == DP  # nothing planned for an engine
    rows_b = train(cfg, plan)
    assert _actors("EngineActor") == engines_before  # run B started no engine actor (hence no server)
    assert _actors("RankActor") == ranks_before + DP  # ... but its trainer ranks: the count is live
    logged = [json.loads(x) for x in (tmp_path / "run_b" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(STEPS)) and logged == rows_b
    assert [r["perf/weight_sync_s"] for r in rows_b] == [0.0] * STEPS  # no weight sync
    assert all(r["perf/weight_sync_s"] > 0 for r in rows_a)  # (run A synced after every step)
    for a, b in zip(rows_a, rows_b, strict=True):  # the rollout metrics come from the files: A's, exactly
        for key in ("rollout/reward_mean", "rollout/reward_std", "rollout/response_len_mean",
                    "rollout/truncated_frac", "rollout/zero_std_group_frac"):
            assert b[key] == a[key], key

    for step in range(STEPS):
        shards_a, shards_b = _train_files(dump_a, step), _train_files(dump_b, step)
        for ta, tb in zip(shards_a, shards_b, strict=True):
            assert (tb["rollout_id"], tb["rank"], tb["log_probs_from"]) == (step, ta["rank"], ta["log_probs_from"])
            assert len(tb["samples"]) == len(ta["samples"]) == 8
            for sa, sb in zip(ta["samples"], tb["samples"], strict=True):
                # the same samples in the same order on the same rank, with the engine's log-probs, the loss
                # mask, the advantages and rewards of run A (from its file, not generated or scored again)
                for key in ("tokens", "rollout_log_probs", "loss_mask", "advantages", "reward"):
                    assert sb[key] == sa[key], (step, key)
                # the trainer's old log-probs: same weights (step 0: the checkpoint; step 1: after the same
                # update on the same batch), same batch, same layout on CPU -> the same numbers
                assert sb["log_probs"] == sa["log_probs"], (step, max(
                    abs(x - y) for x, y in zip(sa["log_probs"], sb["log_probs"], strict=True)))
        gap = [r["train/rollout_logprob_abs_diff"] for r in (rows_a[step], rows_b[step])]
        assert gap[1] == gap[0], (step, gap)
    assert rows_b[1]["train/rollout_logprob_abs_diff"] > 0  # the step-1 numbers are not trivially equal
