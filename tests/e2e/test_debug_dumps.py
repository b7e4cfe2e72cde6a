"""slime's debug data in the real loop (Ray, two Megatron ranks on gloo as DP=2, the built-in engine over
HTTP).

--save-debug-rollout-data and --save-debug-train-data, on both ways the trainer gets its old log-probs:
the fused path (one optimizer step per rollout: the training forward's own, detached) and the separate
forward-only pass (two optimizer steps per rollout). The files are checked against each other and
against the step's logged train/rollout_logprob_abs_diff, recomputed from them alone.

--load-debug-rollout-data: a run B replays the separate-pass run's rollout files from the same
checkpoint with the same seed, starting no engine. The trainer sees the same batches, so its old
log-probs (what --save-debug-train-data holds) are the first run's, step after step. One run serves
both: its files are what the dump test checks and what the replay reads.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import ray
import torch

from slime_rl.config import build_config
from slime_rl.rollout.stream import version_number
from slime_rl.train import preflight, train
from tests.e2e.test_loop import argv
from tests.loop_checks import digit_data_fixture

digit_data = digit_data_fixture(32, seed=1)

STEPS, DP = 2, 2


def _load(path) -> dict:
    return torch.load(path)  # weights_only (the default): the files hold plain Python values


FUSED, SEPARATE = ["--global-batch-size", "16"], ["--global-batch-size", "8"]
SOURCES = {"fused": "training forward (fused)", "separate": "separate forward pass"}


def dump_run(model, data, root, batch) -> tuple[list[dict], object]:
    """DP=2 (TP=1 over the 2 ranks); 16 samples per rollout: one optimizer step of 16 (FUSED), or two of 8
    (SEPARATE). SEPARATE runs --async and FUSED --fully-async --max-staleness 1: either way rollout 1 is
    generated while step 0 trains, by the weights before its update (fully async: the stream refills at once
    and an update continues what is in flight), so step 1's engine/trainer gap is not rounding alone. The
    rewards differ within every group, so the update moves the weights. Returns the rows and `root`, which
    holds run/ and dump/."""
    mode = ["--fully-async", "--max-staleness", "1"] if batch == FUSED else ["--async"]
    cfg = build_config(
        argv(model, data, root / "run", steps=STEPS)
        + batch
        + mode
        + [
            "--tensor-model-parallel-size",
            "1",
            "--custom-rm-path",
            "tests.plugins.example_reward:index_reward",
            "--save-debug-rollout-data",
            str(root / "dump" / "rollout_{rollout_id}.pt"),
            "--save-debug-train-data",
            str(root / "dump" / "train_{rollout_id}_rank{rank}.pt"),
        ]
    )
    assert cfg.parallel.data_parallel_size == DP
    return train(*preflight(cfg)), root


@pytest.fixture(scope="module")
def separate_run(ray_session, tiny_qwen2, digit_data, tmp_path_factory):
    """The separate-pass run: checked by the dump test, replayed by the replay test."""
    return dump_run(tiny_qwen2, digit_data, tmp_path_factory.mktemp("separate"), SEPARATE)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fused", "separate"])
def test_dumps_hold_what_the_step_measured(ray_session, tiny_qwen2, digit_data, tmp_path, request, layout):
    if layout == "fused":
        rows, root = dump_run(tiny_qwen2, digit_data, tmp_path, FUSED)
    else:
        rows, root = request.getfixturevalue("separate_run")
    source, run = SOURCES[layout], root / "run"
    logged = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == list(range(STEPS)) and logged == rows
    assert sorted(p.name for p in (root / "dump").iterdir()) == sorted(
        [f"rollout_{k}.pt" for k in range(STEPS)] + [f"train_{k}_rank{r}.pt" for k in range(STEPS) for r in range(DP)]
    )
    gaps = []
    for step, row in enumerate(logged):
        rollout = _load(root / "dump" / f"rollout_{step}.pt")
        assert rollout["rollout_id"] == step and len(rollout["samples"]) == 16
        for s in rollout["samples"]:
            assert s["tokens"] == s["prompt_ids"] + s["response_ids"]
            assert len(s["rollout_logprobs"]) == len(s["loss_mask"]) == s["response_length"] > 0
            assert isinstance(s["reward"], float) and "group_index" in s and "label" in s
            # every response token names the weight version that sampled it (the engine's own checkpoint:
            # "default"; after the update of step k: "k + 1")
            versions = s["metadata"]["token_weight_versions"]
            assert len(versions) == s["response_length"] and None not in versions
            if layout == "fused":  # --max-staleness 1, from the dump alone: no token older than step - 1
                assert all(step - version_number(v) <= 1 for v in versions), (step, versions)
        if layout == "fused":
            assert row["rollout/staleness_max"] <= 1 and row["rollout/stale_groups_dropped"] == 0
            assert row["rollout/engine_idle_s"] >= 0 and row["perf/trainer_wait_s"] >= 0
        shards = [_load(root / "dump" / f"train_{step}_rank{r}.pt") for r in range(DP)]
        assert [(t["rollout_id"], t["rank"], t["dp_size"], t["log_probs_from"]) for t in shards] == [
            (step, r, DP, source) for r in range(DP)
        ]
        trained = [s for t in shards for s in t["samples"]]
        assert [len(t["samples"]) for t in shards] == [8, 8]
        for s in trained:
            n = s["response_length"]
            assert s["response_ids"] == s["tokens"][-n:]
            assert (
                len(s["log_probs"]) == len(s["rollout_log_probs"]) == len(s["loss_mask"]) == len(s["advantages"]) == n
            )
        # every sample the ranks trained on is one of the rollout's, with the engine's log-probs and loss
        # mask unchanged (matched by token ids; a repeated response counts as often as it was generated)
        key = ("tokens", "rollout_log_probs", "loss_mask")
        assert Counter(tuple(tuple(s[k]) for k in key) for s in trained) == Counter(
            (tuple(s["tokens"]), tuple(s["rollout_logprobs"]), tuple(s["loss_mask"])) for s in rollout["samples"]
        )
        # the metric, from the files alone: mean (and max) |old - rollout| over the trained tokens
        diffs = [
            abs(a - b)
            for s in trained
            for a, b, m in zip(s["log_probs"], s["rollout_log_probs"], s["loss_mask"], strict=True)
            if m
        ]
        assert sum(diffs) / len(diffs) == pytest.approx(row["train/rollout_logprob_abs_diff"], rel=1e-6, abs=1e-12)
        assert max(diffs) == pytest.approx(row["train/rollout_logprob_abs_diff_max"], rel=1e-6, abs=1e-12)
        gaps.append(row["train/rollout_logprob_abs_diff"])
    assert gaps[1] > 1e-4 > gaps[0]  # step 1: generated by the weights before step 0's update


def _actors(class_name: str) -> int:
    """Actors of that class this Ray instance has ever started (dead ones included): read from the GCS,
    which Ray's public state API reaches only through the dashboard, off in these tests."""
    return sum(a["ActorClassName"] == class_name for a in ray._private.state.actors().values())


def _train_files(folder, step: int) -> list[dict]:
    return [torch.load(folder / f"train_{step}_rank{r}.pt") for r in range(DP)]


@pytest.mark.slow
def test_replay_trains_on_the_saved_rollouts_without_engines(separate_run, tiny_qwen2, digit_data, tmp_path):
    # run A: the separate-pass run (16 samples per rollout in two optimizer steps of 8, old log-probs from a
    # forward-only pass; rewards differ within every group, so step 0's update moves the weights step 1 is
    # trained from). Its --async changes which weights generated a rollout, not what the trainer computes.
    rows_a, root = separate_run
    dump_a, dump_b = root / "dump", tmp_path / "b"
    common = ["--tensor-model-parallel-size", "1", "--custom-rm-path", "tests.plugins.example_reward:index_reward"]
    engines_before, ranks_before = _actors("EngineActor"), _actors("RankActor")
    assert engines_before >= 1  # the observable sees run A's engine
    cfg = build_config(
        argv(tiny_qwen2, digit_data, tmp_path / "run_b", steps=STEPS) + common + SEPARATE
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
