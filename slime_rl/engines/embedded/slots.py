"""The static KV cache of the embedded engine: one preallocated row ("slot") per running request.

Every layer keeps keys and values of shape [slots, kv_heads, capacity, head_dim] (as views; with
`time_major` the memory under them is laid out [slots, capacity, kv_heads, head_dim], the layout of a
varlen flash attention's packed keys, which the deterministic decode attention reads: attention.py's
`flash_slot_decode`). A request owns one
slot from its admission to its end; its cached tokens sit at columns 0..n-1 of that slot and the token
it feeds next is written at column n. So a decode step has fixed shapes whatever the requests'
lengths: ids/positions/write columns [bs] for the first `bs` slots, keys/values read over the first
`kv_len` columns, and a boolean mask (column <= the row's write column). That is what lets the step
be captured once in a CUDA graph per (bs, kv_len) and replayed (graphs.py).

Rows join by copying their prefill KV (a left-padded DynamicCache, as the dynamic path builds it)
into free slots and leave by freeing their slot: nothing is concatenated or re-indexed. When rows
leave, the batch is compacted (rows in the highest slots move down) only if that lets the step run
with a smaller padded batch size. The capacity doubles when a row needs a column past it; that
reallocates the buffers, so the cache's `generation` changes and captured graphs are dropped.

Only full-attention, text-only models whose positions equal the token index use it (`unsupported`);
the others (Qwen2.5-VL's mRoPE positions, sliding-window or linear-attention layers, dynamic RoPE)
stay on the dynamic path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache, DynamicLayer

from slime_rl.engines.embedded.batch import Row
from slime_rl.engines.embedded.sampling import device_tensor


def unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot use the static cache, or None when it can."""
    cfg = model.config
    if getattr(cfg, "vision_config", None) is not None:
        return "vision-language model (mRoPE positions differ from the token index)"
    text = cfg.get_text_config()
    kinds = set(getattr(text, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"layer types {sorted(kinds)} (only full attention)"
    attn = getattr(text, "_attn_implementation", None) or "eager"
    if attn not in ("sdpa", "eager"):
        return f"attention implementation {attn!r} (it ignores the 4-D slot mask; sdpa or eager only)"
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    ropes = rope.values() if rope and all(isinstance(v, dict) for v in rope.values()) else [rope]
    for r in ropes:
        kind = (r or {}).get("rope_type", (r or {}).get("type", "default"))
        if kind in ("dynamic", "longrope"):  # frequencies depend on the current length (host-side)
            return f"RoPE type {kind!r}"
    return None


class SlotLayer(CacheLayerMixin):
    """One layer's preallocated keys and values; SlotCache.update writes them in place."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass  # allocated up front by SlotCache.allocate

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        raise RuntimeError("SlotLayer is written through SlotCache.update")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return 0  # rows differ; the engine always passes position_ids and the mask itself

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """transformers' Cache interface over per-slot rows. Before a forward the caller sets `cols`
    (long [bs]: the column each of the first bs slots writes) and `kv_len` (columns attention reads)."""

    def __init__(self, slots: int, capacity: int, time_major: bool = False) -> None:
        super().__init__(layers=[])
        self.slots, self.capacity = slots, capacity
        self.time_major = time_major
        self.cols: torch.Tensor | None = None
        self.kv_len = 0
        self.arena: torch.UntypedStorage | None = None  # the storage every layer's keys/values view
        self._shapes: list = []
        self._arena_bytes = 0
        self.generation = 0  # bumped whenever the buffers are reallocated

    def allocate(self, like: DynamicCache) -> None:
        """Zeroed buffers shaped after a prefill cache (layer count, heads, head dims, dtype, device)."""
        self._shapes = [((k.shape[1], k.shape[3]), (v.shape[1], v.shape[3]), k.dtype, k.device)
                        for k, v in ((layer.keys, layer.values) for layer in like.layers)]
        self.layers = [SlotLayer(k, v) for k, v in self._buffers(self.capacity)]
        self.generation += 1

    def _buffers(self, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Every layer's keys and values [slots, heads, capacity, head_dim] as views of ONE zeroed
        storage (`self.arena`): a release frees it and a resume re-allocates it in one piece, so its
        address, which the CUDA graphs bake in, usually comes back the same (memory.py). Time-major:
        each view is the [slots, capacity, heads, head_dim] memory seen with dims 1 and 2 swapped."""
        views, total = [], 0
        for (kh, kd), (vh, vd), dtype, _ in self._shapes:
            for heads, dim in ((kh, kd), (vh, vd)):
                shape = (self.slots, capacity, heads, dim) if self.time_major else (self.slots, heads, capacity, dim)
                views.append((total, shape, dtype))
                total += self.slots * heads * capacity * dim * dtype.itemsize
                total = -(-total // 256) * 256
        device = self._shapes[0][3]
        self.arena, self._arena_bytes = torch.UntypedStorage(total, device=device), total
        out = [torch.empty(0, dtype=dtype, device=device).set_(self.arena, off // dtype.itemsize, shape)
               for off, shape, dtype in views]
        if self.time_major:
            out = [t.transpose(1, 2) for t in out]
        for t in out:
            t.zero_()
        return list(zip(out[0::2], out[1::2], strict=True))

    @property
    def released(self) -> bool:
        return bool(self.layers) and self.arena.nbytes() == 0

    def release(self) -> None:
        """Free the buffers' memory; the layers keep their views (and shapes) for `restore`."""
        if self.layers:
            self.arena.resize_(0)

    def restore(self) -> None:
        """Re-allocate the released buffers (same size, one piece) and zero them: a free slot or an
        unwritten column is masked, but a masked NaN left by old memory would still poison the
        softmax's weighted sum."""
        if not self.released:
            return
        self.arena.resize_(self._arena_bytes)
        for layer in self.layers:
            layer.keys.zero_()
            layer.values.zero_()

    def ensure_capacity(self, columns: int) -> None:
        """Grow (doubling, keeping the contents) until `columns` columns fit."""
        if columns <= self.capacity:
            return
        cap = self.capacity
        while cap < columns:
            cap *= 2
        for layer, (k, v) in zip(self.layers, self._buffers(cap), strict=True):
            k[:, :, :self.capacity] = layer.keys
            v[:, :, :self.capacity] = layer.values
            layer.keys, layer.values = k, v
        self.capacity = cap
        self.generation += 1

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        # called by every attention layer: write this step's key/value of row i at column cols[i]
        # (scatter_, no host sync: capturable), then hand attention the first kv_len columns.
        layer = self.layers[layer_idx]
        bs, heads, q, _ = key_states.shape
        assert q == 1, "the static cache only runs decode steps (one token per row)"
        keys, values = layer.keys[:bs], layer.values[:bs]
        col = self.cols.view(bs, 1, 1, 1)
        keys.scatter_(2, col.expand(bs, heads, 1, key_states.shape[3]), key_states)
        values.scatter_(2, col.expand(bs, heads, 1, value_states.shape[3]), value_states)
        return keys[:, :, :self.kv_len], values[:, :, :self.kv_len]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def copy_rows(self, src: list[DynamicLayer] | None, src_rows: list[int], src_starts: list[int],
                  dst_slots: list[int], lengths: list[int]) -> None:
        """keys/values[dst_slots[i], :, 0:lengths[i]] = source row src_rows[i], columns
        src_starts[i]..+lengths[i], for every layer; `src` None copies between our own slots."""
        if not dst_slots:
            return
        # one (source row, source column, slot, column) index per copied token, built on the host
        n = torch.tensor(lengths)
        offset = torch.arange(int(n.sum())) - torch.repeat_interleave(n.cumsum(0) - n, n)  # 0..n_i-1 per row
        rows_t, scols_t, dslots_t = (torch.repeat_interleave(torch.tensor(x), n)
                                     for x in (src_rows, src_starts, dst_slots))
        dev = self.layers[0].keys.device
        rows_t, scols_t, dslots_t, dcols_t = (t.to(dev) for t in (rows_t, scols_t + offset, dslots_t, offset))
        for i, mine in enumerate(self.layers):
            theirs = mine if src is None else src[i]
            # both sides index dims 0 and 2: [N, heads, head_dim]; the right side is gathered (a copy)
            # before the write, so moving between our own slots cannot read what it overwrites
            mine.keys[dslots_t, :, dcols_t] = theirs.keys[rows_t, :, scols_t]
            mine.values[dslots_t, :, dcols_t] = theirs.values[rows_t, :, scols_t]


def batch_buckets(max_rows: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, every multiple of 8 below 64, of 32 below 256, of 64 above, and
    max_rows itself. A decode step reads the weights once whatever its batch, so padding a large
    batch costs little, while every bucket is one more CUDA graph to capture (and hold): 21 buckets
    for 512 rows instead of 67."""
    sizes = [b for b in (1, 2, 4) if b < max_rows] + list(range(8, min(max_rows, 64), 8))
    sizes += list(range(64, min(max_rows, 256), 32)) + list(range(256, max_rows, 64))
    return sizes + [max_rows]


def bucket_of(buckets: list[int], n: int) -> int:
    return next(b for b in buckets if b >= n)


@dataclass
class SlotBatch:
    """The running rows of the static path (the interface of batch.RunningBatch: rows, keep, merge,
    clear), each holding `row.slot`. Free slots are handed out lowest first."""

    cache: SlotCache
    buckets: list[int]
    rows: list[Row] = field(default_factory=list)
    moves: int = 0  # rows moved to a lower slot by compaction (for tests and stats)
    # the decoder's input-id row [slots] (graphs.StaticDecoder.inputs[0]): a row that moves takes its
    # next input id along (the overlap scheduler's sampler writes it there before the host reads it)
    ids: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def clear(self) -> None:
        self.rows = []

    def padded_size(self) -> int:
        """The batch size a decode step runs with: the bucket holding the highest used slot."""
        return bucket_of(self.buckets, max(r.slot for r in self.rows) + 1)

    def keep(self, keep_idx: list[int]) -> None:
        """Keep only rows `keep_idx` (in order); the others' slots become free."""
        if len(keep_idx) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep_idx]
        if self.rows and self.padded_size() > bucket_of(self.buckets, len(self.rows)):
            self._compact()

    def _compact(self) -> None:
        n = len(self.rows)
        used = {r.slot for r in self.rows}
        free = iter(sorted(set(range(n)) - used))
        movers = sorted((r for r in self.rows if r.slot >= n), key=lambda r: r.slot)
        dst = [next(free) for _ in movers]
        self.cache.copy_rows(None, [r.slot for r in movers], [0] * len(movers), dst, [r.next_pos for r in movers])
        if self.ids is not None:
            src_t, dst_t = (device_tensor(x, torch.long, self.ids.device) for x in ([r.slot for r in movers], dst))
            self.ids[dst_t] = self.ids[src_t]
        for r, d in zip(movers, dst, strict=True):
            r.slot = d
        self.moves += len(movers)

    def merge(self, rows: list[Row], mask: torch.Tensor, cache: DynamicCache) -> None:
        """Give freshly prefilled rows (left-padded mask [b, T] and their DynamicCache) free slots and
        copy their KV there."""
        lengths = mask.sum(dim=1).tolist()
        for r, n in zip(rows, lengths, strict=True):
            # the slot's columns are token indices; a row's position must be the same (text models)
            if r.next_pos != n:
                raise RuntimeError(f"static KV cache: row position {r.next_pos} != cached tokens {n}")
        if not self.cache.layers:
            self.cache.allocate(cache)
        elif self.cache.released:  # the first prefill after a colocated release
            if self.cache.arena.device.type == "cuda":
                # what the weight sync left cached goes back first, so the same-size re-allocation
                # can land where the cache was (the graphs hold that address)
                torch.cuda.empty_cache()
            self.cache.restore()
        self.cache.ensure_capacity(max(lengths) + 1)  # +1: the pending token's column
        used = {r.slot for r in self.rows}
        free = [s for s in range(self.cache.slots) if s not in used][:len(rows)]
        if len(free) < len(rows):
            raise RuntimeError(f"static KV cache: {len(rows)} new rows but {len(free)} free slots")
        width = mask.shape[1]
        self.cache.copy_rows(cache.layers, list(range(len(rows))), [width - n for n in lengths], free, lengths)
        for r, s in zip(rows, free, strict=True):
            r.slot = s
        self.rows.extend(rows)


def slot_positions(rows: list[Row], bs: int) -> list[int]:
    """Positions of the first bs slots (= their write columns); free slots 0. What a step needs from
    the host when its input ids are already on the device (the overlap scheduler)."""
    pos = [0] * bs
    for r in rows:
        pos[r.slot] = r.next_pos
    return pos


def slot_inputs(rows: list[Row], bs: int, pad_id: int) -> list[list[int]]:
    """[ids, positions, write columns] of the first bs slots; free slots feed `pad_id` at position 0
    and write column 0 (a free slot's contents are never read before a prefill overwrites them)."""
    ids, pos = [pad_id] * bs, [0] * bs
    for r in rows:
        ids[r.slot], pos[r.slot] = r.pending, r.next_pos
    return [ids, pos, list(pos)]  # column = position for the models that use this cache
