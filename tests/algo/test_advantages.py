"""Advantage estimators vs plain-loop float64 references (tests/algo/refs.py)."""

from __future__ import annotations

import math

import pytest
import torch

from slime_rl.algo import (
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    masked_moments,
    masked_whiten,
    outcome_token_rewards,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from tests.algo import refs

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


# 4 samples (2 groups of 2), right-padded to T = 5; sample 2 is fully masked; sample 3 has a
# masked (tool) token in the middle.
MASK = [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]]
KL = [[0.1, -0.2, 0.3, 9.0, 9.0], [0.05, 0.0, 0.2, 0.1, -0.1], [1.0, 1.0, 1.0, 1.0, 1.0],
      [0.4, 7.0, -0.3, 0.2, 5.0]]
REWARDS = [1.0, 0.0, 0.5, 2.0]


def test_grpo_against_loops_incl_equal_group_and_dr_grpo():
    groups = [[1.0, 0.0, 0.25, 3.0], [0.5, 0.5, 0.5, 0.5]]
    assert torch.allclose(grpo_advantages(t(groups)), t(refs.grpo(groups)), **TOL)
    assert torch.allclose(grpo_advantages(t(groups), normalize_std=False), t(refs.grpo(groups, normalize_std=False)),
                          **TOL)
    assert torch.all(grpo_advantages(t(groups))[1] == 0)


@pytest.mark.parametrize("groups", [[[1.0, 0.0, 0.25, 3.0], [2.0, -1.0, 0.0, 0.0]], [[1.0, 1.0, 1.0]], [[3.0], [1.0]],
                                    [[0.0, 1.0]]])
def test_rloo_leave_one_out(groups):
    adv = rloo_advantages(t(groups))
    assert torch.allclose(adv, t(refs.rloo(groups)), **TOL)
    if len(groups[0]) == 1 or all(r == groups[0][0] for r in groups[0]):
        assert torch.all(adv == 0)


def test_outcome_token_rewards_places_reward_on_last_valid_token():
    got = outcome_token_rewards(t(REWARDS), t(MASK), t(KL), kl_coef=0.1)
    assert torch.allclose(got, t(refs.token_rewards(REWARDS, MASK, KL, 0.1)), **TOL)
    assert torch.all(got[2] == 0)  # fully masked: nowhere to put the reward
    assert got[0, 2].item() == pytest.approx(1.0 - 0.03) and got[0, 3].item() == 0.0


@pytest.mark.parametrize("gamma", [1.0, 0.9, 0.0])
def test_discounted_returns_skip_masked_tokens(gamma):
    tok = refs.token_rewards(REWARDS, MASK, KL, 0.2)
    got = discounted_returns(t(tok), t(MASK), gamma)
    assert torch.allclose(got, t(refs.returns(tok, MASK, gamma)), **TOL)


@pytest.mark.parametrize("gamma", [1.0, 0.95])
@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_reinforce_plus_plus(gamma, kl_coef):
    adv, ret = reinforce_plus_plus_advantages(t(REWARDS), t(MASK), t(KL), kl_coef=kl_coef, gamma=gamma)
    ref_adv, ref_ret = refs.reinforce_pp(REWARDS, MASK, KL, kl_coef, gamma)
    assert torch.allclose(ret, t(ref_ret), **TOL)
    assert torch.allclose(adv, t(ref_adv), **TOL)
    m = t(MASK)
    assert torch.all(adv[m == 0] == 0) and torch.all(ret[m == 0] == 0)
    # whitened over all valid tokens: mean 0, unbiased std 1 (up to eps)
    valid = adv[m > 0]
    assert abs(valid.mean().item()) < 1e-12 and valid.std().item() == pytest.approx(1.0, abs=1e-6)


def test_reinforce_plus_plus_padding_may_hold_garbage_and_equal_rewards_give_zero():
    kl = [row[:] for row in KL]
    kl[0][3] = float("nan")
    adv, _ = reinforce_plus_plus_advantages(t(REWARDS), t(MASK), t(kl), kl_coef=0.1, gamma=0.9)
    assert torch.isfinite(adv).all()
    mask = [[1, 1, 0], [1, 1, 1]]
    adv, ret = reinforce_plus_plus_advantages(t([1.0, 1.0]), t(mask), None, gamma=1.0)
    assert torch.allclose(ret, t([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]), **TOL)
    assert torch.allclose(adv, torch.zeros_like(adv), atol=1e-12)


def test_reinforce_plus_plus_global_whitening_from_moments_matches_full_batch():
    # the trainer path: unwhitened per micro-batch, moments summed, then whitened
    _, full_ret = reinforce_plus_plus_advantages(t(REWARDS), t(MASK), t(KL), kl_coef=0.1, gamma=0.9, whiten=False)
    full_adv, _ = reinforce_plus_plus_advantages(t(REWARDS), t(MASK), t(KL), kl_coef=0.1, gamma=0.9)
    parts = [(slice(0, 1)), (slice(1, 4))]
    unwhitened = [reinforce_plus_plus_advantages(t(REWARDS)[p], t(MASK)[p], t(KL)[p], kl_coef=0.1, gamma=0.9,
                                                 whiten=False)[0] for p in parts]
    moments = sum(masked_moments(u, t(MASK)[p]) for u, p in zip(unwhitened, parts, strict=True))
    local = torch.cat([masked_whiten(u, t(MASK)[p], moments) for u, p in zip(unwhitened, parts, strict=True)])
    assert torch.allclose(local, full_adv, rtol=1e-9, atol=1e-9)
    assert torch.allclose(torch.cat(unwhitened), full_ret, **TOL)


@pytest.mark.parametrize("kl_coef", [0.0, 0.3])
def test_reinforce_plus_plus_baseline(kl_coef):
    groups = [[1.0, 0.0], [0.5, 2.0]]
    adv = reinforce_plus_plus_baseline_advantages(t(groups), t(MASK), t(KL), kl_coef=kl_coef)
    assert torch.allclose(adv, t(refs.reinforce_pp_baseline(groups, MASK, KL, kl_coef)), **TOL)
    assert torch.all(adv[2] == 0)


def test_reinforce_plus_plus_baseline_edge_cases():
    mask = [[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]]
    equal = reinforce_plus_plus_baseline_advantages(t([[1.0, 1.0], [0.0, 0.0]]), t(mask))
    assert torch.all(equal == 0)
    single = reinforce_plus_plus_baseline_advantages(t([[1.0], [0.0], [3.0], [2.0]]), t(mask))
    assert torch.all(single == 0)  # n = 1: the group mean is the reward itself
    with pytest.raises(ValueError, match="rows"):
        reinforce_plus_plus_baseline_advantages(t([[1.0, 0.0]]), t(mask))


GAE_R = [[0.0, 0.1, 1.0, 0.0, 0.0], [0.2, -0.1, 0.0, 0.3, 0.5], [1.0, 1.0, 1.0, 1.0, 1.0],
         [0.0, 4.0, 0.3, 1.5, 2.0]]
GAE_V = [[0.5, 0.4, 0.9, 3.0, -2.0], [0.1, 0.2, 0.3, 0.2, 0.4], [1.0, 2.0, 3.0, 4.0, 5.0],
         [0.7, 9.0, 0.2, 0.6, 8.0]]


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.95), (0.9, 0.0)])
def test_gae_against_loops(gamma, lam):
    adv, ret = gae_advantages(t(GAE_R), t(GAE_V), t(MASK), gamma, lam)
    ref_adv, ref_ret = refs.gae(GAE_R, GAE_V, MASK, gamma, lam)
    assert torch.allclose(adv, t(ref_adv), **TOL)
    assert torch.allclose(ret, t(ref_ret), **TOL)


def test_gae_right_padding_is_ignored_and_matches_unpadded():
    short_r, short_v = [[0.0, 0.1, 1.0]], [[0.5, 0.4, 0.9]]
    pad_r = [[0.0, 0.1, 1.0, float("nan"), 7.0]]
    pad_v = [[0.5, 0.4, 0.9, float("inf"), 3.0]]
    a1, r1 = gae_advantages(t(short_r), t(short_v), t([[1, 1, 1]]), 0.99, 0.9)
    a2, r2 = gae_advantages(t(pad_r), t(pad_v), t([[1, 1, 1, 0, 0]]), 0.99, 0.9)
    assert torch.allclose(a2[:, :3], a1, **TOL) and torch.all(a2[:, 3:] == 0)
    assert torch.allclose(r2[:, :3], r1, **TOL) and torch.all(r2[:, 3:] == 0)
    # gamma = lambda = 1: A_t = sum of rewards from t on - V_t (Monte-Carlo), R_t = that sum
    a, r = gae_advantages(t(short_r), t(short_v), t([[1, 1, 1]]), 1.0, 1.0)
    assert torch.allclose(r, t([[1.1, 1.1, 1.0]]), **TOL)
    assert torch.allclose(a, t([[0.6, 0.7, 0.1]]), **TOL)


def test_masked_whiten_edge_cases():
    assert torch.all(masked_whiten(t([[1.0, 2.0]]), t([[0, 0]])) == 0)
    assert torch.all(masked_whiten(t([[5.0, 2.0]]), t([[1, 0]])) == 0)  # one valid token
    vals = [[1.0, 2.0, math.nan], [4.0, 0.5, -1.0]]
    mask = [[1, 1, 0], [1, 1, 1]]
    clean = [[1.0, 2.0, 0.0], [4.0, 0.5, -1.0]]
    assert torch.allclose(masked_whiten(t(vals), t(mask)), t(refs.whiten(clean, mask)), **TOL)
