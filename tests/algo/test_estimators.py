"""The estimator objects (algo/estimators.py) against the float64 loop references, the registry's
pairing with the config specs, and the log-ratio clamps (verl's bounds)."""

from __future__ import annotations

import math

import pytest
import torch

from slime_rl.algo import (
    ESTIMATORS,
    GSPO_LOG_RATIO_MAX,
    PPO_LOG_RATIO_CLAMP,
    estimator_for,
    gspo_loss,
    masked_whiten,
    ppo_clip_loss,
)
from slime_rl.config import AlgoConfig
from slime_rl.config.estimators import ESTIMATOR_SPECS
from slime_rl.config.flags import build_parser
from tests.algo import refs

F64 = torch.float64
GROUPS = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [3.0, -1.0, 2.0, 0.0]]
MASK = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]] * 3  # 12 samples, tool token at [3][0]


def test_registry_pairs_every_spec_with_an_object():
    assert sorted(ESTIMATORS) == sorted(ESTIMATOR_SPECS)
    choices = next(a for a in build_parser()._actions if "--advantage-estimator" in a.option_strings).choices
    assert tuple(choices) == tuple(ESTIMATOR_SPECS)
    for name, est in ESTIMATORS.items():
        algo = AlgoConfig(advantage_estimator=name)
        assert estimator_for(algo) is est and est.spec is ESTIMATOR_SPECS[name] is algo.estimator
        assert algo.use_critic == (name == "ppo")
        assert algo.token_level_advantages == (name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo"))


@pytest.mark.parametrize("name, ref", [("grpo", refs.grpo), ("gspo", refs.grpo), ("rloo", refs.rloo)])
def test_rollout_side_scalar_estimators(name, ref):
    algo = AlgoConfig(advantage_estimator=name)
    got = estimator_for(algo).rollout_advantages(torch.tensor(GROUPS, dtype=F64), algo)
    for g, w in zip(got.tolist(), ref(GROUPS), strict=True):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-12)


def test_dr_grpo_is_grpo_without_std():
    algo = AlgoConfig(normalize_group_std=False)
    got = estimator_for(algo).rollout_advantages(torch.tensor(GROUPS, dtype=F64), algo)
    for g, w in zip(got.tolist(), refs.grpo(GROUPS, normalize_std=False), strict=True):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_reinforce_plus_plus_baseline_split_over_rollout_and_trainer(kl_coef):
    """The rollout half (group mean) and the trainer half (tokens, KL), whitened, give the paper's
    estimator as the loop reference computes it on the whole batch."""
    algo = AlgoConfig(advantage_estimator="reinforce_plus_plus_baseline", kl_coef=kl_coef)
    est = estimator_for(algo)
    mask = torch.tensor(MASK, dtype=F64)
    kl = torch.linspace(-0.5, 0.7, mask.numel(), dtype=F64).reshape(mask.shape)
    scalar = est.rollout_advantages(torch.tensor(GROUPS, dtype=F64), algo).flatten()
    raw, returns = est.token_advantages(torch.zeros(12, dtype=F64), scalar, mask, kl if kl_coef else None, None, algo)
    assert returns is None
    want = refs.reinforce_pp_baseline(GROUPS, MASK, kl.tolist() if kl_coef else None, kl_coef)
    got = masked_whiten(raw, mask)
    for g, w in zip(got.tolist(), want, strict=True):
        assert g == pytest.approx(w, abs=1e-9)


def test_token_level_estimators_need_the_trainer_and_ppo_the_critic():
    rewards = torch.tensor([1.0, 0.0, 2.0, 0.5], dtype=F64)
    mask = torch.tensor(MASK[:4], dtype=F64)
    ppo = AlgoConfig(advantage_estimator="ppo", gamma=0.9, lambd=0.8)
    assert estimator_for(ppo).rollout_advantages(torch.ones(2, 2, dtype=F64), ppo).abs().sum() == 0
    with pytest.raises(ValueError, match="critic"):
        estimator_for(ppo).token_advantages(rewards, rewards, mask, None, None, ppo)
    values = torch.full_like(mask, 0.25)
    adv, ret = estimator_for(ppo).token_advantages(rewards, rewards, mask, None, values, ppo)
    want_adv, want_ret = refs.gae(refs.token_rewards(rewards.tolist(), MASK[:4], None, 0.0), values.tolist(),
                                  MASK[:4], 0.9, 0.8)
    for got, want in ((adv, want_adv), (ret, want_ret)):
        for g, w in zip(got.tolist(), want, strict=True):
            assert g == pytest.approx(w, abs=1e-12)
    grpo = AlgoConfig()
    with pytest.raises(TypeError, match="rollout side"):
        estimator_for(grpo).token_advantages(rewards, rewards, mask, None, None, grpo)


def test_ppo_log_ratio_is_clamped_at_20():
    """verl's bound: a log-ratio of 100 (exp overflows float32) gives the finite ratio e^20 and no
    gradient; within the bound the loss is the unclamped one, bit for bit."""
    adv = torch.tensor([[-1.0, -1.0]])
    logp = torch.tensor([[100.0, 0.3]], requires_grad=True)
    old = torch.zeros(1, 2)
    loss, _ = ppo_clip_loss(logp, old, adv, 0.2, 0.2)
    assert PPO_LOG_RATIO_CLAMP == 20.0
    assert loss[0, 0].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert loss[0, 1].item() == (-torch.minimum(torch.exp(torch.tensor(0.3)) * -1.0,
                                                torch.tensor(1.2) * -1.0)).item()
    loss.sum().backward()
    assert logp.grad[0, 0].item() == 0.0 and logp.grad[0, 1].item() != 0.0


def test_gspo_sequence_log_ratio_is_clamped_at_10():
    logp = torch.tensor([[15.0, 15.0], [0.1, -0.1]], requires_grad=True)
    old = torch.zeros(2, 2)
    mask = torch.ones(2, 2)
    loss, _ = gspo_loss(logp, old, torch.tensor([-1.0, 1.0]), mask, 0.2, 0.2)
    assert GSPO_LOG_RATIO_MAX == 10.0
    assert loss[0].tolist() == pytest.approx([math.exp(10.0)] * 2, rel=1e-6)  # -s * A with s = e^10, A = -1
    assert loss[1].tolist() == pytest.approx([-1.0, -1.0], abs=1e-6)  # s = exp(mean(0.1, -0.1)) = 1
    loss.sum().backward()
    assert logp.grad[0].abs().sum().item() == 0.0
