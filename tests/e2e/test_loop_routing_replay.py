"""Rollout routing replay in the loop (slime's R3, --use-rollout-routing-replay) on CPU in fp32: Ray,
one Megatron rank on gloo, the built-in engine serving the tiny Qwen3-MoE.

The engine is made to route unlike the trainer: its experts are chosen from router logits rounded to
fp8 e5m2 (the test-only SLIME_RL_DEBUG_ROUTING_SELECT_ROUND, engines/embedded/routing.py; bf16
rounding flips no choice of this model, whose router is far from ties), while its gate weights stay
the fp32 probabilities of the chosen experts. Without replay the step-0 gap between the engine's and
the trainer's log-probs comes from those flips; with replay the trainer routes as the engine did and
the gap is fp32 noise; train/routing_agreement counts the (token, layer) pairs the trainer's own
router would have chosen alike.
"""

from __future__ import annotations

import pytest

from slime_rl.config import build_config
from slime_rl.config.builtin_engine import ROUTING_SELECT_ROUND_ENV
from slime_rl.train import preflight
from tests.loop_checks import digit_data_fixture

digit_data = digit_data_fixture(64, seed=1)


def _step0(tiny_qwen3_moe, digit_data, run_dir, *extra: str) -> dict:
    from slime_rl.orchestration.cluster import Cluster

    cfg = build_config([
        "--hf-checkpoint", str(tiny_qwen3_moe), "--prompt-data", str(digit_data), "--run-dir", str(run_dir),
        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--rollout-batch-size", "4",
        "--n-samples-per-prompt", "4", "--global-batch-size", "16", "--micro-batch-size", "4",
        "--rollout-max-response-len", "8", "--num-rollout", "1", "--lr", "0.003", "--rollout-shuffle",
        "--custom-rm-path", "tests.plugins.example_reward:index_reward", *extra])
    cluster = Cluster(*preflight(cfg), api_key="test-secret")
    try:
        cluster.start(train_iters=1)
        cluster.generate(0)
        return cluster.train(0)
    finally:
        cluster.shutdown()


@pytest.mark.slow
def test_replay_closes_the_step0_gap_of_flipped_routing(ray_session, tiny_qwen3_moe, digit_data, tmp_path,
                                                        monkeypatch):
    monkeypatch.setenv(ROUTING_SELECT_ROUND_ENV, "fp8_e5m2")
    free = _step0(tiny_qwen3_moe, digit_data, tmp_path / "free")
    replay = _step0(tiny_qwen3_moe, digit_data, tmp_path / "replay", "--use-rollout-routing-replay")
    print(f"step-0 |old - rollout|: without replay {free['train/rollout_logprob_abs_diff']:.3g}, with "
          f"{replay['train/rollout_logprob_abs_diff']:.3g}; agreement {replay['train/routing_agreement']:.4f}")
    assert free["train/rollout_logprob_abs_diff"] > 1e-4
    assert "train/routing_agreement" not in free  # the engines were not asked for their routing
    assert replay["train/rollout_logprob_abs_diff"] <= 1e-6
    assert 0.5 < replay["train/routing_agreement"] < 1


@pytest.mark.slow
def test_without_flips_the_trainer_agrees_with_every_choice(ray_session, tiny_qwen3_moe, digit_data, tmp_path,
                                                            monkeypatch):
    monkeypatch.delenv(ROUTING_SELECT_ROUND_ENV, raising=False)
    m = _step0(tiny_qwen3_moe, digit_data, tmp_path / "same", "--use-rollout-routing-replay")
    assert m["train/routing_agreement"] == 1.0
    assert m["train/rollout_logprob_abs_diff"] <= 1e-6


@pytest.mark.slow
def test_r2_alone_trains_two_mini_batches_in_the_loop(ray_session, tiny_qwen3_moe, digit_data, tmp_path,
                                                      monkeypatch):
    """--use-routing-replay alone (slime's R2) through the loop: two mini-batches per rollout, so the
    old-log-prob pass runs separately and its routing is replayed (tests/trainer/test_routing_replay_r2.py
    checks the replay itself); the engines are not asked for their routing."""
    monkeypatch.delenv(ROUTING_SELECT_ROUND_ENV, raising=False)
    m = _step0(tiny_qwen3_moe, digit_data, tmp_path / "r2", "--use-routing-replay", "--global-batch-size", "8")
    assert "train/routing_agreement" not in m
    assert m["train/rollout_logprob_abs_diff"] <= 1e-6  # the old pass routes as the engine, on its own
    assert m["train/grad_norm"] > 0
