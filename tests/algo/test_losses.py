"""Policy/value loss pieces, GSPO, TIS, entropy, KL vs plain-loop float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from slime_rl.algo import (
    aggregate,
    clip_fractions,
    entropy_from_logits,
    explained_variance,
    gspo_loss,
    gspo_seq_log_ratio,
    gspo_token_ratio,
    kl_penalty,
    ppo_clip_loss,
    ppo_kl,
    value_loss,
)
from tests.algo import refs

F64 = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-10}


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


LOGP = [[math.log(1.5), math.log(0.5), math.log(1.1), math.log(5.0)],
        [math.log(0.7), math.log(4.0), math.log(0.95), math.log(1.3)]]
OLD = [[0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
ADV = [[1.0, -1.0, 2.0, -0.5], [-2.0, -1.0, 0.5, 1.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]


@pytest.mark.parametrize("eps,eps_high,c", [(0.2, 0.2, None), (0.2, 0.28, None), (0.2, 0.28, 3.0), (0.1, 0.3, 1.5)])
def test_ppo_clip_and_dual_clip_against_loops(eps, eps_high, c):
    loss, clipped = ppo_clip_loss(t(LOGP), t(OLD), t(ADV), eps, eps_high, eps_clip_c=c)
    for b in range(2):
        for k in range(4):
            ref_loss, ref_clipped = refs.ppo_token(LOGP[b][k], OLD[b][k], ADV[b][k], eps, eps_high, c)
            assert loss[b, k].item() == pytest.approx(ref_loss, rel=1e-12, abs=1e-12)
            assert bool(clipped[b, k]) == ref_clipped
    fr = clip_fractions(t(LOGP), t(OLD), t(ADV), eps, eps_high, c)
    assert torch.equal(fr.high + fr.low, clipped)
    for b in range(2):
        for k in range(4):
            r, a = math.exp(LOGP[b][k] - OLD[b][k]), ADV[b][k]
            assert fr.high[b, k].item() == float(a > 0 and r > 1 + eps_high)
            assert fr.low[b, k].item() == float(a < 0 and r < 1 - eps)
            assert fr.dual[b, k].item() == float(c is not None and a < 0 and r > c)


def test_dual_clip_by_hand_and_validation():
    # ratio 5, A = -0.5: plain PPO loss = -min(-2.5, -0.6) = 2.5; dual clip c=3 caps it at 1.5
    loss, _ = ppo_clip_loss(t([[math.log(5.0)]]), t([[0.0]]), t([[-0.5]]), 0.2, 0.28, eps_clip_c=3.0)
    assert loss.item() == pytest.approx(1.5)
    loss, _ = ppo_clip_loss(t([[math.log(5.0)]]), t([[0.0]]), t([[0.5]]), 0.2, 0.28, eps_clip_c=3.0)
    assert loss.item() == pytest.approx(-0.64)  # A > 0 untouched
    with pytest.raises(ValueError, match="eps-clip-c"):
        ppo_clip_loss(t([[0.0]]), t([[0.0]]), t([[1.0]]), 0.2, 0.2, eps_clip_c=1.0)


def test_ppo_kl_metric():
    got = ppo_kl(t(LOGP), t(OLD), t(MASK))
    vals = [OLD[b][k] - LOGP[b][k] for b in range(2) for k in range(4) if MASK[b][k]]
    assert got.item() == pytest.approx(sum(vals) / len(vals), rel=1e-12)


def test_entropy_from_logits():
    logits = [[[0.0, 1.0, -2.0, 3.0], [5.0, 5.0, 5.0, 5.0]], [[-100.0, 0.0, 0.0, 100.0], [1.0, 2.0, 3.0, 4.0]]]
    got = entropy_from_logits(t(logits))
    assert got.shape == (2, 2)
    for b in range(2):
        for k in range(2):
            assert got[b, k].item() == pytest.approx(refs.entropy(logits[b][k]), abs=1e-10)
    assert got[0, 1].item() == pytest.approx(math.log(4))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_against_formulas(kind):
    logp = [[-0.5, -2.0, -1.0, -30.0]]
    ref = [[-1.5, -0.1, -1.0, -1.0]]
    got = kl_penalty(t(logp), t(ref), kind)
    for k in range(4):
        lr = ref[0][k] - logp[0][k]
        expected = {"k1": logp[0][k] - ref[0][k], "k2": 0.5 * lr * lr, "k3": math.exp(lr) - 1 - lr,
                    "low_var_kl": max(-10.0, min(10.0, math.exp(min(20.0, lr)) - 1 - min(20.0, lr)))}[kind]
        assert got[0, k].item() == pytest.approx(expected, rel=1e-12)
    if kind == "low_var_kl":
        assert got[0, 3].item() == 10.0  # log r = 29: clamped


def test_gspo_ratio_value_and_gradient():
    logp = torch.tensor([[-1.0, -0.5, -2.0, -9.0], [-0.3, -0.2, -0.1, -0.4]], dtype=F64, requires_grad=True)
    old = t([[-1.1, -0.4, -2.3, 0.0], [-0.3, -0.25, -0.05, -0.5]])
    mask = t([[1, 1, 1, 0], [1, 1, 1, 1]])
    log_s = gspo_seq_log_ratio(logp, old, mask)
    for b in range(2):
        diffs = [logp[b, k].item() - old[b, k].item() for k in range(4) if mask[b, k] > 0]
        assert log_s[b].item() == pytest.approx(sum(diffs) / len(diffs), rel=1e-12)
    ratio = gspo_token_ratio(logp, old, mask)
    assert torch.allclose(ratio, log_s.detach().exp().unsqueeze(1).expand(2, 4), **TOL)
    # d ratio[b, k] / d logp[b, k] = s_b (stop-gradient form), nothing across tokens
    (ratio * mask).sum().backward()
    assert torch.allclose(logp.grad, log_s.detach().exp().unsqueeze(1) * mask, **TOL)


@pytest.mark.parametrize("eps,eps_high", [(0.2, 0.28), (3e-4, 4e-4)])
def test_gspo_loss_matches_sequence_level_objective(eps, eps_high):
    logp0 = [[-1.0, -0.5, -2.0, 5.0], [-0.3, -0.2, -0.1, -0.4], [-0.7, -0.7, 0.0, 0.0]]
    old = t([[-1.1, -0.4, -2.3, 0.0], [-0.3, -0.25, -0.05, -0.5], [-0.7, -0.7, 0.0, 0.0]])
    mask = t([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    adv = t([1.0, -0.5, 2.0])
    logp = torch.tensor(logp0, dtype=F64, requires_grad=True)
    loss, clipped = gspo_loss(logp, old, adv, mask, eps, eps_high)
    total = aggregate(loss, mask, "seq-mean-token-mean")
    total.backward()
    # reference: the paper's sequence-level objective, written per sample with loops
    logp2 = torch.tensor(logp0, dtype=F64, requires_grad=True)
    seq_losses = []
    for b in range(3):
        ks = [k for k in range(4) if mask[b, k] > 0]
        s = torch.exp(sum(logp2[b, k] - old[b, k] for k in ks) / len(ks))
        a = adv[b].item()
        seq_losses.append(-torch.minimum(s * a, torch.clamp(s, 1 - eps, 1 + eps_high) * a))
        s_val = s.item()
        assert bool(clipped[b, 0]) == (min(max(s_val, 1 - eps), 1 + eps_high) * a < s_val * a)
    ref_total = sum(seq_losses) / 3
    ref_total.backward()
    assert total.item() == pytest.approx(ref_total.item(), rel=1e-12)
    assert torch.allclose(logp.grad, logp2.grad, **TOL)


@pytest.mark.parametrize("clip", [0.2, 10.0])
def test_value_loss_against_loops(clip):
    v = [[0.5, 1.5, -0.2, 9.0], [2.0, 0.0, 0.3, 0.1]]
    v_old = [[0.4, 1.0, 0.0, 0.0], [1.0, 0.1, 0.3, 0.2]]
    ret = [[1.0, 0.9, 0.5, 1.0], [1.5, 1.0, -0.3, 0.0]]
    loss, clipfrac = value_loss(t(v), t(v_old), t(ret), t(MASK), clip)
    per, n_clip = [], 0
    for b in range(2):
        for k in range(4):
            if not MASK[b][k]:
                continue
            vc = v_old[b][k] + max(-clip, min(clip, v[b][k] - v_old[b][k]))
            e1, e2 = (v[b][k] - ret[b][k]) ** 2, (vc - ret[b][k]) ** 2
            per.append(0.5 * max(e1, e2))
            n_clip += e2 > e1
    assert loss.item() == pytest.approx(sum(per) / len(per), rel=1e-12)
    assert clipfrac.item() == pytest.approx(n_clip / len(per), rel=1e-12)


def test_explained_variance():
    v = [[0.5, 1.5, -0.2, 9.0], [2.0, 0.0, 0.3, 0.1]]
    ret = [[1.0, 0.9, 0.5, 1.0], [1.5, 1.0, -0.3, 0.0]]
    rs = [ret[b][k] for b in range(2) for k in range(4) if MASK[b][k]]
    ds = [ret[b][k] - v[b][k] for b in range(2) for k in range(4) if MASK[b][k]]

    def var(xs: list[float]) -> float:
        m = sum(xs) / len(xs)
        return sum((x - m) ** 2 for x in xs) / len(xs)

    got = explained_variance(t(v), t(ret), t(MASK))
    assert got.item() == pytest.approx(1 - var(ds) / var(rs), rel=1e-12)
    assert explained_variance(t(ret), t(ret), t(MASK)).item() == pytest.approx(1.0)
    assert math.isnan(explained_variance(t(v), t([[1.0] * 4] * 2), t(MASK)).item())
