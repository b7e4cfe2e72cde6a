"""CISPO (algo/cispo.py) against MiniMax-M1's eq. 4 and SAPO (algo/sapo.py) against its gate, written out per
token in float64, and through the estimator registry."""

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


def test_sapo_gate_value_and_gradient_by_hand():
    """SAPO (algo/sapo.py): loss -(4/tau) sigmoid(tau (r - 1)) A, tau by the advantage's sign; its gradient
    d/d logp = -4 sigmoid'(tau (r - 1)) r A, which is -A at r = 1 (the plain policy gradient on-policy)."""
    from slime_rl.algo.sapo import sapo_loss

    logp0 = [[-1.0, -0.5, -2.0], [-0.3, -0.2, -0.1]]
    old = [[-1.0, -0.9, -1.0], [-0.3, -0.5, 0.4]]
    adv = [[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]]
    logp = torch.tensor(logp0, dtype=F64, requires_grad=True)
    loss = sapo_loss(logp, torch.tensor(old, dtype=F64), torch.tensor(adv, dtype=F64), 1.0, 1.05)
    loss.sum().backward()
    for b in range(2):
        for k in range(3):
            r, a = math.exp(logp0[b][k] - old[b][k]), adv[b][k]
            tau = 1.0 if a > 0 else 1.05
            s = 1 / (1 + math.exp(-tau * (r - 1)))
            assert loss[b, k].item() == pytest.approx(-(4 / tau) * s * a, rel=1e-12)
            assert logp.grad[b, k].item() == pytest.approx(-4 * s * (1 - s) * r * a, rel=1e-12)
    assert logp.grad[0, 0].item() == pytest.approx(-1.0, rel=1e-12)  # r = 1: the plain gradient -A
    assert logp.grad[1, 0].item() == pytest.approx(0.5, rel=1e-12)
    # off-policy the gate fades (r = e^-1 = 0.37 for A = 1): |gradient| 4 s (1 - s) r = 0.33, under |A|
    assert abs(logp.grad[0, 2].item()) < 0.5


def test_sapo_estimator_and_its_flags(tmp_path):
    est = estimator_for(AlgoConfig(advantage_estimator="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0))
    logp, old = torch.tensor([[-0.2, -0.4]], dtype=F64), torch.tensor([[-0.5, -0.1]], dtype=F64)
    adv = torch.tensor([[1.0, -1.0]], dtype=F64)
    pg, clipped, frac = est.policy_loss(logp, old, adv, torch.ones_like(logp),
                                        AlgoConfig(advantage_estimator="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0))
    r0, r1 = math.exp(0.3), math.exp(-0.3)
    assert pg[0, 0].item() == pytest.approx(-(4 / 2.0) / (1 + math.exp(-2.0 * (r0 - 1))), rel=1e-12)
    assert pg[0, 1].item() == pytest.approx((4 / 3.0) / (1 + math.exp(-3.0 * (r1 - 1))), rel=1e-12)
    assert clipped.sum() == 0 and frac.high.sum() == 0
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    argv = ["--hf-checkpoint", str(tmp_path / "m"), "--prompt-data", str(tmp_path / "d.jsonl"), "--rm-type", "digit",
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--num-rollout", "1",
            "--advantage-estimator", "sapo", "--sapo-tau-neg", "2"]
    algo = build_config(argv).algo
    assert (algo.sapo_tau_pos, algo.sapo_tau_neg) == (1.0, 2.0)
    with pytest.raises(ConfigError, match="--sapo-tau-pos .*must be > 0"):
        build_config(argv + ["--sapo-tau-pos", "0"])
