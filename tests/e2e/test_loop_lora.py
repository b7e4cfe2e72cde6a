"""The loop on CPU with LoRA (--lora-rank 8): Ray actors, Megatron ranks on gloo training the adapters only,
the built-in engine receiving merged weights. The quickstart's layout (TP=2, one engine) on the tiny Qwen2,
and the attention of the tiny Qwen3-MoE with its experts over two expert-parallel ranks."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.torch import load_file

from slime_rl.config import build_config
from slime_rl.engines.client import EngineClient
from slime_rl.train import preflight
from tests.loop_checks import digit_data_fixture

digit_data = digit_data_fixture(64, seed=1)
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _engines_hold(cluster, trainer: dict, version: str) -> None:
    for url in cluster.engine_urls:
        with EngineClient(url, api_key="test-secret") as client:
            assert client.get_model_info()["weight_version"] == version
            for name, expected in trainer.items():
                got = np.asarray(client.get_weights_by_name(name, truncate_size=10**9), dtype=np.float32)
                assert np.array_equal(got.reshape(-1), expected.reshape(-1)), name


@pytest.mark.slow
@pytest.mark.parametrize("folder, colocate", [("tiny_qwen2", False), ("tiny_qwen2", True), ("tiny_qwen3_moe", False)])
def test_lora_steps_send_merged_weights(ray_session, folder, colocate, digit_data, tmp_path, request):
    """Two steps. Step 0's log-probs agree with the engine's (B = 0: the base); after each update and sync
    every engine tensor equals the trainer's merged one bit for bit, the next step's log-probs agree again
    (the engine generates with base + B A alpha / r), and exactly the adapted linears moved. Colocated: an
    engine beside each of the TP-2 trainer's two ranks, the merged tensors handed over in place."""
    from slime_rl.orchestration.cluster import Cluster

    ckpt = request.getfixturevalue(folder)
    moe = folder == "tiny_qwen3_moe"
    layout = (["--expert-model-parallel-size", "2", "--lora-target-modules", ",".join(ATTENTION)] if moe
              else ["--tensor-model-parallel-size", "2"])
    if colocate:
        layout += ["--colocate", "--rollout-num-gpus", "2"]
    cfg = build_config([
        "--hf-checkpoint", str(ckpt), "--prompt-data", str(digit_data), "--run-dir", str(tmp_path / "run"),
        *layout, "--actor-num-gpus-per-node", "2", *([] if colocate else ["--rollout-num-gpus", "1"]),
        "--lora-rank", "8",
        "--lora-alpha", "16", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--micro-batch-size", "4", "--rollout-max-response-len", "6", "--num-rollout", "2", "--lr", "0.01",
        "--rollout-shuffle", "--update-weight-buffer-size", "20000",
        "--custom-rm-path", "tests.plugins.example_reward:index_reward"])
    cluster = Cluster(*preflight(cfg), api_key="test-secret")
    initial = load_file(str(ckpt / "model.safetensors"))
    try:
        cluster.start(train_iters=2)
        for step in range(2):
            cluster.generate(step)
            metrics = cluster.train(step)
            assert metrics["train/rollout_logprob_abs_diff"] <= 1e-3, (step, metrics)
            cluster.sync_weights(version=str(step + 1))
            trainer = cluster.trainers.hf_weights()
            _engines_hold(cluster, trainer, str(step + 1))
        moved = {n for n, t in trainer.items() if not np.array_equal(initial[n].numpy(), t)}
        adapted = {n for n in trainer if n.endswith(".weight")
                   and n.rsplit(".", 2)[-2] in (ATTENTION if moe else ATTENTION + MLP)}
        assert moved == adapted  # norms, embeddings, routers and experts as loaded
    finally:
        cluster.shutdown()
