"""The whole loop on CPU: Ray actors, Megatron TP=2 ranks on gloo, the built-in engine over HTTP,
and the gloo broadcast of weights. Nothing is faked here."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from slime_rl.config import build_config
from slime_rl.observability import REQUIRED_KEYS
from slime_rl.train import preflight, train
from tests.loop_checks import compare_engine_weights, digit_data_fixture


def argv(model, data, run_dir, steps):
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--run-dir", str(run_dir),
            "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
            "--micro-batch-size", "4", "--rollout-max-response-len", "6", "--num-rollout", str(steps),
            "--rm-type", "digit", "--lr", "0.003", "--rollout-shuffle", "--update-weight-buffer-size", "20000"]


digit_data = digit_data_fixture(64, seed=1)


@pytest.mark.slow
def test_two_steps_write_metrics_logprobs_agree_and_save_hf(ray_session, tiny_qwen2, digit_data, tmp_path):
    cfg = build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2) + [
        "--use-wandb", "--wandb-mode", "offline", "--use-tensorboard", "--use-swanlab", "--swanlab-mode", "offline",
        "--save-hf", str(tmp_path / "hf" / "step_{rollout_id}"), "--save-interval", "1"])
    rows = train(*preflight(cfg))
    check_logging_backends(tmp_path / "run", rows)
    check_hf_folders(tiny_qwen2, tmp_path / "hf", rows)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1] and lines == rows
    for row in lines:
        missing = set(REQUIRED_KEYS) - set(row)
        assert not missing, missing
        assert np.isfinite(row["train/grad_norm"])
        # a gradient exactly when some group's rewards differ (GRPO gives equal rewards no advantage)
        assert (row["train/grad_norm"] > 0) == (row["rollout/zero_std_group_frac"] < 1)
    # step 0: engine (HF, transformers) and trainer (Megatron TP=2) see the same weights -> same log-probs
    assert lines[0]["train/rollout_logprob_abs_diff"] <= 1e-3
    # step 1 generated with the broadcast weights of step 0's update
    assert lines[1]["train/rollout_logprob_abs_diff"] <= 1e-2
    assert lines[1]["perf/weight_sync_GBps"] > 0


def check_hf_folders(source_ckpt, hf_dir, rows):
    """--save-hf with --save-interval 1 and no --save: one HF folder per step, named from the {rollout_id}
    template, each a checkpoint transformers loads. The trainer-level equality (folder == the trainer's
    gathered weights, PP=2) is in tests/trainer/test_save_hf.py; here the wiring through flags, train.py,
    the cluster and the actors."""
    from transformers import AutoModelForCausalLM

    assert "perf/save_s" in rows[0]
    assert sorted(p.name for p in hf_dir.iterdir()) == ["step_0", "step_1"]
    source = load_file(source_ckpt / "model.safetensors")
    saved = [load_file(hf_dir / f"step_{i}" / "model.safetensors") for i in (0, 1)]
    for s in saved:
        assert set(s) == set(source)
    if any(r["train/grad_norm"] > 0 for r in rows):  # an update happened: the folders track it
        assert any(not torch.equal(saved[1][n], t) for n, t in source.items())
    model = AutoModelForCausalLM.from_pretrained(hf_dir / "step_1", dtype=torch.float32)
    assert all(torch.equal(model.state_dict()[n], t) for n, t in saved[1].items())


def check_logging_backends(run_dir, rows):
    """wandb (offline), tensorboard and swanlab (offline) each wrote a run with the step metrics."""
    (wandb_run,) = (run_dir / "wandb").glob("offline-run-*")
    (wandb_file,) = wandb_run.glob("run-*.wandb")
    assert b"rollout/reward_mean" in wandb_file.read_bytes()  # the history records name their keys
    (swan_run,) = (run_dir / "swanlog").glob("run-*")
    assert list(swan_run.glob("*.swanlab"))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(run_dir / "tensorboard"))
    tb.Reload()
    logged = [(e.step, e.value) for e in tb.Scalars("rollout/reward_mean")]
    assert logged == [(r["step"], pytest.approx(r["rollout/reward_mean"], rel=1e-6)) for r in rows]


# The ways the loop feeds the loss, one whole-loop run each, folded into runs that check something else of
# the same loop (the algorithm changes nothing of what those check): token-level advantages built by the trainer
# with the reference model (REINFORCE++; reinforce_plus_plus_baseline takes the same path) in the TP=2 weights
# test, GRPO's scalar advantages (rloo's path too) with every per-token term on (dual clip, the off-policy
# corrections, entropy bonus, KL loss) in the PP=2 one, and a sequence-level ratio (GSPO) in the resume test
# (the corrections read the engine's log-probs, whose last bits depend on how the engine batched the requests,
# so a run with them does not repeat bit for bit: the resume test runs without them). Each
# family's math, rloo and reinforce_plus_plus_baseline included, is checked against float64 references in
# tests/algo and, on real Megatron ranks, tests/trainer/test_trainer_algo.py.
REINFORCE_PP = ["--advantage-estimator", "reinforce_plus_plus", "--kl-coef", "0.01", "--gamma", "0.99"]
GSPO = ["--advantage-estimator", "gspo", "--loss-agg-mode", "seq-mean-token-mean"]
EVERY_TERM = ["--eps-clip-c", "3", "--use-tis", "--tis-mode", "mask", "--tis-level", "geometric", "--tis-clip-low",
              "0.5", "--rollout-rs", "token_k1,seq_max_k3", "--rollout-rs-threshold", "0.2_5.0,1.0", "--entropy-coef",
              "0.01", "--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-loss-type", "low_var_kl"]


def check_algorithm_rows(rows: list[dict], algo: list[str]) -> None:
    """The family's steps trained: finite, non-zero gradients (the rewards differ in every group) and the
    family's metric keys; with the off-policy corrections on, a synchronous step rejects nothing (the engine
    sampled with the trainer's weights)."""
    for row in rows:
        assert np.isfinite(row["train/loss"]) and np.isfinite(row["train/grad_norm"]) and row["train/grad_norm"] > 0
        assert {"train/ppo_kl", "train/pg_clipfrac_high", "train/advantage_mean", "train/advantage_std"} <= set(row)
    if "--use-tis" in algo:
        assert {"train/tis_weight_mean", "train/entropy_loss", "train/rollout_corr/k3_kl"} <= set(rows[0])
        assert rows[0]["train/kl"] >= 0
        for row in rows:
            assert row["train/rollout_corr/rs_masked_fraction"] == 0 == row["train/rollout_corr/is_masked_fraction"]
            assert abs(row["train/rollout_corr/kl"]) < 1e-4
            assert row["train/tis_weight_mean"] == pytest.approx(1, abs=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("layout, algo", [
    ([], REINFORCE_PP), (["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2"], EVERY_TERM)],
    ids=["tp2", "pp2"])
def test_engine_weights_equal_trainer_after_sync(ray_session, tiny_qwen2, digit_data, tmp_path, layout, algo):
    """TP=2: one source gathers the shards. PP=2: each stage's source sends its own layers through
    its own group; either way the engine ends with every tensor of the trainer, bit for bit. The step trains
    by REINFORCE++ (TP=2) and by GRPO with every per-token term on (PP=2): check_algorithm_rows."""
    from slime_rl.orchestration.cluster import Cluster

    # a reward that always differs within a group: the update must move the weights
    cfg = build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=1) + layout + algo
                       + ["--custom-rm-path", "tests.plugins.example_reward:index_reward"])
    cluster = Cluster(*preflight(cfg), api_key="test-secret")
    try:
        cluster.start(train_iters=2)
        cluster.generate(0)
        check_algorithm_rows([cluster.train(0)], algo)
        cluster.sync_weights(version="1")
        trainer = compare_engine_weights(cluster, "test-secret", "1")
        initial = load_file(str(tiny_qwen2 / "model.safetensors"))
        changed = sum(not np.array_equal(initial[name].numpy(), t) for name, t in trainer.items())
        assert set(trainer) == set(initial)
        assert changed > 0  # the update moved the weights, and the engine has the moved ones
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_delta_weights_through_files_reach_the_engine(ray_session, tiny_qwen2, digit_data, tmp_path):
    """slime's disk delta transport (its examples/delta_weight_sync), at PP=2: each stage's source writes its
    part of a version; the engine's host applies version 1 to a checkpoint it builds from --hf-checkpoint, then
    version 2 to that; after each sync the engine holds every tensor of the trainer, bit for bit."""
    from slime_rl.orchestration.cluster import Cluster

    shared, local = tmp_path / "shared", tmp_path / "local"
    cfg = build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2)
                       + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "2",
                          "--update-weight-transport", "disk", "--update-weight-mode", "delta",
                          "--update-weight-disk-dir", str(shared), "--update-weight-local-checkpoint-dir", str(local),
                          "--custom-rm-path", "tests.plugins.example_reward:index_reward"])
    cluster = Cluster(*preflight(cfg), api_key="test-secret")
    try:
        # a schedule of 2 iterations left every weight of the second step as it was (no byte changed); of 4, both
        # steps move them
        cluster.start(train_iters=4)
        for step in (0, 1):
            cluster.generate(step)
            cluster.train(step)
            metrics = cluster.sync_weights(version=str(step + 1))
            assert metrics["weight_sync/bytes"] > 0 and metrics["perf/weight_sync_load_s"] > 0, metrics
            compare_engine_weights(cluster, "test-secret", str(step + 1))
        versions = sorted(p.name for p in shared.iterdir())
        last = shared / versions[-1]
        assert len(versions) == 2 and sorted(p.name for p in last.iterdir()) == [
            "delta-pp000.safetensors", "delta-pp001.safetensors", "index-pp000.json", "index-pp001.json", "index.json"]
        index = json.loads((last / "index.json").read_text())
        assert (index["mode"], index["encoding"], index["checksum"]) == ("delta", "xor", "xxh3-128")
        assert json.loads((local / "slime_rl_weights_version.json").read_text())["version"] == int(last.name[1:])
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_async_overlaps_rollout_with_training_and_syncs_between(ray_session, tiny_qwen2, digit_data, tmp_path):
    """--async, scored by an EasyR1-style reward file called per sample."""
    cfg = build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=3) + ["--async"]
                       + easyr1_reward("compute_score"))
    rows = train(*preflight(cfg))
    check_easyr1_reward(tmp_path / "run", rows[0])
    assert [r["step"] for r in rows] == [0, 1, 2]
    for k in range(2):
        # rollout k+1 started before training k ended (overlap) ...
        assert rows[k + 1]["time/rollout_start"] < rows[k]["time/train_end"]
        # ... and the weights moved only once rollout k+1 was over (never during a generate call)
        assert rows[k]["time/sync_start"] >= rows[k + 1]["time/rollout_end"]
    assert rows[0]["train/rollout_logprob_abs_diff"] <= 1e-3  # step 0 was generated by the same weights
    assert all(np.isfinite(r["train/loss"]) for r in rows)


@pytest.mark.slow
def test_dapo_dynamic_sampling_partial_rollout_and_eval(ray_session, tiny_qwen2, digit_data, tmp_path):
    """DAPO's dynamic sampling with partial rollout, and eval from slime's --eval-config: two sets, one with
    the defaults (2 samples per prompt), one with its own sample count, reward type and sampling."""
    few = tmp_path / "few.jsonl"
    few.write_text("".join(digit_data.read_text().splitlines(keepends=True)[:4]))
    (tmp_path / "eval.yaml").write_text(f"""eval:
  defaults:
    n_samples_per_eval_prompt: 2
  datasets:
    - name: digits
      path: {digit_data}
    - name: few
      path: {few}
      n_samples_per_eval_prompt: 3
      rm_type: f1
      temperature: 0.0
      max_response_len: 3
""")
    extra = ["--dynamic-sampling-filter-path", "slime_rl.rollout.filters.check_reward_nonzero_std",
             "--over-sampling-batch-size", "8", "--partial-rollout", "--eval-interval", "1",
             "--eval-config", str(tmp_path / "eval.yaml")]
    cfg = build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2) + extra)
    rows = train(*preflight(cfg))
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [-1, 0, 1]  # eval before training, then the steps
    assert 0.0 <= lines[0]["eval/digits/reward_mean"] <= 1.0 and "eval/digits/pass@2" in lines[0]
    assert lines[0]["eval/digits/n_samples"] == 2.0 and lines[0]["eval/few/n_samples"] == 3.0  # its own count
    assert 0.0 <= lines[0]["eval/few/reward_mean"] <= 1.0
    for row in rows:
        assert row["rollout/groups_kept"] == 4  # exactly --rollout-batch-size groups survive the filter
        assert row["rollout/zero_std_group_frac"] == 0.0  # DAPO: only groups whose rewards differ
        assert row["train/grad_norm"] > 0
        assert "eval/digits/reward_mean" in row


@pytest.mark.slow
def test_over_sampling_aborts_land_and_partial_rollout_resumes_them(ray_session, tiny_qwen2, digit_data, tmp_path):
    """8 groups drawn for 4: the even groups stop after 4 tokens and fill the batch while the odd ones
    (whole budget) are still on the engine. Their requests are aborted by exact rid (the built-in
    engine, like SGLang, drops any other rid): they come back ABORTED with their tokens so far and
    are continued first next step. Scored by an EasyR1-style reward file called once per group (--group-rm)."""
    extra = ["--over-sampling-batch-size", "8", "--partial-rollout", "--rollout-max-response-len", "96",
             "--custom-generate-function-path", "tests.plugins.odd_groups_slow.generate",
             *easyr1_reward("compute_score_batch")]
    rows = train(*preflight(build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2) + extra)))
    check_easyr1_reward(tmp_path / "run", rows[0])
    first, second = rows
    assert first["rollout/groups_kept"] == 4 and first["rollout/abort_requests"] > 0
    assert first["rollout/groups_aborted"] >= 1  # the abort reached requests still running
    assert first["rollout/groups_leftover"] == first["rollout/groups_aborted"] + first["rollout/groups_surplus"] == 4
    assert second["rollout/groups_resumed"] == 4 and second["rollout/groups_kept"] == 4
    assert second["rollout/response_len_mean"] == 96  # the resumed odd groups ran their whole budget
    assert all(np.isfinite(r["train/loss"]) for r in rows)


@pytest.mark.slow
def test_resume_continues_exactly(ray_session, tiny_qwen2, digit_data, tmp_path):
    """4 steps saved every step (saving changes nothing in a run), then a new cluster, --load of the
    iteration folder of step 1 (not the newest: what a user reaches for when the newest is bad) into a new
    --save folder, 2 more steps: steps 2-3 match the first run's, and its folder is not touched. Rollouts
    repeat because every request is seeded from the sample index (--deterministic-rollout); the trainer
    state (weights, Adam, scheduler, RNG) and the data position come from the checkpoint. The same folder
    as --save, where the first run's steps 2 and 3 would be overwritten, is refused before anything starts.
    Both runs train GSPO (a sequence-level ratio: check_algorithm_rows)."""
    import hashlib

    from slime_rl.config import ConfigError
    from slime_rl.trainer.checkpoint import latest_checkpoint

    det = ["--deterministic-rollout", "--custom-rm-path", "tests.plugins.example_reward:index_reward", *GSPO]
    ckpt = tmp_path / "ckpt"
    straight = train(*_cfg_plan(argv(tiny_qwen2, digit_data, tmp_path / "b", steps=4) + det
                                + ["--save", str(ckpt), "--save-interval", "1", "--keep-last", "3"]))
    assert [r["step"] for r in straight] == [0, 1, 2, 3]
    check_algorithm_rows(straight, GSPO)
    assert latest_checkpoint(ckpt).name == "iter_0000003" and not (ckpt / "iter_0000000").exists()  # keep-last 3

    def checksums() -> dict[str, str]:
        return {str(f.relative_to(ckpt)): hashlib.sha256(f.read_bytes()).hexdigest()
                for f in sorted(ckpt.rglob("*")) if f.is_file()}

    before = checksums()
    resume = argv(tiny_qwen2, digit_data, tmp_path / "c", steps=4) + det + ["--load", str(ckpt / "iter_0000001")]
    with pytest.raises(ConfigError, match=r"already holds later checkpoints \(iter_0000002, iter_0000003\)"):
        _cfg_plan(resume + ["--save", str(ckpt)])
    resumed = train(*_cfg_plan(resume + ["--save", str(tmp_path / "from-1")]))
    assert [r["step"] for r in resumed] == [2, 3]
    for a, b in zip(straight[2:], resumed, strict=True):
        for key in ("rollout/reward_mean", "rollout/response_len_mean", "train/loss", "train/grad_norm"):
            assert a[key] == b[key], (a["step"], key, a[key], b[key])
        # the engines were restarted with the HF weights: the resume pushed the checkpoint's to them
        assert b["train/rollout_logprob_abs_diff"] <= 1e-5
    assert checksums() == before  # the folder resumed from is as it was
    assert latest_checkpoint(tmp_path / "from-1").name == "iter_0000003"


def _cfg_plan(args):
    return preflight(build_config(args))


EASYR1_REWARD = Path(__file__).resolve().parents[1] / "rewards" / "plugins" / "easyr1_reward.py"


def easyr1_reward(form: str) -> list[str]:
    """Flags of an EasyR1-style reward file (compute_score -> overall/format/accuracy), loaded by file path,
    per sample (`compute_score`) or one call per group (`compute_score_batch` with `--group-rm`)."""
    extra = ["--group-rm"] if form == "compute_score_batch" else []
    return ["--custom-rm-path", f"{EASYR1_REWARD}:{form}", "--reward-key", "overall", "--dump-rollouts", *extra]


def check_easyr1_reward(run_dir: Path, row: dict) -> None:
    """The reward file's other keys are logged, and each dumped sample of step 0 (all 16 trained) holds
    the file's "overall" for its response as its reward, with the other keys beside it."""
    from slime_rl.data import Sample
    from tests.rewards.plugins.easyr1_reward import compute_score

    assert {"rollout/reward/format", "rollout/reward/accuracy"} <= set(row)
    assert np.isfinite(row["train/loss"])
    dumped = [json.loads(x) for x in (run_dir / "rollouts" / "step_000000.jsonl").read_text().splitlines()]
    assert len(dumped) == 16 and all(set(d["reward_metrics"]) >= {"format", "accuracy"} for d in dumped)
    for d in dumped:  # the logged reward is the file's "overall" for that response
        again = compute_score(Sample(index=0, group_index=0, prompt=d["prompt"], prompt_ids=[], label=d["label"],
                                     response=d["response"]))
        assert d["reward"] == again["overall"]
