"""Packed (THD) attention without the varlen kernel: the samples right-padded into one SDPA call
(`padded_causal`, CUDA in fp32) equal one call per sample (`looped_causal`, CPU), values and gradients.

The reference is neither of them: a float64 softmax(q k^T / sqrt(d)) v per sample written out here, with
the query heads reading their GQA group's key/value head."""

import math

import pytest
import torch
import torch.nn.functional as F

from slime_rl.trainer.attention import looped_causal, padded_causal

HEADS, GROUPS, DIM = 6, 2, 8


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _reference(q, k, v, bounds):
    out = torch.zeros_like(q)
    rep = HEADS // GROUPS
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        for h in range(HEADS):
            qq, kk, vv = q[s:e, h], k[s:e, h // rep], v[s:e, h // rep]
            scores = qq @ kk.T / math.sqrt(DIM)
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
            out[s:e, h] = scores.softmax(-1) @ vv
    return out


@pytest.mark.parametrize("bounds", [[0, 5, 5, 12, 13, 20], [0, 7], [0, 3, 9, 11, 16]],
                         ids=["uneven+empty+pad", "one", "several"])
@pytest.mark.parametrize("impl", [looped_causal, padded_causal], ids=["looped", "padded"])
def test_thd_attention_matches_per_sample_softmax(bounds, impl):
    g = torch.Generator().manual_seed(len(bounds))
    t = bounds[-1]
    q = torch.randn(t, HEADS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t, GROUPS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t, GROUPS, DIM, generator=g, dtype=torch.float64, requires_grad=True)
    got = impl(_sdpa, q, k, v, bounds)
    want = _reference(q, k, v, bounds)
    assert got.shape == (t, HEADS, DIM)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    w = torch.randn(t, HEADS, DIM, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((got * w).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((want * w).sum(), (q, k, v))
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_padded_does_not_leak_across_samples():
    # change the second sample's keys: the first sample's outputs must not move
    bounds = [0, 4, 10]
    q, k, v = (torch.randn(10, h, DIM, dtype=torch.float64) for h in (HEADS, GROUPS, GROUPS))
    a = padded_causal(_sdpa, q, k, v, bounds)
    k2 = k.clone()
    k2[4:] += 1.0
    b = padded_causal(_sdpa, q, k2, v, bounds)
    assert torch.equal(a[:4], b[:4]) and not torch.equal(a[4:], b[4:])
