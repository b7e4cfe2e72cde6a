"""Tensor math HF <-> Megatron for one registry entry: full HF tensors -> one TP rank's shard, and
all TP ranks' shards -> full HF tensors.

Megatron's fused QKV layout (checked against SelfAttention.get_query_key_value_tensors in
megatron-core 0.19): the output rows are grouped by query group g = 0..G-1, and each group holds
its q heads, then its one k head, then its one v head:
    [q(g0, h0..h{Q-1}), k(g0), v(g0), q(g1, ...), k(g1), v(g1), ...]   (Q = heads / groups)
each head being kv_channels rows. A TP rank owns G / tp whole groups, i.e. a contiguous slice of
rows, so the global layout is the plain concatenation of the shards.

fc1 is [gate; up] *per rank*: MLP splits its local output in two halves (act(first) * second),
so rank r holds [gate_r; up_r] and the concatenation of shards is NOT [gate; up]. GLM-4's HF
checkpoint holds the two as one tensor (`gate_up_proj`, [gate; up], chunked in two by its forward):
Layout.FC1_FUSED, the same shards from the halves of that one tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slime_rl.config.families import Layout, ParamMap
from slime_rl.trainer.convert.arch import ModelArch


def _fuse_qkv(q: Tensor, k: Tensor, v: Tensor, arch: ModelArch) -> Tensor:
    groups, d = arch.num_query_groups, arch.kv_channels
    q_per_group = arch.num_attention_heads // groups
    rest = q.shape[1:]  # (hidden,) for weights, () for biases
    fused = torch.cat([q.reshape(groups, q_per_group * d, *rest), k.reshape(groups, d, *rest),
                       v.reshape(groups, d, *rest)], dim=1)
    return fused.reshape(groups * (q_per_group + 2) * d, *rest)


def _unfuse_qkv(fused: Tensor, arch: ModelArch) -> tuple[Tensor, Tensor, Tensor]:
    groups, d = arch.num_query_groups, arch.kv_channels
    q_per_group = arch.num_attention_heads // groups
    rest = fused.shape[1:]
    per_group = fused.reshape(groups, (q_per_group + 2) * d, *rest)
    q, k, v = torch.split(per_group, [q_per_group * d, d, d], dim=1)
    return (q.reshape(groups * q_per_group * d, *rest), k.reshape(groups * d, *rest),
            v.reshape(groups * d, *rest))


def hf_to_mcore_shard(pm: ParamMap, hf: list[Tensor], arch: ModelArch, tp_rank: int,
                      tp_size: int) -> Tensor:
    """Full HF tensors (in `pm.hf` order) -> the Megatron tensor held by TP rank `tp_rank`."""
    assert len(hf) == len(pm.hf), (pm, len(hf))
    if pm.layout is Layout.REPLICATED:
        return hf[0]
    if pm.layout is Layout.ROW:
        return hf[0].chunk(tp_size, dim=1)[tp_rank]
    if pm.layout is Layout.COLUMN:
        return hf[0].chunk(tp_size, dim=0)[tp_rank]
    if pm.layout is Layout.VOCAB:
        full = hf[0]
        if full.shape[0] != arch.vocab_size:
            raise ValueError(f"{pm.hf[0]}: {full.shape[0]} rows, config.json says vocab_size "
                             f"{arch.vocab_size}")
        # padded rows are zero; logits of padded ids are masked to -inf anyway (logprobs.py)
        pad = full.new_zeros(arch.padded_vocab_size - arch.vocab_size, *full.shape[1:])
        return torch.cat([full, pad]).chunk(tp_size, dim=0)[tp_rank]
    if pm.layout is Layout.QKV:
        return _fuse_qkv(*hf, arch).chunk(tp_size, dim=0)[tp_rank]
    if pm.layout in (Layout.FC1, Layout.FC1_FUSED):
        halves = hf if pm.layout is Layout.FC1 else hf[0].chunk(2, dim=0)
        if tp_size == 1 and pm.layout is Layout.FC1_FUSED:
            return hf[0]
        gate, up = (t.chunk(tp_size, dim=0)[tp_rank] for t in halves)
        return torch.cat([gate, up])
    raise AssertionError(pm.layout)


def _cat(tensors: list[Tensor], dim: int = 0) -> Tensor:
    # one shard (TP=1): the tensor itself, not a copy. Weight sync copies every tensor into its
    # bucket anyway, and an extra allocation + copy per tensor was most of the sync's host time.
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors, dim=dim)


def mcore_shards_to_hf(pm: ParamMap, shards: list[Tensor], arch: ModelArch) -> list[tuple[str, Tensor]]:
    """The shards of every TP rank (in TP rank order) -> [(hf_name, full HF tensor)].

    The results may be views of the shards (at TP=1 they are): a caller that keeps them past the next
    optimizer step, or writes them where shared storage is refused (safetensors), copies them."""
    if pm.layout is Layout.REPLICATED:
        return [(pm.hf[0], shards[0])]
    if pm.layout is Layout.ROW:
        return [(pm.hf[0], _cat(shards, dim=1))]
    if pm.layout is Layout.COLUMN:
        return [(pm.hf[0], _cat(shards))]
    if pm.layout is Layout.VOCAB:
        return [(pm.hf[0], _cat(shards)[: arch.vocab_size])]
    if pm.layout is Layout.QKV:
        return list(zip(pm.hf, _unfuse_qkv(_cat(shards), arch), strict=True))
    if pm.layout is Layout.FC1:
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(pm.hf[0], _cat([h[0] for h in halves])), (pm.hf[1], _cat([h[1] for h in halves]))]
    if pm.layout is Layout.FC1_FUSED:  # [gate; up] whole: at TP=1 the shard itself
        if len(shards) == 1:
            return [(pm.hf[0], shards[0])]
        halves = [s.chunk(2, dim=0) for s in shards]
        return [(pm.hf[0], torch.cat([h[0] for h in halves] + [h[1] for h in halves]))]
    raise AssertionError(pm.layout)


def mcore_shape(pm: ParamMap, hf_shapes: list[tuple[int, ...]], arch: ModelArch,
                tp_size: int) -> tuple[int, ...]:
    """The shape of one TP rank's shard, from the HF shapes (for checks before copying)."""
    metas = [torch.empty(s, device="meta") for s in hf_shapes]
    return tuple(hf_to_mcore_shard(pm, metas, arch, 0, tp_size).shape)


def mcore_param_to_hf_views(pm: ParamMap, param: Tensor, arch: ModelArch) -> list[tuple[str, Tensor, tuple[int, ...]]]:
    """TP=1 only: [(hf_name, view of `param`, HF shape)]. The view holds the HF tensor's elements in
    row-major order but may keep a finer shape: a QKV split with more than one query group is a
    (groups, rows, ...) strided view, whose reshape to the HF shape would be a copy. Weight sync
    copies it into its bucket as is (one strided copy) and announces the HF shape."""
    if pm.layout is not Layout.QKV:
        return [(n, t, tuple(t.shape)) for n, t in mcore_shards_to_hf(pm, [param], arch)]
    groups, d = arch.num_query_groups, arch.kv_channels
    q_per_group = arch.num_attention_heads // groups
    rest = tuple(param.shape[1:])
    per_group = param.view(groups, (q_per_group + 2) * d, *rest)
    parts = torch.split(per_group, [q_per_group * d, d, d], dim=1)
    return [(n, t, (t.shape[0] * t.shape[1], *rest)) for n, t in zip(pm.hf, parts, strict=True)]
