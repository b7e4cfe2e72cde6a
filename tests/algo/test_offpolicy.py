"""algo.offpolicy by hand in float64: importance weights at each level and mode, the rejection rules' bounds,
verl's threshold syntax. (Equality with verl's and AReaL's own code: test_peer_equality.py; inside a real
trainer step: tests/trainer/test_trainer_algo.py's mis_rs case.)"""

from __future__ import annotations

import math

import pytest
import torch

from slime_rl.algo.offpolicy import is_weights, rejection_keep
from slime_rl.config.rollout_corr import RejectionRule, parse_rejection

F64 = torch.float64
# two samples; sample 0 has an environment token (mask 0) in the middle, sample 1 is 2 tokens long
OLD = [[-1.0, -0.5, -2.0, -0.7], [-0.3, -0.2, 0.0, 0.0]]
ROLL = [[-1.5, -9.0, -1.0, -0.6], [-0.3, -0.8, 0.0, 0.0]]
MASK = [[1.0, 0.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]]


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


def _log_r(b: int) -> list[float]:
    return [o - r for o, r, m in zip(OLD[b], ROLL[b], MASK[b], strict=True) if m]


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_weights_by_hand(level, mode):
    lo, hi = 0.5, 1.5
    w = is_weights(t(OLD), t(ROLL), t(MASK), level, mode, hi, lo)
    for b in range(2):
        lr = _log_r(b)  # sample 0: 0.5, -1.0, -0.1; sample 1: 0, 0.6
        kept = iter(lr)
        for k in range(4):
            if not MASK[b][k]:
                assert w.weight[b, k] == 0 and w.raw[b, k] == 0
                continue
            own = next(kept)
            raw = math.exp({"token": own, "sequence": sum(lr), "geometric": sum(lr) / len(lr)}[level])
            out = raw < lo or raw > hi
            want = (0.0 if out else raw) if mode == "mask" else min(max(raw, lo), hi)
            assert w.weight[b, k].item() == pytest.approx(want, rel=1e-12), (b, k)
            assert w.raw[b, k].item() == pytest.approx(raw, rel=1e-12)
            assert w.out_of_bounds[b, k].item() == float(out)
    assert not w.weight.requires_grad
    # the environment token's huge log-ratio (8.5) is in no sample-level weight
    assert is_weights(t(OLD), t(ROLL), t(MASK), "sequence", "truncate", 1e9).weight[0, 0].item() == pytest.approx(
        math.exp(0.5 - 1.0 - 0.1))


def test_weights_stay_finite_past_the_safety_bound():
    old, roll, mask = t([[0.0, 0.0]]), t([[-50.0, 50.0]]), t([[1.0, 1.0]])
    w = is_weights(old, roll, mask, "token", "truncate", float("inf"), 0.0)
    assert w.raw[0].tolist() == pytest.approx([math.exp(20), math.exp(-20)])


def test_rejection_rules_by_hand():
    # sample 0's trained log-ratios 0.5, -1.0, -0.1 (k1 = -lr: -0.5, 1.0, 0.1); sample 1's 0, 0.6
    keep = rejection_keep(t(OLD), t(ROLL), t(MASK), [RejectionRule("token_k1", upper=2.0, lower=0.5)])
    # keep pi_engine / pi_old = e^k1 within [0.5, 2]: e^1.0 = 2.72 is out; e^-0.5 = 0.61 and e^-0.6 = 0.55 in
    assert (keep * t(MASK)).tolist() == [[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]]
    k2 = RejectionRule("seq_max_k2", upper=0.3)  # max lr^2 / 2: sample 0 0.5 (out), sample 1 0.18 (in)
    assert (rejection_keep(t(OLD), t(ROLL), t(MASK), [k2]) * t(MASK)).tolist() == [[0.0] * 4, [1.0, 1.0, 0, 0]]
    k3 = RejectionRule("seq_mean_k3", upper=0.12)  # mean of e^lr - 1 - lr: 0.1738 (out) and 0.1111 (in)
    assert (rejection_keep(t(OLD), t(ROLL), t(MASK), [k3]) * t(MASK)).tolist() == [[0.0] * 4, [1.0, 1.0, 0, 0]]
    both = rejection_keep(t(OLD), t(ROLL), t(MASK), [RejectionRule("token_k1", 2.0, 0.5), k2])
    assert (both * t(MASK)).tolist() == [[0.0] * 4, [1.0, 1.0, 0.0, 0.0]]


def test_verls_threshold_syntax():
    assert parse_rejection("token_k1", "2") == (RejectionRule("token_k1", 2.0, 0.5),)  # lower = 1 / upper
    assert parse_rejection(" token_k1 , seq_sum_k3 ,token_k1", "0.2_3,0.05") == (
        RejectionRule("token_k1", 3.0, 0.2), RejectionRule("seq_sum_k3", 0.05, None))
    for options, spec, words in [("token_k1", "3_2", "lower <= upper"), ("seq_mean_k2", "-1", "positive"),
                                 ("", "1", "names no option"), ("token_k1", "a_b", "'lower_upper'")]:
        with pytest.raises(ValueError, match=words):
            parse_rejection(options, spec)
