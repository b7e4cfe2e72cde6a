import math

import torch

from slime_rl.algo import grpo_advantages, kl_penalty, masked_mean, ppo_clip_loss


def test_grpo_matches_hand_formula():
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 1.0]]
    adv = grpo_advantages(torch.tensor(rewards, dtype=torch.float64), eps=1e-6)
    for g, row in enumerate(rewards):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((r - mean) ** 2 for r in row) / (len(row) - 1))
        for i, r in enumerate(row):
            assert abs(adv[g, i].item() - (r - mean) / (std + 1e-6)) < 1e-12
    assert torch.all(adv[1] == 0)  # equal rewards: no signal


def test_grpo_single_sample_and_dr_grpo():
    assert torch.all(grpo_advantages(torch.tensor([[3.0], [1.0]])) == 0)
    adv = grpo_advantages(torch.tensor([[1.0, 0.0]], dtype=torch.float64), normalize_std=False)
    assert adv.tolist() == [[0.5, -0.5]]


def test_ppo_clip_by_hand():
    logp = torch.tensor([[math.log(1.5), math.log(0.5), math.log(1.1)]], dtype=torch.float64)
    old = torch.zeros_like(logp)
    adv = torch.tensor([[1.0, -1.0, 2.0]], dtype=torch.float64)
    loss, clipped = ppo_clip_loss(logp, old, adv, eps_clip=0.2, eps_clip_high=0.28)
    # ratio 1.5, A=+1: min(1.5, 1.28) -> 1.28; ratio .5, A=-1: min(-.5, -.8) -> -.8; ratio 1.1: unclipped 2.2
    assert torch.allclose(loss, torch.tensor([[-1.28, 0.8, -2.2]], dtype=torch.float64))
    assert clipped.tolist() == [[1.0, 1.0, 0.0]]


def test_kl_estimators_by_hand():
    logp = torch.tensor([math.log(0.5)], dtype=torch.float64)
    ref = torch.tensor([math.log(0.25)], dtype=torch.float64)
    log_r = math.log(0.25) - math.log(0.5)
    assert abs(kl_penalty(logp, ref, "k1").item() - (-log_r)) < 1e-12
    assert abs(kl_penalty(logp, ref, "k2").item() - 0.5 * log_r**2) < 1e-12
    assert abs(kl_penalty(logp, ref, "k3").item() - (math.exp(log_r) - 1 - log_r)) < 1e-12
    assert kl_penalty(logp, logp, "low_var_kl").item() == 0.0


def test_masked_mean_denominator_is_masked_tokens():
    x = torch.tensor([[1.0, 2.0, 100.0]])
    assert masked_mean(x, torch.tensor([[1.0, 1.0, 0.0]])).item() == 1.5
