"""The whole loop on CPU: Ray actors, Megatron TP=2 ranks on gloo, the built-in engine over HTTP,
and the gloo broadcast of weights. Nothing is faked here."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.torch import load_file

from slime_rl.config import build_config
from slime_rl.observability import REQUIRED_KEYS
from slime_rl.train import preflight, train
from tests.loop_checks import one_step_then_compare_weights

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def argv(model, data, run_dir, steps):
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--run-dir", str(run_dir),
            "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
            "--micro-batch-size", "4", "--rollout-max-response-len", "6", "--num-rollout", str(steps),
            "--rm-type", "digit", "--lr", "0.003", "--rollout-shuffle", "--update-weight-buffer-size", "20000"]


@pytest.fixture(scope="module")
def digit_data(tmp_path_factory):
    from slime_rl.data.digits import make_rows, write_jsonl

    return write_jsonl(make_rows(64, seed=1), tmp_path_factory.mktemp("data") / "digits.jsonl")


def test_two_steps_write_metrics_and_logprobs_agree(ray_session, tiny_qwen2, digit_data, tmp_path):
    cfg = build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2))
    rows = train(cfg, preflight(cfg))
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


def test_engine_weights_equal_trainer_after_sync(ray_session, tiny_qwen2, digit_data, tmp_path):
    from slime_rl.orchestration.cluster import Cluster

    cfg = build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=1))
    cluster = Cluster(cfg, preflight(cfg), api_key="test-secret")
    try:
        trainer = one_step_then_compare_weights(cluster, api_key="test-secret")
        initial = load_file(str(tiny_qwen2 / "model.safetensors"))
        changed = sum(not np.array_equal(initial[name].numpy(), t) for name, t in trainer.items())
        assert set(trainer) == set(initial)
        assert changed > 0  # the update moved the weights, and the engine has the moved ones
    finally:
        cluster.shutdown()
