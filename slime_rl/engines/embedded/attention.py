"""Attention for the static path's decode step: one query token per row against the slot cache,
grouped-query heads served without copying the keys and values.

transformers' sdpa attention expands the KV heads to the query heads (`repeat_kv`) whenever a mask
is given (its GQA kernel path needs no mask on CUDA), and the static step always passes one (rows
have different lengths). That copy reads and writes every cached key and value `heads / kv_heads`
times per layer per step (6x for Qwen2.5-1.5B), so the memory traffic of attention grows with the
group size instead of being one read of the cache. For a decode step (q = 1) grouping is a reshape:
the G query heads sharing a KV head become G rows of one matrix product against that head's keys.

`decode_attention` is registered with transformers' AttentionInterface under `SLOT_DECODE`; the
static step switches the model to it for its own forward only (`slot_decode_attention`) and back,
so prefill and the dynamic path keep the model's own implementation.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

SLOT_DECODE = "slime_slot_decode"
VARLEN_PREFILL = "slime_varlen_prefill"
# set on an attention module by precision.apply_precision_policy (island "attn_scores")
FP32_SCORES = "_slime_fp32_scores"
# set on an attention module by precision.apply_deterministic_attention (--enable-deterministic-inference)
FLASH_DECODE = "_slime_flash_decode"
# flash attention's left window in `flash_slot_decode`: any value >= the row's length covers every key
# (measured with 2**20: bench/attention_invariance.py)
_COVERING_WINDOW = 1 << 20


def decode_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                     **kwargs) -> tuple[torch.Tensor, None]:
    """query [B, H, 1, D]; key, value [B, Hkv, T, D]; attention_mask [B, 1, 1, T], bool (True = attend)
    or additive float. Returns ([B, 1, H, D], None) like transformers' attention functions.
    Query head h reads KV head h // (H / Hkv), as transformers' repeat_kv pairs them."""
    B, H, q, D = query.shape
    assert q == 1, "decode_attention serves one query token per row"
    hkv = key.shape[1]
    scale = scaling if scaling is not None else D ** -0.5
    if getattr(module, FLASH_DECODE, False) and flash_decode_applies(query, key, value, attention_mask):
        return flash_slot_decode(query, key, value, attention_mask, scale), None
    if query.is_cuda and getattr(module, FP32_SCORES, False) and attention_mask is not None \
            and attention_mask.dtype == torch.bool:
        # CUDA: torch's fused attention reads each KV head once for its G query heads (enable_gqa)
        # and keeps the scores and the softmax in fp32 inside the kernel, as the trainer's flash
        # attention does; measured faster than the two GEMMs below (bench/decode_step.py, 1xH200:
        # 4.73 vs 4.99 ms at batch 64, 6.19 vs 6.95 ms at batch 256, 1.5B shape). Tried and slower:
        # the G query heads of a KV head as G query positions, without enable_gqa (cuDNN then picks a
        # 64-row tile: 4.90 ms at 64, 6.69 ms at 256; bench/decode_step.py's `sdpa_grouped`)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scale,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None
    qg = query.reshape(B, hkv, H // hkv, D)  # [B, Hkv, G, D]: the group's heads are adjacent
    if getattr(module, FP32_SCORES, False) and query.dtype != torch.float32:
        # fp32 scores from bf16 operands, as flash attention (the trainer's) keeps them: a bf16 score
        # of ~10 rounds in steps of 0.06, which moves the softmax by a few percent
        scores = fp32_scores(qg, key) * scale
    else:
        scores = torch.matmul(qg, key.transpose(-1, -2)).float() * scale  # [B, Hkv, G, T]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, float("-inf"))
        else:
            scores = scores + attention_mask.float()
    probs = torch.softmax(scores, dim=-1).to(value.dtype)
    out = torch.matmul(probs, value)  # [B, Hkv, G, D]
    return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None


def fp32_scores(qg: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """qg @ key^T in fp32 from bf16/fp16 operands: qg [B, Hkv, G, D], key [B, Hkv, T, D] (a view
    of the slot cache: its column stride is the cache's capacity) -> [B, Hkv, G, T] fp32.

    On CUDA one batched GEMM writes fp32 directly (`torch.bmm(..., out_dtype=float32)`: bf16
    products are exact in fp32 and cuBLAS accumulates in fp32), so the cached keys are read once,
    as bf16. Converting them first (`key.float()`) read every layer's keys, wrote them back twice
    as wide and read that again, each step. Elsewhere (CPU, or a torch without `out_dtype`) the
    operands are converted; the results are equal up to the order of the fp32 sums."""
    B, hkv, G, D = qg.shape
    T = key.shape[2]
    if qg.is_cuda:
        try:  # [B, Hkv] merge into one batch dim without a copy (the slot cache's layout allows it)
            return torch.bmm(qg.reshape(B * hkv, G, D), key.transpose(-1, -2).reshape(B * hkv, D, T),
                             out_dtype=torch.float32).view(B, hkv, G, T)
        except (TypeError, RuntimeError):  # torch without bmm's out_dtype
            pass
    return torch.matmul(qg.float(), key.transpose(-1, -2).float())


def slot_rows(t: torch.Tensor) -> torch.Tensor | None:
    """The packed-rows view [bs * capacity, heads, dim] of a time-major slot cache's keys or values
    `t` ([bs, heads, kv_len, dim], a view of [slots, capacity, heads, dim] memory: slots.SlotCache
    with time_major): row `slot * capacity + column`. None when `t` is not laid out so."""
    B, heads, _, dim = t.shape
    s0, s1, s2, s3 = t.stride()
    if s3 != 1 or s1 != dim or s2 != heads * dim or s0 % (heads * dim):
        return None
    capacity = s0 // (heads * dim)
    return t.as_strided((B * capacity, heads, dim), (heads * dim, dim, 1))


def flash_decode_applies(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None) -> bool:
    """Whether `flash_slot_decode` can serve this step: CUDA, bf16/fp16, a boolean mask, a
    time-major slot cache (keys and values with the same capacity), a head dim flash supports."""
    if not (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and attention_mask is not None
            and attention_mask.dtype == torch.bool and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256):
        return False
    k, v = slot_rows(key), slot_rows(value)
    return k is not None and v is not None and key.stride(0) == value.stride(0)


def flash_slot_decode(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """One query per row against its slot, by the flash kernel the trainer's packed attention runs
    (torch's varlen flash forward), so the output equals the trainer's at that position bit for bit
    (bench/attention_invariance.py: 0 of the elements differ; SDPA over the slots: 23 %).

    query [B, H, 1, D]; key/value [B, Hkv, kv_len, D] views of a time-major slot cache;
    attention_mask [B, 1, 1, kv_len] bool, True on each row's first n columns (its cached tokens and
    this step's). The keys are read in place: row i's keys start at i * capacity of the packed view
    (cu_seqlens_k) and it uses n of them (seqused_k). The window covering every key keeps flash off
    its grouped-query path for one query (it swaps the G query heads into G query rows: 14 % of the
    elements differ), which is not the path the trainer's prefill-shaped call takes.
    Returns [B, 1, H, D]."""
    B, H, _, D = query.shape
    k, v = slot_rows(key), slot_rows(value)
    capacity = key.stride(0) // (key.shape[1] * D)
    used = attention_mask.view(B, -1).sum(-1, dtype=torch.int32)
    cu_q = torch.arange(B + 1, dtype=torch.int32, device=query.device)
    out = _flash_forward(query.reshape(B, H, D), k, v, cu_q, cu_q * capacity, 1, key.shape[2], 0.0, True, False,
                         scale=scale, window_size_left=max(_COVERING_WINDOW, key.shape[2]), window_size_right=0,
                         seqused_k=used)[0]
    return out.view(B, 1, H, D)


def _flash_forward(*args, **kwargs):
    """torch's flash attention forward (aten._flash_attention_forward: varlen, seqused_k, windows)."""
    return torch.ops.aten._flash_attention_forward(*args, **kwargs)


def _varlen_attn():
    try:  # torch >= 2.11 (CUDA flash kernel)
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


@functools.cache
def varlen_call(varlen) -> tuple[dict, bool]:
    """How this torch's `varlen` (varlen_attn's signature) is called causally: the keyword (`is_causal`
    in some versions, a (left, right) window in others) and whether it takes `enable_gqa`; read once
    per function, not per layer and prefill."""
    params = set(inspect.signature(varlen).parameters)
    return ({"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}), "enable_gqa" in params


def varlen_prefill_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """A prefill's attention as the trainer computes it (trainer/attention.py, THD): the left-padded
    rows unpadded into one pack and run through torch's varlen flash attention, with the KV heads
    expanded or not exactly as the trainer's call does, so each prompt position gets the trainer's
    bits (and so do the keys and values the decode steps then read). Used under
    --enable-deterministic-inference on CUDA in bf16/fp16; anything else takes HF's sdpa attention.
    query [B, H, L, D]; key/value [B, Hkv, L, D] (a fresh prefill: no cached columns before these);
    attention_mask [B, 1, L, L] bool (causal and padding, True = attend) or None (no padding).
    Returns ([B, L, H, D], None)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    B, H, L, D = query.shape
    varlen = _varlen_attn()
    if varlen is None or dropout or not varlen_prefill_applies(query, key, attention_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    scale = scaling if scaling is not None else D ** -0.5
    # left padding: row b's real tokens are its last n_b positions; the last query sees all of them
    valid = attention_mask[:, 0, -1, :] if attention_mask is not None else \
        torch.ones(B, L, dtype=torch.bool, device=query.device)
    return packed_prefill(query, key, value, valid, scale, varlen), None


def varlen_prefill_applies(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> bool:
    """CUDA, bf16/fp16, a fresh prefill (keys only of these positions), a boolean mask or none."""
    return (query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and key.shape[2] == query.shape[2]
            and (attention_mask is None or attention_mask.dtype == torch.bool))


def packed_prefill(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, valid: torch.Tensor, scale: float,
                   varlen) -> torch.Tensor:
    """`varlen_prefill_attention`'s work: the positions where `valid` [B, L] is True unpadded into one
    pack (cu_seqlens from the rows' counts), causal attention over each row by `varlen` (torch's
    varlen_attn signature), called as the trainer calls it, and the outputs put back -> [B, L, H, D]
    (zeros at padding)."""
    B, H, L, D = query.shape
    hkv = key.shape[1]
    n = valid.sum(-1)
    cu = torch.cat([n.new_zeros(1), n.cumsum(0)]).to(torch.int32)
    top = int(n.max())
    q, k, v = (t.transpose(1, 2)[valid] for t in (query, key, value))  # [total, heads, D]
    extra, native_gqa = varlen_call(varlen)
    if H != hkv and native_gqa:
        extra = {**extra, "enable_gqa": True}
    elif H != hkv:  # as trainer/attention.py: query head i reads KV head i // (H / Hkv)
        k, v = k.repeat_interleave(H // hkv, dim=1), v.repeat_interleave(H // hkv, dim=1)
    packed = varlen(q, k, v, cu, cu, top, top, scale=scale, **extra)
    out = query.new_zeros(B, L, H, D)
    out[valid] = packed.view(-1, H, D)
    return out


def uses_flash_decode(model: torch.nn.Module) -> bool:
    """Whether any attention module of `model` is marked for `flash_slot_decode` (its slot cache must
    then be time-major, and its prefills run `varlen_prefill_attention`)."""
    return any(getattr(m, FLASH_DECODE, False) for m in model.modules())


AttentionInterface.register(SLOT_DECODE, decode_attention)
AttentionInterface.register(VARLEN_PREFILL, varlen_prefill_attention)
AttentionMaskInterface.register(VARLEN_PREFILL, sdpa_mask)  # the causal + padding mask sdpa gets


@contextlib.contextmanager
def slot_decode_attention(model: torch.nn.Module, implementation: str = SLOT_DECODE) -> Iterator[None]:
    """Run the model's attention layers through `decode_attention` (or another registered
    `implementation`, e.g. VARLEN_PREFILL) inside the block. Text-only models read
    `_attn_implementation` from the one config their layers share; the internal field is set
    directly so no sub-config is touched."""
    cfg = model.config.get_text_config()
    before = cfg._attn_implementation_internal
    cfg._attn_implementation_internal = implementation
    try:
        yield
    finally:
        cfg._attn_implementation_internal = before
