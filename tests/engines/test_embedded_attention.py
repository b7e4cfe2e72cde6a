"""The static step's grouped-query decode attention against attention written out in float64 with
the KV heads expanded per query head (h reads KV head h // G), for bool and additive masks."""

from __future__ import annotations

from types import SimpleNamespace

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


def _time_major_cache(B: int, capacity: int, kv_heads: int, D: int, device: str = "cpu",
                      dtype: torch.dtype = torch.float32):
    """A time-major slot cache layer as slots.SlotCache(time_major=True) allocates it: [slots,
    capacity, heads, dim] memory seen as [slots, heads, capacity, dim]."""
    from transformers.cache_utils import DynamicCache

    from slime_rl.engines.embedded.slots import SlotCache

    like = DynamicCache()
    like.update(torch.zeros(1, kv_heads, 1, D, dtype=dtype, device=device),
                torch.zeros(1, kv_heads, 1, D, dtype=dtype, device=device), 0)
    cache = SlotCache(slots=B, capacity=capacity, time_major=True)
    cache.allocate(like)
    return cache


def test_slot_rows_view_of_a_time_major_cache():
    """slot_rows gives the packed-rows view flash reads: row slot * capacity + column is that slot's
    key at that column, for a column slice (kv_len) of the first bs slots, without a copy; a
    head-major (default) cache is refused."""
    from slime_rl.engines.embedded.attention import slot_rows
    from slime_rl.engines.embedded.slots import SlotCache

    B, capacity, hkv, D = 5, 16, 3, 8
    cache = _time_major_cache(B, capacity, hkv, D)
    keys = cache.layers[0].keys
    assert keys.shape == (B, hkv, capacity, D) and keys.transpose(1, 2).is_contiguous()
    keys.copy_(torch.arange(keys.numel(), dtype=torch.float32).view(B, capacity, hkv, D).transpose(1, 2))
    bs, kv_len = 3, 10
    view = keys[:bs, :, :kv_len]
    rows = slot_rows(view)
    assert rows is not None and rows.shape == (bs * capacity, hkv, D)
    assert rows.data_ptr() == keys.data_ptr()  # in place
    for s in range(bs):
        for col in range(capacity):
            assert torch.equal(rows[s * capacity + col], keys[s, :, col])
    head_major = SlotCache(slots=B, capacity=capacity)
    head_major.allocate(cache)  # same shapes, default layout
    assert slot_rows(head_major.layers[0].keys[:bs, :, :kv_len]) is None


@pytest.mark.gpu
@pytest.mark.parametrize("heads,kv_heads,capacity", [(9, 3, 320), (12, 2, 64), (8, 8, 128), (12, 2, 200)])
def test_flash_decode_equals_the_trainers_attention_bit_for_bit(heads, kv_heads, capacity):
    """Under --enable-deterministic-inference a decode step's attention (flash over the time-major
    slot cache) gives, for each row's new token, exactly the bits the trainer's packed attention
    (trainer/attention.py SDPACoreAttention, THD) gives at that position over the whole sequence;
    the default decode attention does not once a row spans more than one of flash's key blocks (so
    the test can tell the two apart; with <= 56 keys the default gave the same bits on an H200)."""
    pytest.importorskip("megatron.core")  # the trainer's side (on the GPU machine: after the wheels)
    from megatron.core.packed_seq_params import PackedSeqParams

    from slime_rl.engines.embedded.attention import FLASH_DECODE, FP32_SCORES
    from slime_rl.trainer.attention import SDPACoreAttention

    torch.manual_seed(heads + capacity)
    D, B = 64, 6
    lengths = torch.randint(1, capacity - 8, (B,)).tolist()
    lengths[0] = capacity - 8
    total = sum(lengths)
    q = torch.randn(total, heads, D, device="cuda").bfloat16()
    k = torch.randn(total, kv_heads, D, device="cuda").bfloat16()
    v = torch.randn(total, kv_heads, D, device="cuda").bfloat16()
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    # the trainer's call: its THD core attention over the pack (the config fields it reads; TP 1)
    cfg = SimpleNamespace(context_parallel_size=1, num_attention_heads=heads, num_query_groups=kv_heads,
                          kv_channels=D, attention_dropout=0.0)
    core = SDPACoreAttention(cfg, layer_number=1, attn_mask_type=None, attention_type="self",
                             pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)))
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                             max_seqlen_kv=max(lengths))
    ref = core._thd(q, k, v, packed).view(total, heads, D)[cu[1:].long() - 1]  # each row's last position
    # the engine's decode step: the cache holds each row's keys, the query is the row's last token
    cache = _time_major_cache(B, capacity, kv_heads, D, device="cuda", dtype=torch.bfloat16)
    layer = cache.layers[0]
    for i, n in enumerate(lengths):
        layer.keys[i, :, :n] = k[cu[i]:cu[i + 1]].transpose(0, 1)
        layer.values[i, :, :n] = v[cu[i]:cu[i + 1]].transpose(0, 1)
    kv_len = capacity - 8  # the graph's column bucket (< capacity): at least every row's length
    mask = (torch.arange(kv_len, device="cuda")[None, :] < torch.tensor(lengths, device="cuda")[:, None])
    mask = mask[:, None, None, :]
    query = q[cu[1:].long() - 1][:, :, None, :]  # [B, H, 1, D]
    flash, default = torch.nn.Module(), torch.nn.Module()
    setattr(flash, FLASH_DECODE, True)
    setattr(flash, FP32_SCORES, True)
    setattr(default, FP32_SCORES, True)
    got = decode_attention(flash, query, layer.keys[:, :, :kv_len], layer.values[:, :, :kv_len], mask,
                           scaling=D ** -0.5)[0][:, 0]
    assert torch.equal(got, ref)
    if kv_len > 128:  # more than one key block of the flash kernel (head dim 64: 128 keys)
        other = decode_attention(default, query, layer.keys[:, :, :kv_len], layer.values[:, :, :kv_len], mask,
                                 scaling=D ** -0.5)[0][:, 0]
        assert not torch.equal(other, ref)


@pytest.mark.gpu
def test_varlen_prefill_equals_the_trainers_attention_bit_for_bit():
    """Under --enable-deterministic-inference a left-padded prefill of rows of different lengths gives
    every real position the bits of the trainer's THD attention over the same rows packed."""
    pytest.importorskip("megatron.core")
    from megatron.core.packed_seq_params import PackedSeqParams

    from slime_rl.engines.embedded.attention import varlen_prefill_attention
    from slime_rl.trainer.attention import SDPACoreAttention

    torch.manual_seed(1)
    heads, kv_heads, D = 9, 3, 64
    lengths = [70, 5, 33, 129]
    B, L = len(lengths), max(lengths)
    q = torch.randn(B, heads, L, D, device="cuda").bfloat16()
    k = torch.randn(B, kv_heads, L, D, device="cuda").bfloat16()
    v = torch.randn(B, kv_heads, L, D, device="cuda").bfloat16()
    pad = torch.tensor([[t >= L - n for t in range(L)] for n in lengths], device="cuda")  # left padding
    causal = torch.ones(L, L, dtype=torch.bool, device="cuda").tril()
    mask = (causal[None] & pad[:, None, :])[:, None]  # [B, 1, L, L], as sdpa_mask builds it
    module = torch.nn.Module()  # what HF's sdpa attention reads of an attention layer
    module.num_key_value_groups, module.is_causal = heads // kv_heads, True
    got = varlen_prefill_attention(module, q, k, v, mask, scaling=D ** -0.5)[0]  # [B, L, H, D]
    cfg = SimpleNamespace(context_parallel_size=1, num_attention_heads=heads, num_query_groups=kv_heads,
                          kv_channels=D, attention_dropout=0.0)
    core = SDPACoreAttention(cfg, layer_number=1, attn_mask_type=None, attention_type="self",
                             pg_collection=SimpleNamespace(tp=SimpleNamespace(size=lambda: 1)))
    pq, pk, pv = (t.transpose(1, 2)[pad] for t in (q, k, v))
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=L, max_seqlen_kv=L)
    ref = core._thd(pq, pk, pv, packed).view(-1, heads, D)
    assert torch.equal(got[pad], ref)
    # HF's sdpa over the padded batch (the default prefill) is another kernel: not the same bits
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    other = sdpa_attention_forward(module, q, k, v, mask, scaling=D ** -0.5)[0]
    assert not torch.equal(other[pad], ref)


def test_packed_prefill_unpads_left_padded_rows_and_puts_them_back():
    """The packing around the varlen kernel (CPU, the kernel replaced by a float64 causal attention
    per packed row, a stand-in for this one unit): every real position of every left-padded row gets
    causal attention over its own row only, against float64 attention on each row alone; the
    kernel sees the trainer's arguments (cu_seqlens from the row lengths, max length, KV heads
    expanded to the query heads when it has no enable_gqa)."""
    from engine_testlib import causal_packed_attention

    from slime_rl.engines.embedded.attention import packed_prefill

    torch.manual_seed(3)
    heads, kv_heads, D = 6, 2, 8
    lengths = [4, 1, 7]
    B, L = len(lengths), max(lengths)
    q, k, v = (torch.randn(B, h, L, D) for h in (heads, kv_heads, kv_heads))
    valid = torch.tensor([[t >= L - n for t in range(L)] for n in lengths])
    seen = {}

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        seen.update(cu=cu_q.tolist(), max=(max_q, max_k), heads=k.shape[1], window=window_size)
        return causal_packed_attention(q, k, v, cu_q, scale)

    got = packed_prefill(q, k, v, valid, 0.5, kernel)
    assert seen == {"cu": [0, 4, 5, 12], "max": (7, 7), "heads": heads, "window": (-1, 0)}
    assert got.shape == (B, L, heads, D)
    for b, n in enumerate(lengths):
        assert torch.equal(got[b, :L - n], torch.zeros(L - n, heads, D))  # padding: nothing written
        for h in range(heads):
            qq, kk, vv = q[b, h, L - n:].double(), k[b, h // 3, L - n:].double(), v[b, h // 3, L - n:].double()
            s = (qq @ kk.T * 0.5).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
            torch.testing.assert_close(got[b, L - n:, h].double(), s.softmax(-1) @ vv, atol=1e-6, rtol=0)
