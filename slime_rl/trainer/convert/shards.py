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

Qwen3-Next's gated attention (Layout.QKV_GATED, megatron's attention_output_gate): per query group megatron holds
[q(heads of the group); gate(heads of the group); k; v] (Attention.get_query_key_value_tensors), HF's q_proj per head
[q_h; gate_h]. The GatedDeltaNet's in_proj (Layout.GDN_IN_PROJ) is split by megatron into the sections [q; k; v; z;
b; a] of this rank's heads (GatedDeltaNet.in_proj_split_sections, each section's heads in order), while HF's
in_proj_qkvz holds per key head [q_h; k_h; v (its value heads); z (its value heads)] and in_proj_ba per key head
[b (its value heads); a (its value heads)]; value head j belongs to key head j // (value heads / key heads) in both
(megatron repeats each key head that many times, repeat_interleave). The conv1d's channels (Layout.GDN_CONV) are
HF's [q; k; v] (all heads of each), megatron's the same sections of this rank's heads. Qwen3.5's in_proj
(Layout.GDN_IN_PROJ_SPLIT) is four HF tensors already in section order: in_proj_qkv [all q; all k; all v] (the conv1d's
channel order), in_proj_z, in_proj_b, in_proj_a, each over all value heads in order.
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


def _gated_qkv_sections(q_gate: Tensor, k: Tensor, v: Tensor, arch: ModelArch) -> Tensor:
    """HF q_proj (per head [q; gate]), k_proj, v_proj -> megatron's per group [q; gate; k; v], all groups."""
    groups, d = arch.num_query_groups, arch.kv_channels
    per = arch.num_attention_heads // groups
    rest = q_gate.shape[1:]
    qg = q_gate.reshape(groups, per, 2, d, *rest)
    fused = torch.cat([qg[:, :, 0].reshape(groups, per * d, *rest), qg[:, :, 1].reshape(groups, per * d, *rest),
                       k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1)
    return fused.reshape(groups * (2 * per + 2) * d, *rest)


def _gated_qkv_unfuse(fused: Tensor, arch: ModelArch) -> tuple[Tensor, Tensor, Tensor]:
    groups, d = arch.num_query_groups, arch.kv_channels
    per = arch.num_attention_heads // groups
    rest = fused.shape[1:]
    q, gate, k, v = torch.split(fused.reshape(groups, (2 * per + 2) * d, *rest), [per * d, per * d, d, d], dim=1)
    q_gate = torch.stack([q.reshape(groups, per, d, *rest), gate.reshape(groups, per, d, *rest)], dim=2)
    return (q_gate.reshape(groups * per * 2 * d, *rest), k.reshape(groups * d, *rest), v.reshape(groups * d, *rest))


def _gdn_dims(arch: ModelArch) -> tuple[int, int, int, int]:
    """(key heads, value heads per key head, key head width, value head width) of the GatedDeltaNet."""
    keys = arch.linear_num_key_heads
    return keys, arch.linear_num_value_heads // keys, arch.linear_key_head_dim, arch.linear_value_head_dim


def _gdn_in_proj_sections(qkvz: Tensor, ba: Tensor, arch: ModelArch) -> list[Tensor]:
    """HF in_proj_qkvz / in_proj_ba (per key head) -> the sections [q, k, v, z, b, a], each over all heads in order."""
    keys, r, dk, dv = _gdn_dims(arch)
    rest = qkvz.shape[1:]
    q, k, v, z = torch.split(qkvz.reshape(keys, 2 * dk + 2 * r * dv, *rest), [dk, dk, r * dv, r * dv], dim=1)
    b, a = torch.split(ba.reshape(keys, 2 * r, *rest), [r, r], dim=1)
    return [t.reshape(-1, *rest) for t in (q, k, v, z, b, a)]


def _gdn_in_proj_hf(sections: list[Tensor], arch: ModelArch) -> tuple[Tensor, Tensor]:
    """The sections [q, k, v, z, b, a] (all heads) -> HF in_proj_qkvz, in_proj_ba (per key head)."""
    keys, r, dk, dv = _gdn_dims(arch)
    q, k, v, z, b, a = sections
    rest = q.shape[1:]
    qkvz = torch.cat([q.reshape(keys, dk, *rest), k.reshape(keys, dk, *rest), v.reshape(keys, r * dv, *rest),
                      z.reshape(keys, r * dv, *rest)], dim=1)
    ba = torch.cat([b.reshape(keys, r, *rest), a.reshape(keys, r, *rest)], dim=1)
    return qkvz.reshape(-1, *rest), ba.reshape(-1, *rest)


def _gdn_conv_sizes(arch: ModelArch) -> list[int]:
    key = arch.linear_num_key_heads * arch.linear_key_head_dim
    return [key, key, arch.linear_num_value_heads * arch.linear_value_head_dim]


def _split_sections(sections: list[Tensor], tp_rank: int, tp_size: int) -> Tensor:
    """Each section split on dim 0 over TP; this rank's parts, concatenated in section order."""
    return torch.cat([t.chunk(tp_size, dim=0)[tp_rank] for t in sections])


def _gather_sections(shards: list[Tensor], sizes: list[int]) -> list[Tensor]:
    """The shards of _split_sections (rank order) -> the whole sections, given their full sizes."""
    tp = len(shards)
    parts = [torch.split(s, [n // tp for n in sizes]) for s in shards]
    return [torch.cat([p[i] for p in parts]) for i in range(len(sizes))]


def _gdn_in_proj_sizes(arch: ModelArch) -> list[int]:
    keys, r, dk, dv = _gdn_dims(arch)
    return [keys * dk, keys * dk, keys * r * dv, keys * r * dv, keys * r, keys * r]


def _gdn_split_sizes(arch: ModelArch) -> list[int]:
    """The rows of Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a."""
    q, k, v, z, b, a = _gdn_in_proj_sizes(arch)
    return [q + k + v, z, b, a]


def _gdn_split_sections(qkv: Tensor, z: Tensor, b: Tensor, a: Tensor, arch: ModelArch) -> list[Tensor]:
    """Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a -> the sections [q, k, v, z, b, a] (all heads)."""
    return [*torch.split(qkv, _gdn_conv_sizes(arch)), z, b, a]


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
    if pm.layout is Layout.COLUMN_HALVES_SWAPPED:
        return _swap_halves(hf[0]).chunk(tp_size, dim=0)[tp_rank]
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
    if pm.layout is Layout.QKV_GATED:
        return _gated_qkv_sections(*hf, arch).chunk(tp_size, dim=0)[tp_rank]
    if pm.layout is Layout.GDN_IN_PROJ:
        return _split_sections(_gdn_in_proj_sections(*hf, arch), tp_rank, tp_size)
    if pm.layout is Layout.GDN_IN_PROJ_SPLIT:
        return _split_sections(_gdn_split_sections(*hf, arch), tp_rank, tp_size)
    if pm.layout is Layout.GDN_CONV:
        return _split_sections(list(torch.split(hf[0], _gdn_conv_sizes(arch))), tp_rank, tp_size)
    raise AssertionError(pm.layout)


def _swap_halves(t: Tensor) -> Tensor:
    """[rows, (a; b)] -> [rows, (b; a)] (a copy): MiMo's MTP input_proj <-> megatron's eh_proj, either way."""
    first, second = t.chunk(2, dim=1)
    return torch.cat([second, first], dim=1)


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
    if pm.layout is Layout.COLUMN_HALVES_SWAPPED:
        return [(pm.hf[0], _swap_halves(_cat(shards)))]
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
    if pm.layout is Layout.QKV_GATED:
        return list(zip(pm.hf, _gated_qkv_unfuse(_cat(shards), arch), strict=True))
    if pm.layout is Layout.GDN_IN_PROJ:
        return list(zip(pm.hf, _gdn_in_proj_hf(_gather_sections(shards, _gdn_in_proj_sizes(arch)), arch),
                        strict=True))
    if pm.layout is Layout.GDN_IN_PROJ_SPLIT:
        if len(shards) == 1:  # one rank's [q; k; v; z; b; a] is HF's four tensors one after the other
            return [(n, t) for n, t in zip(pm.hf, torch.split(shards[0], _gdn_split_sizes(arch)), strict=True)]
        q, k, v, z, b, a = _gather_sections(shards, _gdn_in_proj_sizes(arch))
        return list(zip(pm.hf, (torch.cat([q, k, v]), z, b, a), strict=True))
    if pm.layout is Layout.GDN_CONV:
        return [(pm.hf[0], torch.cat(_gather_sections(shards, _gdn_conv_sizes(arch))))]
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
    copies it into its bucket as is (one strided copy) and announces the HF shape.

    The one HF tensor no view can give is the GatedDeltaNet's in_proj_qkvz, whose rows per key head
    interleave four sections of unequal widths: it comes as a copy (`COPIED_AT_TP1`)."""
    rest = tuple(param.shape[1:])
    if pm.layout is Layout.QKV_GATED:
        groups, d = arch.num_query_groups, arch.kv_channels
        per = arch.num_attention_heads // groups
        q_gate, k, v = torch.split(param.view(groups, 2 * per + 2, d, *rest), [2 * per, 1, 1], dim=1)
        # [groups, (queries, gates), per, d] -> per head: its query rows, then its gate rows
        q_gate = q_gate.unflatten(1, (2, per)).transpose(1, 2)
        return [(pm.hf[0], q_gate, (groups * per * 2 * d, *rest)), (pm.hf[1], k, (groups * d, *rest)),
                (pm.hf[2], v, (groups * d, *rest))]
    if pm.layout is Layout.GDN_CONV:  # one rank's [q; k; v] is HF's
        return [(pm.hf[0], param, tuple(param.shape))]
    if pm.layout is Layout.GDN_IN_PROJ:
        keys, r, _, _ = _gdn_dims(arch)
        qkvz_rows = sum(_gdn_in_proj_sizes(arch)[:4])
        ba = param[qkvz_rows:].view(2, keys, r, *rest).transpose(0, 1)  # per key head: its b, then its a
        ((_, qkvz),) = [(n, t) for n, t in mcore_shards_to_hf(pm, [param], arch) if n == pm.hf[0]]
        return [(pm.hf[0], qkvz, tuple(qkvz.shape)), (pm.hf[1], ba, (keys * 2 * r, *rest))]
    if pm.layout is not Layout.QKV:
        return [(n, t, tuple(t.shape)) for n, t in mcore_shards_to_hf(pm, [param], arch)]
    groups, d = arch.num_query_groups, arch.kv_channels
    q_per_group = arch.num_attention_heads // groups
    per_group = param.view(groups, (q_per_group + 2) * d, *rest)
    parts = torch.split(per_group, [q_per_group * d, d, d], dim=1)
    return [(n, t, (t.shape[0] * t.shape[1], *rest)) for n, t in zip(pm.hf, parts, strict=True)]


# (layout, HF name index) whose TP=1 weight-sync source is a copy of the parameter, not a view of it
COPIED_AT_TP1 = frozenset({(Layout.GDN_IN_PROJ, 0), (Layout.COLUMN_HALVES_SWAPPED, 0)})
