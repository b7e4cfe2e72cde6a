"""Padding-free (THD) micro-batches and token-budget batching: pure functions, no communication.

Packed layout: the samples of a micro-batch are concatenated into one row, tokens [1, t] with
t = sum L_i (+ pad to a multiple of `pad_multiple`, e.g. the TP size under sequence parallelism),
and `PackedSeqParams(qkv_format="thd", cu_seqlens=[0, L_0, L_0 + L_1, ..., t])` tells attention
and RoPE where samples start, so no token attends across a boundary and positions restart at 0.
The padding tail, when present, is one more segment: it attends only to itself and is never read.
Response-side tensors keep the padded layout of batching.py ([b, T], T = max R_i); `logit_index`
holds positions in the packed row, so the loss code is the same for both layouts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slime_rl.trainer.batching import MicroBatch, build_micro_batch
from slime_rl.trainer.mcore import PackedSeqParams


def build_packed_micro_batch(batch: dict, sample_ids: list[int], device: torch.device,
                             per_token: dict[str, list[Sequence[float]]] | None = None,
                             pad_multiple: int = 1, segment_multiple: int = 1) -> MicroBatch:
    """The samples `sample_ids` of `batch` packed into one THD row (see the module docstring).
    `segment_multiple`: each sample's segment is right-padded to a multiple of it (2 * cp under
    context parallelism, which splits every sample into 2 * cp chunks; causal attention keeps the
    padding after a sample's last token out of its real tokens)."""
    # the padded builder gives the response-side tensors ([b, T] targets, masks, per-token data);
    # only tokens, positions and logit_index change with the layout
    padded = build_micro_batch(batch, sample_ids, torch.device("cpu"), per_token)
    lengths = [-(-len(batch["tokens"][i]) // segment_multiple) * segment_multiple for i in sample_ids]
    total = sum(lengths)
    padded_total = -(-total // pad_multiple) * pad_multiple
    tokens = torch.zeros(1, padded_total, dtype=torch.long)
    padding = torch.ones(1, padded_total, dtype=torch.bool)
    starts = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    for k, i in enumerate(sample_ids):
        tokens[0, starts[k] : starts[k] + len(batch["tokens"][i])] = torch.tensor(batch["tokens"][i])
        padding[0, starts[k] : starts[k] + len(batch["tokens"][i])] = False
    seg = [*lengths, padded_total - total] if padded_total > total else lengths
    cu = torch.tensor([0, *torch.tensor(seg).cumsum(0).tolist()], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(n) for n in seg]).unsqueeze(0)
    # padded index p of sample k (its row of `padded`) -> packed index cu[k] + p; response padding
    # (valid = 0) points at position 0 so that it never indexes past the pack
    logit_index = torch.where(padded.valid > 0, padded.logit_index + cu[: len(sample_ids)].long().unsqueeze(1), 0)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.to(device), cu_seqlens_kv=cu.to(device),
                          max_seqlen_q=max(seg), max_seqlen_kv=max(seg))
    return MicroBatch(
        sample_ids=padded.sample_ids, tokens=tokens.to(device), position_ids=position_ids.to(device),
        logit_index=logit_index.to(device), targets=padded.targets.to(device),
        valid=padded.valid.to(device), loss_mask=padded.loss_mask.to(device),
        per_token={k: v.to(device) for k, v in padded.per_token.items()}, packed_seq_params=psp,
        padding=padding.to(device))


def token_budget_bins(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """First-fit decreasing: sample indices grouped so each group's total length <= max_tokens.

    A sample longer than the budget gets a group of its own (it cannot be split: its tokens
    attend to each other). Groups come out in the order they were opened (the longest first);
    inside a group, indices are ascending."""
    if max_tokens < 1:
        raise ValueError(f"--max-tokens-per-gpu must be >= 1, got {max_tokens}")
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for b, load in enumerate(loads):
            if load + lengths[i] <= max_tokens:
                bins[b].append(i)
                loads[b] += lengths[i]
                break
        else:
            bins.append([i])
            loads.append(lengths[i])
    return [sorted(b) for b in bins]


def split_to_count(bins: list[list[int]], lengths: Sequence[int], count: int) -> list[list[int]]:
    """Split groups until there are `count` of them (every DP rank must run the same number of
    micro-batches). Each split halves the heaviest group that has >= 2 samples, by first-fit
    decreasing into two. When every group is a single sample and more are still needed, empty
    groups are appended: the caller runs them as zero-weight dummy micro-batches."""
    out = [list(b) for b in bins]
    if len(out) > count:
        raise ValueError(f"cannot reduce {len(out)} micro-batches to {count}")
    while len(out) < count:
        splittable = [b for b in out if len(b) >= 2]
        if not splittable:
            out += [[] for _ in range(count - len(out))]
            break
        heavy = max(splittable, key=lambda b: sum(lengths[i] for i in b))
        half = sum(lengths[i] for i in heavy) // 2
        first: list[int] = []
        for i in sorted(heavy, key=lambda k: -lengths[k]):
            if not first or sum(lengths[k] for k in first) + lengths[i] <= half:
                first.append(i)
        if len(first) == len(heavy):  # never leave a half empty
            first.pop()
        out.remove(heavy)
        out += [sorted(first), sorted(set(heavy) - set(first))]
    return out


def balance_by_tokens(lengths: Sequence[int], parts: int, equal_count: bool = True) -> list[list[int]]:
    """Partition sample indices over `parts` DP ranks so token totals are near equal (greedy
    longest-processing-time: each sample, longest first, goes to the lightest rank). With
    equal_count, every rank gets len(lengths) / parts samples (must divide), so the per-rank
    mini-batch size stays global_batch_size / dp_size. The heaviest rank exceeds the lightest
    by at most one sample's length (without equal_count)."""
    n = len(lengths)
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    if equal_count and n % parts != 0:
        raise ValueError(f"{n} samples do not split evenly over {parts} data-parallel ranks")
    cap = n // parts if equal_count else n
    out: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(range(n), key=lambda k: (-lengths[k], k)):
        r = min((r for r in range(parts) if len(out[r]) < cap), key=lambda r: (loads[r], r))
        out[r].append(i)
        loads[r] += lengths[i]
    return [sorted(p) for p in out]
