"""Loss aggregation modes, micro-batch invariance with a global denominator, DAPO overlong shaping."""

from __future__ import annotations

import pytest
import torch

from slime_rl.algo import AGG_MODES, aggregate, aggregate_denominator, overlong_penalty
from tests.algo import refs

F64 = torch.float64


def t(x: list) -> torch.Tensor:
    return torch.tensor(x, dtype=F64)


LOSS = [[1.0, 2.0, 3.0, 50.0], [-1.0, 4.0, 0.5, 0.25], [7.0, 7.0, 7.0, 7.0], [0.2, float("nan"), 9.0, 9.0]]
MASK = [[1, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 0]]  # right padding, an empty sample
MAX_LEN = 8


@pytest.mark.parametrize("mode", AGG_MODES)
def test_modes_against_loops(mode):
    got = aggregate(t(LOSS), t(MASK), mode, max_len=MAX_LEN)
    assert got.item() == pytest.approx(refs.aggregate(LOSS, MASK, mode, MAX_LEN), rel=1e-12)


def test_hand_values():
    # valid tokens: [1, 2, 3], [-1, 4, .5, .25], [], [.2]
    assert aggregate(t(LOSS), t(MASK), "token-mean").item() == pytest.approx(9.95 / 8)
    assert aggregate(t(LOSS), t(MASK), "seq-mean-token-mean").item() == pytest.approx((2.0 + 0.9375 + 0.2) / 3)
    assert aggregate(t(LOSS), t(MASK), "seq-mean-token-sum").item() == pytest.approx(9.95 / 3)
    assert aggregate(t(LOSS), t(MASK), "seq-mean-token-sum-norm", max_len=8).item() == pytest.approx(9.95 / 24)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_micro_batches_with_global_denominator_sum_to_full_batch(mode):
    full = aggregate(t(LOSS), t(MASK), mode, max_len=MAX_LEN)
    splits = [slice(0, 2), slice(2, 3), slice(3, 4)]  # the middle micro-batch holds only an empty sample
    denom = sum(aggregate_denominator(t(MASK)[s], mode) for s in splits)
    parts = [aggregate(t(LOSS)[s], t(MASK)[s], mode, denominator=denom, max_len=MAX_LEN) for s in splits]
    assert sum(parts).item() == pytest.approx(full.item(), rel=1e-12)
    # while the local denominators alone give a different (micro-batch dependent) answer
    halves = [slice(0, 2), slice(2, 4)]
    local = sum(aggregate(t(LOSS)[s], t(MASK)[s], mode, max_len=MAX_LEN) for s in halves) / len(halves)
    assert local.item() != pytest.approx(full.item(), rel=1e-6)


def test_all_masked_and_errors():
    assert aggregate(t([[1.0, 2.0]]), t([[0, 0]]), "token-mean").item() == 0.0
    assert aggregate(t([[1.0, 2.0]]), t([[0, 0]]), "seq-mean-token-mean").item() == 0.0
    with pytest.raises(ValueError, match="max_len"):
        aggregate(t(LOSS), t(MASK), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="aggregation mode"):
        aggregate(t(LOSS), t(MASK), "mean")


def test_gradient_skips_masked_nan():
    loss = torch.tensor(LOSS, dtype=F64, requires_grad=True)
    aggregate(loss, t(MASK), "token-mean").backward()
    assert torch.isfinite(loss.grad).all()
    assert torch.allclose(loss.grad, t(MASK) / 8)


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_overlong_penalty(factor):
    max_len, buf = 20, 4
    lengths = [0, 10, 16, 17, 18, 20, 21, 100]
    got = overlong_penalty(lengths, max_len, buf, factor)
    ref = [refs.overlong(n, max_len, buf, factor) for n in lengths]
    assert torch.allclose(got.double(), t(ref), rtol=1e-6, atol=1e-7)
    assert got[2].item() == 0.0 and got[5].item() == pytest.approx(-factor)
    assert got[3].item() == pytest.approx(-0.25 * factor)
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, max_len, 0, factor)
