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


@pytest.mark.gpu
def test_fp32_scores_on_cuda_read_the_slot_cache_in_place_and_equal_float64():
    """CUDA takes fp32 scores from the bf16 operands in one GEMM (bmm with out_dtype), reading the
    keys where the slot cache keeps them (a column view of a wider buffer). The bf16 products are
    exact in fp32, so the result equals the float64 product of the same bf16 values up to fp32
    summation; and it equals the portable path (operands converted first)."""
    from slime_rl.engines.embedded.attention import fp32_scores

    torch.manual_seed(0)
    B, hkv, G, D, capacity, T = 5, 2, 6, 64, 96, 40
    cache = (torch.randn(B, hkv, capacity, D, device="cuda") * 3).bfloat16()
    key = cache[:, :, :T]  # what SlotCache.update hands attention: not contiguous
    qg = (torch.randn(B, hkv, G, D, device="cuda") * 3).bfloat16()
    got = fp32_scores(qg, key)
    assert got.dtype == torch.float32 and got.shape == (B, hkv, G, T)
    ref = qg.double() @ key.double().transpose(-1, -2)
    torch.testing.assert_close(got.double(), ref, atol=1e-3, rtol=1e-5)
    converted = torch.matmul(qg.float(), key.transpose(-1, -2).float())
    torch.testing.assert_close(got, converted, atol=1e-3, rtol=1e-5)
    # and the bf16-rounded product is measurably worse: the test can tell the two apart
    bf16 = (qg @ key.transpose(-1, -2)).double()
    assert (bf16 - ref).abs().max() > 10 * (got.double() - ref).abs().max()


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads", [(12, 2), (9, 3)])
def test_cuda_decode_attention_with_fp32_scores_equals_float64(heads, kv_heads):
    """On CUDA with the fp32-scores island the decode step's attention is torch's fused attention
    (enable_gqa, boolean mask): against float64 attention over the same bf16 values, with rows of
    different lengths read from a column view of a wider cache, it is as close as fp32 scores
    allow and closer than bf16 scores are."""
    from slime_rl.engines.embedded.attention import FP32_SCORES

    torch.manual_seed(heads)
    B, T, D, capacity = 4, 48, 64, 80
    q = (torch.randn(B, heads, 1, D, device="cuda") * 2).bfloat16()
    cache_k = (torch.randn(B, kv_heads, capacity, D, device="cuda") * 2).bfloat16()
    cache_v = torch.randn(B, kv_heads, capacity, D, device="cuda").bfloat16()
    k, v = cache_k[:, :, :T], cache_v[:, :, :T]
    lengths = torch.tensor([48, 5, 30, 17], device="cuda")
    mask = (torch.arange(T, device="cuda")[None, :] < lengths[:, None])[:, None, None, :]
    island, plain = torch.nn.Module(), torch.nn.Module()
    setattr(island, FP32_SCORES, True)
    got = decode_attention(island, q, k, v, mask, scaling=D ** -0.5)[0]
    assert got.shape == (B, 1, heads, D)
    g = heads // kv_heads
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * D ** -0.5
    ref = (torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1) @ vv).transpose(1, 2)
    err = (got.double() - ref).abs().max().item()
    assert err < 2e-2, err  # bf16 output rounding of values of order 1
    err_bf16 = (decode_attention(plain, q, k, v, mask, scaling=D ** -0.5)[0].double() - ref).abs().mean().item()
    assert (got.double() - ref).abs().mean().item() < err_bf16
