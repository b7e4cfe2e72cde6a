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


def _random_adapter(ckpt, folder, r: int):
    """A PEFT folder adapting every linear of the tiny model with random A and B (B != 0: not the base)."""
    import json

    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(5)
    tensors = {}
    for name, t in load_file(str(ckpt / "model.safetensors")).items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in ATTENTION + MLP:
            module = name.removesuffix(".weight")
            tensors[f"base_model.model.{module}.lora_A.weight"] = torch.randn(r, t.shape[1], generator=g) * 0.1
            tensors[f"base_model.model.{module}.lora_B.weight"] = torch.randn(t.shape[0], r, generator=g) * 0.1
    folder.mkdir()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 16,
                                                            "target_modules": list(ATTENTION + MLP)}))
    return folder


def _engines_hold(cluster, trainer: dict, version: str) -> None:
    for url in cluster.engine_urls:
        with EngineClient(url, api_key="test-secret") as client:
            assert client.get_model_info()["weight_version"] == version
            for name, expected in trainer.items():
                got = np.asarray(client.get_weights_by_name(name, truncate_size=10**9), dtype=np.float32)
                assert np.array_equal(got.reshape(-1), expected.reshape(-1)), name


@pytest.mark.slow
@pytest.mark.parametrize("folder, colocate, sync", [("tiny_qwen2", False, "merged"), ("tiny_qwen2", True, "adapter"),
                                                   ("tiny_qwen3_moe", False, "merged")])
def test_lora_steps_send_merged_weights(ray_session, folder, colocate, sync, digit_data, tmp_path, request):
    """Two steps. Step 0's log-probs agree with the engine's (B = 0: the base); after each update and sync
    every engine tensor equals the trainer's merged one bit for bit, the next step's log-probs agree again
    (the engine generates with base + B A alpha / r), and exactly the adapted linears moved. Colocated: an
    engine beside each of the TP-2 trainer's two ranks, with --lora-sync adapter: the first sync sends the
    base (the release dropped it) and the adapters, the second the adapters alone (PEFT's tensors, by value),
    which the engine merges itself; the rollout's requests name the newest adapters (the built-in engine
    refuses a request that names none while it serves one)."""
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
        "--lora-rank", "8", "--lora-alpha", "16", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--global-batch-size", "8",
        "--micro-batch-size", "4", "--rollout-max-response-len", "6", "--num-rollout", "2", "--lr", "0.01",
        "--rollout-shuffle", "--update-weight-buffer-size", "20000",
        "--custom-rm-path", "tests.plugins.example_reward:index_reward", "--lora-sync", sync,
        *(["--lora-load", str(_random_adapter(ckpt, tmp_path / "start", 8))] if sync == "adapter" else [])])
    cluster = Cluster(*preflight(cfg), api_key="test-secret")
    initial = load_file(str(ckpt / "model.safetensors"))
    try:
        cluster.start(train_iters=2)
        assert cluster.resume() == 0  # --lora-load: the engines get the loaded adapters before step 0
        for step in range(2):
            cluster.generate(step)
            if colocate:  # as the loop does: the engines' memory goes to the trainer until the sync
                cluster.release_engines()
            metrics = cluster.train(step)
            assert metrics["train/rollout_logprob_abs_diff"] <= 1e-3, (step, metrics)
            synced = cluster.sync_weights(version=str(step + 1))
            trainer = cluster.trainers.hf_weights()
            _engines_hold(cluster, trainer, str(step + 1))
            if sync == "adapter":  # r x (in + out) per adapted linear, fp32: counted from the trainer's shapes
                adapted = [t for n, t in trainer.items() if n.endswith(".weight") and n.rsplit(".", 2)[-2] in MLP
                           + ATTENTION]
                assert synced["weight_sync/adapter_bytes"] == sum(8 * sum(t.shape) * 4 for t in adapted)
                # the base went by the first sync (resume), and the releases kept it on the host (weights
                # backup): each engine's request carries the adapters (base64, > their bytes), not the model
                n = len(cluster.engine_urls)
                assert n * synced["weight_sync/adapter_bytes"] < synced["weight_sync/bytes"] < sum(
                    t.nbytes for t in trainer.values()), synced
        moved = {n for n, t in trainer.items() if not np.array_equal(initial[n].numpy(), t)}
        adapted = {n for n in trainer if n.endswith(".weight")
                   and n.rsplit(".", 2)[-2] in (ATTENTION if moe else ATTENTION + MLP)}
        assert moved == adapted  # norms, embeddings, routers and experts as loaded
    finally:
        cluster.shutdown()
