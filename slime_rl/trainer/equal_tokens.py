"""Equal token counts over megatron's expert-TP x EP group, for `--moe-token-dispatcher-type allgather`.

megatron-core 0.19's MoEAllGatherTokenDispatcher gathers every MoE layer's hidden states, probs and
routing map over the tp_ep group with a plain all-gather along the token dimension, which needs the
same number of tokens on every rank of the group (megatron-LM trains fixed-length sequences). Here
the ranks of that group are different DP ranks with different samples, so every micro-batch is
right-padded to the longest of its position over the group (the micro-batches of a schedule are
counted and matched first). The added positions are padding: after every real token (causal
attention keeps them out of the real tokens' outputs), marked in `padding` (out of the routers'
load-balancing loss) and, in a packed row, a segment of their own; no log-prob reads them.
Packed rows are padded in length; right-padded [b, s] micro-batches in s, which needs the same b on
every rank of the group.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from slime_rl.trainer.batching import MicroBatch
from slime_rl.trainer.mcore import PackedSeqParams


def _pad_routing(routing, rows: int, seq: int, new_seq: int):
    """R3/R2 routing ([seq * rows, L, k] sequence-major, [seq * rows] mask) extended to new_seq positions."""
    if routing is None:
        return None
    ids, mask = routing
    _, layers, k = ids.shape
    fill = ids.new_tensor(list(range(k))).expand(new_seq - seq, rows, layers, k)
    ids = torch.cat([ids.reshape(seq, rows, layers, k), fill]).reshape(-1, layers, k)
    mask = torch.cat([mask.reshape(seq, rows), mask.new_zeros(new_seq - seq, rows)]).reshape(-1)
    return ids, mask


def pad_micro_batch(mb: MicroBatch, length: int) -> MicroBatch:
    """`mb` with its rows right-padded to `length` positions (see the module docstring)."""
    rows, seq = mb.tokens.shape
    if length == seq:
        return mb
    extra = length - seq
    tokens = torch.cat([mb.tokens, mb.tokens.new_zeros(rows, extra)], dim=1)
    padding = torch.cat([mb.padding, mb.padding.new_ones(rows, extra)], dim=1)
    if mb.packed_seq_params is not None:
        psp = mb.packed_seq_params
        cu = torch.cat([psp.cu_seqlens_q, psp.cu_seqlens_q.new_tensor([length])])
        position_ids = torch.cat([mb.position_ids, torch.arange(extra, device=mb.position_ids.device)[None]], dim=1)
        top = max(psp.max_seqlen_q, extra)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=top, max_seqlen_kv=top)
    else:
        psp = None
        position_ids = torch.arange(length, device=mb.position_ids.device).expand(rows, length).contiguous()
    return dataclasses.replace(mb, tokens=tokens, position_ids=position_ids, padding=padding,
                               packed_seq_params=psp, routing=_pad_routing(mb.routing, rows, seq, length))


def equalize_tokens(mbs: list[MicroBatch], group: dist.ProcessGroup, device: torch.device) -> list[MicroBatch]:
    """Every micro-batch padded to the longest of its position over `group` (the same count and,
    right-padded, the same rows per micro-batch on every rank, else a ValueError naming the flags)."""
    if any(mb.cp_own is not None or mb.vision is not None for mb in mbs):
        raise ValueError("--moe-token-dispatcher-type allgather with --context-parallel-size > 1 or a vision "
                         "model: not supported (use alltoall)")
    n = len(mbs)
    head = torch.tensor([n, -n], dtype=torch.int64, device=device)
    dist.all_reduce(head, op=dist.ReduceOp.MAX, group=group)
    if int(head[0]) != -int(head[1]):
        raise ValueError(f"--moe-token-dispatcher-type allgather: the expert-parallel ranks run {-int(head[1])} to "
                         f"{int(head[0])} micro-batches; the allgather dispatcher needs the same count (use alltoall)")
    shape = torch.tensor([v for mb in mbs for v in (mb.tokens.shape[0], -mb.tokens.shape[0], mb.tokens.shape[1])],
                         dtype=torch.int64, device=device)
    dist.all_reduce(shape, op=dist.ReduceOp.MAX, group=group)
    out = []
    for k, mb in enumerate(mbs):
        rows_max, rows_min, seq = (int(v) for v in shape[3 * k:3 * k + 3])
        if rows_max != -rows_min:
            raise ValueError("--moe-token-dispatcher-type allgather with --no-pack-sequences: a micro-batch has "
                             f"{-rows_min} to {rows_max} samples over the expert-parallel ranks; the allgather "
                             "dispatcher needs equal token counts (pack the sequences or use alltoall)")
        out.append(pad_micro_batch(mb, seq))
    return out
