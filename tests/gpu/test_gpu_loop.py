"""The loop on GPUs: trainer rank on GPU 0 (Megatron, NCCL), built-in engine on GPU 1, weights
broadcast over NCCL. Same code as the CPU e2e test; needs 2 GPUs. Marked `gpu`."""

from __future__ import annotations

import json

import pytest

from slime_rl.config import build_config
from slime_rl.observability import REQUIRED_KEYS
from slime_rl.train import preflight, train
from tests.loop_checks import one_step_then_compare_weights

pytestmark = pytest.mark.gpu


def argv(model, data, run_dir, bf16):
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--run-dir", str(run_dir),
            "--rollout-num-gpus", "1", "--rollout-batch-size", "16", "--n-samples-per-prompt", "8",
            "--global-batch-size", "64", "--micro-batch-size", "32", "--rollout-max-response-len", "8",
            "--num-rollout", "3", "--rm-type", "digit", "--lr", "0.002"] + (["--bf16"] if bf16 else [])


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_gpu_loop_nccl_sync(ray_gpu, wider_model, tmp_path, bf16):
    from slime_rl.data.digits import make_rows, write_jsonl

    data = write_jsonl(make_rows(64, seed=2), tmp_path / "d.jsonl")
    cfg = build_config(argv(wider_model, data, tmp_path / "run", bf16))
    cfg, plan = preflight(cfg)
    assert plan.use_gpu
    rows = train(cfg, plan)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == rows and len(rows) == 3
    for row in rows:
        assert not set(REQUIRED_KEYS) - set(row)
        assert row["perf/weight_sync_GBps"] > 0
        print(json.dumps({k: row[k] for k in REQUIRED_KEYS}))
    diffs = [r["train/rollout_logprob_abs_diff"] for r in rows]
    if bf16:
        assert max(diffs) <= 2e-2, diffs
    else:
        assert diffs[0] <= 1e-3 and max(diffs[1:]) <= 1e-2, diffs


def test_gpu_engine_weights_equal_trainer(ray_gpu, wider_model, tmp_path):
    from slime_rl.data.digits import make_rows, write_jsonl
    from slime_rl.orchestration.cluster import Cluster

    data = write_jsonl(make_rows(64, seed=3), tmp_path / "d.jsonl")
    cfg = build_config(argv(wider_model, data, tmp_path / "run", bf16=False))
    cluster = Cluster(*preflight(cfg), api_key="k")
    try:
        one_step_then_compare_weights(cluster, api_key="k")
    finally:
        cluster.shutdown()
