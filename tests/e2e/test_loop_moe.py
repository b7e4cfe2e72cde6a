"""The loop on CPU with a mixture-of-experts policy (issue 22): Ray actors, Megatron ranks with the
experts spread over two expert-parallel ranks (EP=2, DP=2) on gloo, the built-in engine serving the
HF Qwen3-MoE, Qwen2-MoE or GLM-4.5 model, weight sync sending every expert under its HF name."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.torch import load_file

from slime_rl.config import build_config
from slime_rl.engines.client import EngineClient
from slime_rl.train import preflight
from tests.loop_checks import digit_data_fixture

digit_data = digit_data_fixture(64, seed=1)


@pytest.mark.slow
@pytest.mark.parametrize("folder", ["tiny_qwen3_moe", "tiny_qwen2_moe", "tiny_glm4_moe", "tiny_deepseek_v3",
                                    "tiny_glm4_moe_lite_mtp"])
def test_expert_parallel_step_then_engine_holds_every_expert(ray_session, folder, digit_data, tmp_path, request):
    """Step 0: the engine (HF transformers, experts fused) and the trainer (Megatron, EP=2) see the
    same weights, so their log-probs agree; after the update and the sync every engine tensor,
    each expert under its HF name, equals the trainer's bit for bit, and the update moved them.
    Qwen2-MoE: its shared expert, the shared expert's gate and the dense layer too. GLM-4.5: its shared
    experts, the dense layer 0 and the sigmoid router's expert bias, sent as stored and never trained.
    DeepSeek-V3: the same under multi-latent attention, whose projections and latent norms move too, with the
    experts as grouped products (--moe-grouped-gemm). GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's layers under
    GLM's model_type, served by transformers' Glm4MoeLiteForCausalLM, with its multi-token-prediction layer trained
    (--mtp-num-layers 1 --enable-mtp-training: train/mtp_loss, the layer's experts spread over EP too) and sent,
    which the built-in engine, having no draft model, takes and drops as SGLang's target model does."""
    from slime_rl.orchestration.cluster import Cluster

    ckpt = request.getfixturevalue(folder)

    cfg = build_config([
        "--hf-checkpoint", str(ckpt), "--prompt-data", str(digit_data), "--run-dir", str(tmp_path / "run"),
        "--expert-model-parallel-size", "2", "--actor-num-gpus-per-node", "2", "--rollout-num-gpus", "1",
        "--moe-aux-loss-coeff", "0.01", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
        "--global-batch-size", "8", "--micro-batch-size", "4", "--rollout-max-response-len", "6",
        "--num-rollout", "1", "--lr", "0.003", "--rollout-shuffle", "--update-weight-buffer-size", "20000",
        "--custom-rm-path", "tests.plugins.example_reward:index_reward",
        # DeepSeek-V3's run also takes the grouped experts (trainer/experts.py), as slime's scripts ask for them
        *(["--moe-grouped-gemm"] if folder == "tiny_deepseek_v3" else []),
        *(["--mtp-num-layers", "1", "--enable-mtp-training"] if folder == "tiny_glm4_moe_lite_mtp" else [])])
    assert cfg.parallel.expert_model_parallel_size == 2
    assert cfg.trainer.moe_grouped_gemm == (folder == "tiny_deepseek_v3")
    cluster = Cluster(*preflight(cfg), api_key="test-secret")
    try:
        cluster.start(train_iters=2)
        cluster.generate(0)
        metrics = cluster.train(0)
        assert metrics["train/rollout_logprob_abs_diff"] <= 1e-3, metrics["train/rollout_logprob_abs_diff"]
        assert 0.5 < metrics["train/moe_load_balancing_loss"] < 8
        mtp = "model.layers.4." if folder == "tiny_glm4_moe_lite_mtp" else None  # the MTP layer's HF names
        assert (metrics.get("train/mtp_loss", 0) > 0) == bool(mtp), metrics
        cluster.sync_weights(version="1")
        trainer = cluster.trainers.hf_weights()
        initial = load_file(str(ckpt / "model.safetensors"))
        assert set(trainer) == set(initial)  # every expert, under its HF name
        for url in cluster.engine_urls:
            with EngineClient(url, api_key="test-secret") as client:
                assert client.get_model_info()["weight_version"] == "1"
                for name, expected in trainer.items():
                    if mtp and name.startswith(mtp):  # the draft model's: no such parameter in the engine
                        continue
                    got = np.asarray(client.get_weights_by_name(name, truncate_size=10**9), dtype=np.float32)
                    assert got.size == expected.size, name
                    assert np.array_equal(got.reshape(-1), expected.reshape(-1)), name
        moved = [n for n, t in trainer.items() if not np.array_equal(initial[n].numpy(), t)]
        assert any(".mlp.experts." in n for n in moved) and any(".mlp.gate." in n for n in moved)
        if folder == "tiny_qwen2_moe":
            assert any(".mlp.shared_expert_gate." in n for n in moved)
            assert any(".mlp.shared_expert." in n for n in moved)
            assert "model.layers.2.mlp.down_proj.weight" in moved  # the dense layer
        if mtp:  # the MTP layer trained: its own tensors and its experts moved
            assert {mtp + "eh_proj.weight", mtp + "enorm.weight"} <= set(moved)
            assert any(n.startswith(mtp + "mlp.experts.") for n in moved)
        if folder in ("tiny_deepseek_v3", "tiny_glm4_moe_lite_mtp"):
            assert {f"model.layers.1.self_attn.{n}.weight" for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa",
                                                                     "kv_b_proj", "kv_a_layernorm")} <= set(moved)
        if folder in ("tiny_glm4_moe", "tiny_deepseek_v3", "tiny_glm4_moe_lite_mtp"):
            assert any(".mlp.shared_experts." in n for n in moved)
            assert "model.layers.0.mlp.down_proj.weight" in moved  # the dense layer (first_k_dense_replace 1)
            biases = [n for n in trainer if n.endswith("e_score_correction_bias")]
            # sent, equal on the engine, unchanged (the MTP layer's router has one too)
            assert len(biases) == 3 + bool(mtp) and not set(biases) & set(moved)
    finally:
        cluster.shutdown()
