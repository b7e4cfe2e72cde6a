"""The static step's grouped-query decode attention against attention written out in float64 with
the KV heads expanded per query head (h reads KV head h // G), for bool and additive masks."""

from __future__ import annotations

import pytest
import torch

from slime_rl.engines.embedded.attention import decode_attention


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (9, 3)])
@pytest.mark.parametrize("bool_mask", [True, False])
def test_decode_attention_equals_expanded_heads_float64(heads, kv_heads, bool_mask):
    torch.manual_seed(heads * 10 + kv_heads)
    B, T, D = 3, 7, 8
    q, k, v = torch.randn(B, heads, 1, D), torch.randn(B, kv_heads, T, D), torch.randn(B, kv_heads, T, D)
    lengths = [7, 3, 5]  # row i attends to its first lengths[i] columns
    visible = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]
    mask = visible[:, None, None, :]
    if not bool_mask:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    got, _ = decode_attention(None, q, k, v, mask, scaling=0.3)
    assert got.shape == (B, 1, heads, D)
    g = heads // kv_heads
    for b in range(B):
        n = lengths[b]
        for h in range(heads):
            kk, vv = k[b, h // g, :n].double(), v[b, h // g, :n].double()
            w = torch.softmax(0.3 * (kk @ q[b, h, 0].double()), dim=0)
            torch.testing.assert_close(got[b, 0, h].double(), w @ vv, atol=1e-5, rtol=0)
