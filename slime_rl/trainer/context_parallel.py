"""Context parallelism (CP) for our core attention: layout, micro-batch split, autograd collectives.

megatron-core 0.19.2's local DotProductAttention refuses context_parallel_size > 1 (only
TransformerEngine's attention implements CP), so SDPACoreAttention does it itself, in megatron's
load-balanced layout (the one RotaryEmbedding's `get_pos_emb_on_this_cp_rank` and the THD RoPE's
`_get_thd_freqs_on_this_cp_rank` assume): a sequence of length L (a multiple of 2 * cp) is cut
into 2 * cp chunks of c = L / (2 * cp); CP rank r holds chunks r and 2 * cp - 1 - r, in that
order, so every rank gets the same share of causal work.
  * padded micro-batches (BSHD): each row of the padded [b, S] batch is one such sequence (S is
    padded on the right to a multiple of 2 * cp; right padding never changes a causal real token);
  * packed micro-batches (THD): each sample is padded to a multiple of 2 * cp and split the same
    way, as TE does; cu_seqlens stay global (the padded sample bounds), megatron's THD RoPE reads
    them and divides by cp itself.
The padding mask is split with the tokens (the CP pad is padding): an MoE model's routers leave
padding out of the load-balancing loss, whose token counts megatron reduces over TP x CP itself.
In attention every rank all-gathers K and V over the CP group (backward: the gradients of the
gathered K/V are summed back onto the rank that owns them) and masks by global positions: a local
query at position p sees the keys at positions <= p of its own sequence.
The logits stay local: each rank computes the log-probs (and entropy) of the response tokens
whose predicting position it holds; `gather_replicated` sums these disjoint parts over CP, so
every CP rank holds the whole [b, T] tensor and computes the same loss; its backward passes each
rank only the gradient of its own positions, so the sum over CP of the ranks' parameter
gradients is the gradient of the loss once. Megatron's schedule multiplies the loss by cp and its
DDP averages gradients over the DP x CP group: together exactly that sum (steps.py's LossScale
needs no CP term).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from slime_rl.trainer.batching import MicroBatch
from slime_rl.trainer.mcore import mpu


def local_positions(length: int, cp_size: int, cp_rank: int) -> Tensor:
    """Global positions (long [length / cp]) of CP rank `cp_rank`'s tokens of one sequence."""
    assert length % (2 * cp_size) == 0, (length, cp_size)
    c = length // (2 * cp_size)
    first, second = cp_rank * c, (2 * cp_size - 1 - cp_rank) * c
    return torch.cat([torch.arange(first, first + c), torch.arange(second, second + c)])


def segment_positions(lengths: list[int], cp_size: int, cp_rank: int) -> Tensor:
    """Global (packed-row) positions of a rank's local packed row: per sample, its two chunks."""
    out, start = [], 0
    for n in lengths:
        out.append(local_positions(n, cp_size, cp_rank) + start)
        start += n
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)


def _locate(global_index: Tensor, positions: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """For global positions `global_index` [b, T]: their local index on this rank (0 where not
    held) and a float mask of the ones this rank holds."""
    where = torch.full((total,), -1, dtype=torch.long)
    where[positions] = torch.arange(positions.numel())
    local = where[global_index.cpu()]
    own = (local >= 0).float()
    return local.clamp(min=0), own


def split_micro_batch(mb: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """This CP rank's part of a whole micro-batch (module docstring). The response-side tensors
    (targets, masks, per-token data) stay whole: every CP rank computes the same loss."""
    device = mb.tokens.device
    tokens, pos = mb.tokens.cpu(), mb.position_ids.cpu()
    mult = 2 * cp_size
    psp = mb.packed_seq_params
    if psp is None:
        s = tokens.shape[1]
        padded = -(-s // mult) * mult
        if padded > s:  # right padding: the causal real tokens never see it
            tokens = torch.nn.functional.pad(tokens, (0, padded - s))
            pos = torch.arange(padded).unsqueeze(0).expand(tokens.shape[0], padded).contiguous()
        keep = local_positions(padded, cp_size, cp_rank)
        local_index, own = _locate(mb.logit_index, keep, padded)
        padding = mtp_mask = None
        if mb.padding is not None:  # the CP pad is padding too (out of the MoE load-balancing loss)
            padding = torch.nn.functional.pad(mb.padding.cpu(), (0, padded - s), value=True)[:, keep].to(device)
        if mb.mtp_mask is not None:  # the multi-token-prediction targets: none in the CP pad
            mtp_mask = torch.nn.functional.pad(mb.mtp_mask.cpu(), (0, padded - s))[:, keep].to(device)
        return dataclasses.replace(
            mb, tokens=tokens[:, keep].to(device), position_ids=pos[:, keep].to(device),
            logit_index=local_index.to(device), cp_own=own.to(device), padding=padding, mtp_mask=mtp_mask)
    cu = psp.cu_seqlens_q.cpu().long()
    lengths = (cu[1:] - cu[:-1]).tolist()
    if any(n % mult for n in lengths):
        raise AssertionError(f"packed segments {lengths} must be multiples of 2 * cp = {mult} (packing.py pads)")
    keep = segment_positions(lengths, cp_size, cp_rank)
    local_index, own = _locate(mb.logit_index, keep, int(cu[-1]))
    # packing.py marks each sample's pad to a multiple of 2 * cp (and the row's tail) as padding
    padding = None if mb.padding is None else mb.padding.cpu()[:, keep].to(device)
    mtp_mask = None if mb.mtp_mask is None else mb.mtp_mask.cpu()[:, keep].to(device)
    return dataclasses.replace(
        mb, tokens=tokens[:, keep].to(device), position_ids=pos[:, keep].to(device),
        logit_index=local_index.to(device), cp_own=own.to(device), padding=padding, mtp_mask=mtp_mask)


class _AllGatherSeq(torch.autograd.Function):
    """Concatenate every CP rank's x along dim 0 (rank order); backward: each rank gets the sum
    over ranks of the gradient of its own slice (a reduce-scatter; gloo has none, so there it is
    an all-reduce and a slice)."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        group = ctx.group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        if grad.is_cuda:
            out = torch.empty((grad.shape[0] // size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
            dist.reduce_scatter_tensor(out, grad, group=group)
            return out, None
        total = grad.clone()
        dist.all_reduce(total, group=group)
        return total.chunk(size, dim=0)[rank].contiguous(), None


def all_gather_seq(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    """[n, ...] on each rank -> [cp * n, ...], differentiable (see _AllGatherSeq)."""
    return _AllGatherSeq.apply(x, group)


class _GatherReplicated(torch.autograd.Function):
    """Sum of disjoint per-rank parts (each rank zero off its own positions); backward: the
    gradient of the own positions only, since every rank computes the same loss from the sum."""

    @staticmethod
    def forward(ctx, x: Tensor, own: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.save_for_backward(own)
        out = (x * own).contiguous()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (own,) = ctx.saved_tensors
        return grad * own, None, None


def gather_replicated(x: Tensor, mb: MicroBatch, group: dist.ProcessGroup | None = None) -> Tensor:
    """[b, T] values computed at this rank's positions -> the whole [b, T] on every CP rank
    (identity without CP)."""
    if mb.cp_own is None:
        return x
    if group is None:
        group = mpu.get_context_parallel_group()
    return _GatherReplicated.apply(x, mb.cp_own.to(x.dtype), group)
