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


def _easyr1_gspo(logp: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, low: float,
                 high: float, dual: float, token_form: bool, mode: str) -> torch.Tensor:
    """EasyR1's compute_policy_loss for loss_type gspo / gspo_token (hiyouga/EasyR1 b44b311,
    verl/trainer/core_algos.py), written out in float64: the masked mean of logp - old per sequence, on every token
    (gspo: with its gradient; gspo_token: detached, plus logp - sg[logp]); ratio exp(clamp(., -20, 20)); the clipped
    ratio exp(clamp(., log(1 - low), log(1 + high))); -A * ratio against -A * clipped (max), then for A < 0 the dual
    cap -A * dual (min); averaged over all valid tokens ("token") or per sequence then over sequences ("seq")."""
    kl = logp - old
    seq = (kl * mask).sum(-1) / mask.sum(-1)
    log_r = (seq.detach().unsqueeze(-1) + logp - logp.detach()) if token_form else seq.unsqueeze(-1) * mask
    ratio = torch.exp(torch.clamp(log_r, -20.0, 20.0))
    clipped = torch.exp(torch.clamp(log_r, math.log(1.0 - low), math.log(1.0 + high)))
    higher = torch.maximum(-adv * ratio, -adv * clipped)
    final = torch.where(adv < 0, torch.minimum(higher, -adv * dual), higher)
    if mode == "token":
        return (final * mask).sum() / mask.sum()
    return ((final * mask).sum(-1) / mask.sum(-1)).mean()


@pytest.mark.parametrize("token_form", [False, True], ids=["gspo", "gspo_token"])
@pytest.mark.parametrize("mode, ours", [("token", "token-mean"), ("seq", "seq-mean-token-mean")])
def test_gspo_equals_easyr1s_gspo_and_gspo_token_with_the_dual_clip(token_form, mode, ours):
    """--advantage-estimator gspo --eps-clip-c 3 has EasyR1's gspo and gspo_token loss and gradient with one
    advantage per sample (GRPO's): rows inside the clip range, clipped above and below, and a negative-advantage
    row whose ratio passes 3 (the dual cap)."""
    from slime_rl.algo.aggregate import aggregate

    g = torch.Generator().manual_seed(7)
    B, T = 6, 7
    old = -torch.rand(B, T, generator=g, dtype=F64) * 2
    shift = torch.tensor([0.0, 0.1, -0.3, 1.5, 0.002, -0.001], dtype=F64).unsqueeze(1)  # row 3: ratio e^1.5 > 3
    logp0 = old + shift + 0.05 * torch.randn(B, T, generator=g, dtype=F64)
    mask = (torch.rand(B, T, generator=g) > 0.25).to(F64)
    mask[:, 0] = 1.0
    adv = torch.tensor([1.0, -0.7, 0.4, -1.2, 0.9, -0.3], dtype=F64).unsqueeze(1).expand(B, T)
    low, high, dual = 0.2, 0.28, 3.0

    ref_logp = logp0.clone().requires_grad_(True)
    ref = _easyr1_gspo(ref_logp, old, adv, mask, low, high, dual, token_form, mode)
    ref.backward()
    logp = logp0.clone().requires_grad_(True)
    algo = AlgoConfig(advantage_estimator="gspo", eps_clip=low, eps_clip_high=high, eps_clip_c=dual)
    pg, _, frac = estimator_for(algo).policy_loss(logp, old, adv, mask, algo)
    got = aggregate(pg, mask, ours)
    got.backward()
    assert got.item() == pytest.approx(ref.item(), rel=1e-12, abs=1e-15)
    assert torch.allclose(logp.grad, ref_logp.grad, rtol=1e-10, atol=1e-15)
    assert frac.dual[3].bool().all() and frac.dual.sum() == frac.dual[3].sum()  # only row 3 is capped
    assert logp.grad[3].abs().max() == 0  # the cap is a constant: no gradient through that row
