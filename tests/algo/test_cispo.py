"""CISPO (algo/cispo.py) against MiniMax-M1's eq. 4 written out per token in float64, and through the
estimator registry."""

from __future__ import annotations

import math

import pytest
import torch

from slime_rl.algo.cispo import cispo_loss
from slime_rl.algo.estimators import estimator_for
from slime_rl.config import ConfigError, build_config
from slime_rl.config.groups import AlgoConfig

F64 = torch.float64


def test_value_gradient_and_clipped_tokens_by_hand():
    logp0 = [[-1.0, -0.5, -2.0, -0.7], [-0.3, -0.2, -0.1, -0.4]]
    old = [[-1.5, -0.5, -1.0, -0.7], [-0.3, -0.9, 0.2, -0.4]]
    adv = [[1.0, 1.0, 1.0, 1.0], [-0.5, -0.5, -0.5, -0.5]]
    eps, eps_high = 0.2, 0.28
    logp = torch.tensor(logp0, dtype=F64, requires_grad=True)
    loss, clipped = cispo_loss(logp, torch.tensor(old, dtype=F64), torch.tensor(adv, dtype=F64), eps, eps_high)
    loss.sum().backward()
    for b in range(2):
        for k in range(4):
            r = math.exp(logp0[b][k] - old[b][k])  # 1.65, 1, 0.37, 1 / 1, 2.01, 0.74, 1
            w = min(max(r, 1 - eps), 1 + eps_high)
            assert loss[b, k].item() == pytest.approx(-w * adv[b][k] * logp0[b][k], rel=1e-12)
            # sg(w): d/d logp = -w * A, clipped or not (PPO's clip would give 0 on a clipped token)
            assert logp.grad[b, k].item() == pytest.approx(-w * adv[b][k], rel=1e-12)
            assert clipped[b, k].item() == float(w != r)
    assert clipped.tolist() == [[1.0, 0.0, 1.0, 0.0], [0.0, 1.0, 1.0, 0.0]]  # 1.65 > 1.28, 0.37 < 0.8; 2.01, 0.74


def test_the_estimator_is_grpo_advantages_with_this_loss(tmp_path):
    est = estimator_for(AlgoConfig(advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=0.28))
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0]], dtype=F64)
    assert torch.equal(est.rollout_advantages(rewards, AlgoConfig()),
                       estimator_for(AlgoConfig()).rollout_advantages(rewards, AlgoConfig()))
    logp = torch.tensor([[-3.0, -0.1]], dtype=F64)
    old = torch.tensor([[-0.5, -0.1]], dtype=F64)  # ratio e^-2.5 = 0.08 for the first token
    pg, clipped, frac = est.policy_loss(logp, old, torch.ones_like(logp), torch.ones_like(logp),
                                        AlgoConfig(advantage_estimator="cispo", eps_clip=1.0, eps_clip_high=0.28))
    # --eps-clip 1: no lower bound (the paper's setting), so the small ratio is kept as it is
    assert pg[0, 0].item() == pytest.approx(-math.exp(-2.5) * -3.0, rel=1e-12) and clipped.sum() == 0
    assert frac.low.sum() == 0 and frac.high.sum() == 0
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    argv = ["--hf-checkpoint", str(tmp_path / "m"), "--prompt-data", str(tmp_path / "d.jsonl"), "--rm-type", "digit",
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--advantage-estimator", "cispo"]
    assert build_config(argv).algo.advantage_estimator == "cispo"
    with pytest.raises(ConfigError, match="--eps-clip-c .* has no effect with --advantage-estimator cispo"):
        build_config(argv + ["--eps-clip-c", "3"])
