"""Qwen2.5-VL through the loop on GPUs: trainer rank on GPU 0 (Megatron decoder + HF vision tower,
NCCL), built-in engine on GPU 1, NCCL weight sync of every tensor. Needs 2 GPUs; marked `gpu`."""

from __future__ import annotations

import json

import pytest

from slime_rl.config import build_config
from slime_rl.data.vl_counting import make_rows, write_jsonl
from slime_rl.train import preflight, train

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_gpu_vl_loop(ray_gpu, tiny_qwen2_5_vl, tmp_path, bf16):
    data = write_jsonl(make_rows(32, seed=5, image_dir=tmp_path / "imgs", size=56), tmp_path / "train.jsonl")
    argv = ["--config", "configs/vl_counting_cpu.yaml", "--hf-checkpoint", str(tiny_qwen2_5_vl),
            "--prompt-data", str(data), "--run-dir", str(tmp_path / "run"), "--rollout-batch-size", "8",
            "--n-samples-per-prompt", "8", "--global-batch-size", "64", "--micro-batch-size", "32",
            "--min-pixels", "3136", "--max-pixels", "3136", "--num-rollout", "3"] + (["--bf16"] if bf16 else [])
    cfg, plan = preflight(build_config(argv))
    assert plan.use_gpu
    rows = train(cfg, plan)
    diffs = [r["train/rollout_logprob_abs_diff"] for r in rows]
    print(json.dumps({"bf16": bf16, "lp_diff": diffs, "sync_GBps": [r["perf/weight_sync_GBps"] for r in rows]}))
    assert len(rows) == 3 and all(r["perf/weight_sync_GBps"] > 0 for r in rows)
    if bf16:
        assert max(diffs) <= 2e-2, diffs
    else:
        assert diffs[0] <= 1e-3 and max(diffs[1:]) <= 1e-2, diffs
