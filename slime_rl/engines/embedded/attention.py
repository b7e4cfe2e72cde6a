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
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from transformers import AttentionInterface

SLOT_DECODE = "slime_slot_decode"
# set on an attention module by precision.apply_precision_policy (island "attn_scores")
FP32_SCORES = "_slime_fp32_scores"


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


AttentionInterface.register(SLOT_DECODE, decode_attention)


@contextlib.contextmanager
def slot_decode_attention(model: torch.nn.Module) -> Iterator[None]:
    """Run the model's attention layers through `decode_attention` inside the block. Text-only models
    (the static path's) read `_attn_implementation` from the one config their layers share; the
    internal field is set directly so no sub-config is touched."""
    cfg = model.config.get_text_config()
    before = cfg._attn_implementation_internal
    cfg._attn_implementation_internal = SLOT_DECODE
    try:
        yield
    finally:
        cfg._attn_implementation_internal = before
