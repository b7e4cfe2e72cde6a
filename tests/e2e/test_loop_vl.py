"""The whole loop with a vision-language model on CPU (issue #8's acceptance): a tiny Qwen2.5-VL,
the synthetic counting pictures, the built-in engine serving images, Megatron TP=2 ranks with the
HF vision tower, gloo weight sync of every tensor (visual.* included). The step-0 log-prob gap
between engine and trainer can only be small if both put the same image features at the same
tokens with the same 3-D positions."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.torch import load_file

from slime_rl.config import build_config
from slime_rl.data.vl_counting import make_rows, write_jsonl
from slime_rl.train import preflight
from tests.loop_checks import compare_engine_weights


@pytest.fixture(scope="module")
def vl_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("vl_data")
    return write_jsonl(make_rows(32, seed=3, image_dir=d / "train_images", size=56), d / "train.jsonl")


def argv(model, data, run_dir, steps: int, *extra: str) -> list[str]:
    return ["--config", "configs/vl_counting_cpu.yaml", "--hf-checkpoint", str(model), "--prompt-data", str(data),
            "--run-dir", str(run_dir), "--tensor-model-parallel-size", "2", "--actor-num-gpus-per-node", "2",
            "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
            "--micro-batch-size", "4", "--min-pixels", "3136", "--max-pixels", "3136", "--num-rollout", str(steps),
            "--update-weight-buffer-size", "20000", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("freeze", [False, True], ids=["trained", "frozen"])
def test_engine_holds_trainer_weights_after_sync(ray_session, tiny_qwen2_5_vl, vl_data, tmp_path, freeze):
    """After one update and a sync the engine's tensors equal the trainer's, bit for bit; the
    vision tower moved unless frozen (then the sync sent it once and it stayed the checkpoint's).
    Trained: a second step, generated with those weights, has a small log-prob gap too."""
    from slime_rl.orchestration.cluster import Cluster

    extra = ["--custom-rm-path", "tests.plugins.example_reward:index_reward"]
    cfg = build_config(argv(tiny_qwen2_5_vl, vl_data, tmp_path / "run", 2, *extra)
                       + (["--freeze-vision-tower"] if freeze else []))
    cluster = Cluster(*preflight(cfg), api_key="test-secret")
    try:
        cluster.start(train_iters=4)
        rows = [cluster.generate(0) | cluster.train(0)]
        rows[0] |= cluster.sync_weights(version="1")
        trainer = compare_engine_weights(cluster, "test-secret", "1")
        if not freeze:
            rows.append(cluster.generate(1) | cluster.train(1))
    finally:
        cluster.shutdown()
    initial = load_file(str(tiny_qwen2_5_vl / "model.safetensors"))
    assert set(trainer) == set(initial)
    moved = {n for n, t in trainer.items() if not np.array_equal(initial[n].numpy(), t)}
    assert any(n.startswith("model.layers.") for n in moved)
    vision_moved = any(n.startswith("visual.") for n in moved)
    assert vision_moved is not freeze
    print("VL loop:", [(r["train/rollout_logprob_abs_diff"], r["train/grad_norm"]) for r in rows])
    # step 0: the same weights on both sides, so only image tokens/positions could make a gap
    assert rows[0]["train/rollout_logprob_abs_diff"] <= 1e-3
    assert rows[0]["perf/weight_sync_GBps"] > 0
    assert all(np.isfinite(r["train/loss"]) for r in rows)
    if not freeze:  # step 1 was generated with the broadcast weights of step 0's update (vision tower included)
        assert rows[1]["train/rollout_logprob_abs_diff"] <= 1e-2
