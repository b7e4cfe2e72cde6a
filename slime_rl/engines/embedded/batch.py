"""The running batch of the embedded engine: left-padded rows sharing one HF KV cache.

Every row carries one sampled token that is not yet in the cache (`pending`). A decode step feeds
all pending tokens at once ([B, 1]) with an explicit position per row, so rows of different lengths
and rows that joined at different times share one forward. New rows are prefilled on their own
(left-padded, position_ids = cumsum(mask) - 1, so a padded row computes what it would compute
alone) and then merged into the running cache by left-padding the shorter of the two caches along
the sequence axis. Finished rows are dropped with `batch_select_indices` and all-padding columns
on the left are trimmed, so a long-running batch does not keep growing.

Merging needs plain full-attention cache layers (`DynamicLayer`: keys/values [B, H, T, D]); for
other layer kinds (sliding window, linear attention) `can_merge` is False and the engine falls back
to waves: new requests wait until the running batch drains.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


@dataclass
class Row:
    """One request in the running batch (the scheduler owns it; HTTP threads read the result)."""

    req: Any  # request.GenRequest
    next_pos: int = 0  # position id of the pending token
    pending: int = -1  # last sampled token, not yet in the KV cache
    slot: int = -1  # row of the static KV cache it occupies (static path only, see slots.py)


@dataclass
class RunningBatch:
    rows: list[Row] = field(default_factory=list)
    mask: torch.Tensor | None = None  # [B, L] long, 1 = real token in the cache
    cache: DynamicCache | None = None
    # the overlap scheduler's next inputs: the last step's sampled tokens [B] on the device, in row
    # order, before the host has read them (steps.py); None when the rows' `pending` are the inputs
    next_ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def clear(self) -> None:
        self.rows, self.mask, self.cache, self.next_ids = [], None, None, None

    def keep(self, keep_idx: list[int]) -> None:
        """Keep only rows `keep_idx` (in order), then trim left columns that no row uses."""
        if len(keep_idx) == len(self.rows):
            return
        if not keep_idx:
            self.clear()
            return
        idx = torch.tensor(keep_idx, device=self.mask.device)
        self.rows = [self.rows[i] for i in keep_idx]
        self.cache.batch_select_indices(idx)
        self.mask = self.mask[idx]
        if self.next_ids is not None:
            self.next_ids = self.next_ids[idx]
        used = self.mask.any(dim=0).nonzero()
        start = int(used[0]) if len(used) else self.mask.shape[1]
        if start > 0:
            self.mask = self.mask[:, start:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, start:]
                layer.values = layer.values[:, :, start:]

    def merge(self, rows: list[Row], mask: torch.Tensor, cache: DynamicCache) -> None:
        """Append freshly prefilled rows (their own mask [b, l] and cache) to the running batch."""
        self.next_ids = None  # the new rows' first tokens are host-side: the next step builds its ids
        if not self.rows:
            self.rows, self.mask, self.cache = list(rows), mask, cache
            return
        la, lb = self.mask.shape[1], mask.shape[1]
        length = max(la, lb)
        self.mask = torch.cat([_pad_left(self.mask, length), _pad_left(mask, length)], dim=0)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, length), _pad_left(theirs.keys, length)], dim=0)
            mine.values = torch.cat([_pad_left(mine.values, length), _pad_left(theirs.values, length)], dim=0)
        self.rows.extend(rows)


def can_merge(cache: DynamicCache) -> bool:
    return all(type(layer) is DynamicLayer for layer in cache.layers)


def _pad_left(t: torch.Tensor, length: int) -> torch.Tensor:
    """Left-pad along the sequence axis: dim 1 of a mask [B, L], dim 2 of keys/values [B, H, L, D]."""
    dim = 1 if t.dim() == 2 else 2
    missing = length - t.shape[dim]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def left_pad(seqs: list[list[int]], pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor,
                                                                            torch.Tensor]:
    """Left-padded ids [B, T], mask [B, T] and position_ids [B, T] (cumsum(mask) - 1, pads at 0)."""
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, T - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device)
