"""How a rank's samples become micro-batches, and how per-sample results come back from them.

Two knobs (and context parallelism, which splits every built micro-batch over the CP group:
context_parallel.py): the layout (packed THD rows, default, or right-padded [b, s]) and the grouping
(micro_batch_size samples in order, or token-budget bins when use_dynamic_batch_size: first-fit
decreasing up to max_tokens_per_gpu prompt+response tokens). Training additionally needs the same
number of micro-batches on every DP rank (one schedule run per rank, matched gradient
all-reduces in finalize_model_grads): the count is all-reduced (max) and short ranks split their
heaviest micro-batches, or, with only single-sample micro-batches left, run zero-weight dummies.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from slime_rl.trainer.batching import MicroBatch, build_micro_batch, chunks, unpad
from slime_rl.trainer.context_parallel import split_micro_batch
from slime_rl.trainer.packing import build_packed_micro_batch, split_to_count, token_budget_bins
from slime_rl.trainer.parallel import broadcast_from_last_stage
from slime_rl.trainer.routing_replay import BATCH_KEY, micro_batch_routing


@dataclass(frozen=True)
class MicroBatching:
    device: torch.device
    micro_batch_size: int
    pack_sequences: bool = True
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None
    pad_multiple: int = 1  # packed rows are padded to this (the TP size under sequence parallel)
    cp_size: int = 1  # context parallel: every micro-batch is split over the CP group
    cp_rank: int = 0
    vision: Any = None  # vision.VisionBatching of a vision-language model (mRoPE, image inputs)
    # MoE: (num_layers, top_k, num_experts, sp_size, sp_rank) to carry the engines' routing of a batch
    # that has it (routing_replay.py); None for dense models
    routing: tuple[int, int, int, int, int] | None = None
    # multi-token-prediction training: each micro-batch carries its mtp_mask (token positions of the trained
    # response tokens, set before the CP split)
    mtp: bool = False

    def __post_init__(self) -> None:
        if self.use_dynamic_batch_size and not self.max_tokens_per_gpu:
            raise ValueError("--use-dynamic-batch-size needs --max-tokens-per-gpu")
        if self.pad_multiple > 1 and not self.pack_sequences:
            raise ValueError("--sequence-parallel needs packed sequences (pack_sequences=True): the "
                             "sequence is split over TP ranks, so its length must be a multiple of TP")
        if self.vision is not None and self.cp_size > 1:
            raise ValueError("--context-parallel-size > 1 is not supported for vision-language models")

    def groups(self, batch: dict, ids: list[int]) -> list[list[int]]:
        """Sample ids of each micro-batch (positions in `batch`)."""
        if not self.use_dynamic_batch_size:
            return chunks(ids, self.micro_batch_size)
        lengths = [len(batch["tokens"][i]) for i in ids]
        return [[ids[k] for k in g] for g in token_budget_bins(lengths, self.max_tokens_per_gpu)]

    def equalized_groups(self, batch: dict, ids: list[int], dp_group: dist.ProcessGroup | None,
                         device: torch.device) -> list[list[int]]:
        """`groups`, split (or padded with empty groups) to the max count over the DP group."""
        groups = self.groups(batch, ids)
        if dp_group is None or dist.get_world_size(dp_group) == 1:
            return groups
        n = torch.tensor([len(groups)], dtype=torch.int64, device=device)
        dist.all_reduce(n, op=dist.ReduceOp.MAX, group=dp_group)
        lengths = [len(t) for t in batch["tokens"]]  # indexed by sample id, as the groups are
        return split_to_count(groups, lengths, int(n.item()))

    def build(self, batch: dict, ids: list[int], per_token: dict | None = None) -> MicroBatch:
        """One micro-batch; an empty `ids` gives a dummy (first sample, all weights zero)."""
        dummy = not ids
        use = [0] if dummy else ids
        if self.pack_sequences and self.cp_size > 1:
            # every sample splits into 2 * cp chunks; each rank's share of the row (total / cp)
            # must still be a multiple of the SP size
            pad = math.lcm(2 * self.cp_size, self.cp_size * self.pad_multiple)
            mb = build_packed_micro_batch(batch, use, self.device, per_token, pad, 2 * self.cp_size)
        elif self.pack_sequences:
            mb = build_packed_micro_batch(batch, use, self.device, per_token, self.pad_multiple)
        else:
            mb = build_micro_batch(batch, use, self.device, per_token)
        if self.vision is not None:
            self.vision.attach(mb, batch, use)
        if self.routing is not None and BATCH_KEY in batch:
            if self.cp_size > 1:
                raise ValueError("routing replay under context parallelism is not supported")
            layers, topk, experts, sp, sp_rank = self.routing
            starts = mb.packed_seq_params.cu_seqlens_q[:len(use)].tolist() if mb.packed_seq_params is not None \
                else None
            ids, mask = micro_batch_routing(batch, use, layers, topk, experts, mb.num_tokens, starts, sp, sp_rank)
            mb.routing = (ids.to(self.device), (mask & (not dummy)).to(self.device))
        if self.mtp:
            mb.mtp_mask = token_loss_mask(mb)
        if self.cp_size > 1:
            mb = split_micro_batch(mb, self.cp_size, self.cp_rank)
        if dummy:  # runs forward/backward like the others but adds exactly 0 to loss and grads
            mb.sample_ids = []
            mb.loss_mask.zero_()
            if mb.mtp_mask is not None:
                mb.mtp_mask.zero_()
            for v in mb.per_token.values():
                v.zero_()
        return mb

    def micro_batches(self, batch: dict, groups: list[list[int]], per_token: dict | None = None) -> list[MicroBatch]:
        return [self.build(batch, g, per_token) for g in groups]


def token_loss_mask(mb: MicroBatch) -> torch.Tensor:
    """[b, s] (packed [1, t]) float: the loss mask at the positions of the response tokens (response token j of
    row i sits one after the logits that predict it, mb.logit_index[i, j] + 1), 0 elsewhere."""
    mask = torch.zeros(mb.tokens.shape, dtype=torch.float32, device=mb.tokens.device)
    real = mb.valid > 0
    rows = torch.arange(mb.logit_index.shape[0], device=mb.tokens.device).unsqueeze(1).expand_as(mb.logit_index)
    if mb.packed_seq_params is not None:  # logit_index points into the one packed row
        rows = torch.zeros_like(rows)
    mask[rows[real], mb.logit_index[real] + 1] = mb.loss_mask[real].float()
    return mask


def collect_per_sample(store: list[dict], key: str, n: int, response_lengths: Sequence[int],
                       device: torch.device) -> list[list[float]]:
    """Per-sample lists from the schedule's forward-data store. The store is filled on the last
    pipeline stage only; its values are flattened in sample order and broadcast over the PP group,
    so every rank returns the same lists."""
    rows: list[list[float] | None] = [None] * n
    for out in store:
        mb = out["mb"]
        for i, row in zip(mb.sample_ids, unpad(out[key], mb), strict=True):
            rows[i] = row
    flat = torch.zeros(sum(int(r) for r in response_lengths), dtype=torch.float32, device=device)
    if store:  # last stage: every sample was in some micro-batch
        flat.copy_(torch.tensor([x for r in rows for x in r], dtype=torch.float32))
    broadcast_from_last_stage(flat)
    return [part.tolist() for part in torch.split(flat.cpu(), [int(r) for r in response_lengths])]


def rows_by_sample(store: list[dict], key: str, response_lengths: Sequence[int]) -> list[list[float]]:
    """Per-sample lists of `key` ([b, T], row k belonging to sample store[m]["sample_ids"][k]) from the
    schedule's store on the last pipeline stage, each cut to the sample's response length (the
    right padding of the [b, T] rows goes); no communication, unlike `collect_per_sample`. Dummy
    micro-batches (no sample ids: micro-batch count equalized over DP) are skipped. Every sample of
    the batch (`response_lengths` indexed like it) must be in some micro-batch."""
    rows: list[list[float] | None] = [None] * len(response_lengths)
    for out in store:
        ids = out["sample_ids"]
        if not ids:
            continue
        values = out[key].detach().float().cpu().tolist()
        for i, row in zip(ids, values, strict=True):
            rows[i] = row[: int(response_lengths[i])]
    missing = [i for i, r in enumerate(rows) if r is None]
    if missing:
        raise RuntimeError(f"no {key!r} rows for samples {missing[:5]} in the schedule's store")
    return rows
