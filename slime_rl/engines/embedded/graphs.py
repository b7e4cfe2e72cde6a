"""Decode steps on the static KV cache (slots.py), replayed from CUDA graphs on CUDA.

An eager decode step of an HF model launches a few kernels per layer from Python; for a 1.5B model
that takes ~60 ms per step while the weights are read in under 1 ms. SGLang captures the decode
step in CUDA graphs, one per padded batch size, and replays them. Here the step is the HF forward
itself on the static cache, so its shapes depend on two numbers only: the padded batch size `bs`
(a bucket of slots.batch_buckets holding the highest used slot) and `kv_len`, the columns attention
reads (the next power of two >= the longest row + 1, at least `min_kv_len`). A graph is captured
lazily the first time a (bs, kv_len) pair runs and replayed afterwards:

- inputs live in one static buffer [3, max_rows] (ids, positions, write columns); a step copies its
  values in with one host-to-device copy and replays; the graph's logits buffer is read before the
  next replay (the sampler stays outside the graph). With the overlap scheduler the sampler writes
  the next ids into the buffer itself (`set_next_ids`) and a step copies positions and columns only;
- capture: one warm-up forward on a side stream (lazy inits, library handles), then the capture
  itself, in a memory pool shared by all graphs (they never run concurrently). Both run with the
  step's real inputs, so the KV writes they make are the ones the step makes anyway;
- graphs are dropped when the cache reallocates (capacity growth: their buffer addresses are
  stale); weight updates copy into the parameters in place, so graphs stay valid across them;
- a colocated release/resume keeps them: the weights and the KV cache are each one storage freed
  and re-allocated at the same size (memory.py, slots.py), and the first step after a release
  compares every address the graphs baked in (`addresses()`) with those at capture, dropping the
  graphs only if one moved (stats graphs_kept_after_release / graphs_dropped_moved);
- a batch above `graph_max_bs` (SGLang's --cuda-graph-max-bs-decode) runs the same static forward
  eagerly, as does every step on CPU; if a capture fails, graphs are switched off with a warning;
- --enable-torch-compile: steps of padded batches up to --torch-compile-max-bs run (and are
  captured) with the layers' RMSNorm, MLP and RoPE compiled by torch.compile (compiled.py).
"""

from __future__ import annotations

import contextlib
import logging

import torch

from slime_rl.engines.embedded.attention import slot_decode_attention, uses_flash_decode
from slime_rl.engines.embedded.batch import Row
from slime_rl.engines.embedded.sampling import device_tensor
from slime_rl.engines.embedded.slots import SlotBatch, SlotCache, batch_buckets, slot_inputs, slot_positions

logger = logging.getLogger(__name__)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


class StaticDecoder:
    """Owns the static cache, its running batch (`batch`) and the captured graphs."""

    def __init__(self, model: torch.nn.Module, cache_kw: str, pad_id: int, max_rows: int, use_graphs: bool,
                 graph_max_bs: int | None = None, capacity: int = 1024, min_kv_len: int = 256,
                 compile_max_bs: int = 0) -> None:
        self.model, self.cache_kw, self.pad_id = model, cache_kw, pad_id
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.buckets = batch_buckets(max_rows)
        self.min_kv_len = next_pow2(min_kv_len)
        # time-major when the decode attention reads the slots as flash's packed rows (attention.py)
        self.cache = SlotCache(max_rows, next_pow2(max(capacity, self.min_kv_len)), time_major=uses_flash_decode(model))
        self.batch = SlotBatch(self.cache, self.buckets)
        # eager attention adds a float mask; sdpa takes a boolean one (True = attend)
        self.float_mask = (model.config.get_text_config()._attn_implementation or "eager") == "eager"
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.graph_max_bs = graph_max_bs or max_rows
        # SGLang's --enable-torch-compile / --torch-compile-max-bs: steps of at most this padded batch
        # run with compiled.py's pieces (0: never); see `_run`
        self.compile_max_bs = compile_max_bs
        self._compiled = None
        self._sampler = None  # compiled_sampler's, made on first use
        self.inputs = torch.zeros((3, max_rows), dtype=torch.long, device=self.device)
        self.batch.ids = self.inputs[0]
        self._order: torch.Tensor | None = None  # the last step's slots in row order; None: slots 0..n-1
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._generation = self.cache.generation
        self._pool = None
        self._capture_stream: torch.cuda.Stream | None = None
        self._check_addresses = False  # set by a release: verify the graphs before the next replay
        self._graph_addresses: tuple = ()  # `addresses()` when the current graphs were captured
        self.stats = {"graph_captures": 0, "graph_replays": 0, "static_eager_steps": 0, "slot_moves": 0,
                      "graphs_kept_after_release": 0, "graphs_dropped_moved": 0, "compiled_forwards": 0}

    def release(self) -> None:
        """Free the KV buffers (colocated mode's /release_memory_occupation; the engine is idle then)
        and keep the graphs: the cache's storage comes back, zeroed, with the next prefill
        (slots.SlotCache.restore), the weights' with the resume (memory.py). Both are single
        storages re-allocated at their old size, which usually returns their old addresses; the
        first step after this checks that every address the graphs baked in is unchanged, and drops
        the graphs (captured again lazily) if one moved."""
        self.batch.clear()
        self.cache.release()
        self._check_addresses = True

    def addresses(self) -> tuple:
        """What a captured graph reads and writes by address: every parameter and buffer of the model,
        the KV buffers and the static input buffer (the logits live in the graphs' own pool)."""
        return (tuple(t.data_ptr() for t in self.model.parameters()),
                tuple(t.data_ptr() for t in self.model.buffers()),
                tuple(t.data_ptr() for layer in self.cache.layers for t in (layer.keys, layer.values)),
                self.inputs.data_ptr())

    def _verify_graphs(self) -> None:
        self._check_addresses = False
        if not self.graphs:
            return
        if self.addresses() == self._graph_addresses:
            self.stats["graphs_kept_after_release"] += len(self.graphs)
        else:
            logger.info("embedded engine: memory moved across a release; capturing the decode step again")
            self.stats["graphs_dropped_moved"] += len(self.graphs)
            self._drop_graphs()

    def _drop_graphs(self) -> None:
        """Drop every graph and, with them, their private memory pool: a pool whose graphs are all gone
        is freed by the allocator, and capturing into its stale handle again fails an internal assert
        of torch's CUDACachingAllocator (`use_count > 0`, seen on the H200): the next capture takes a
        new pool."""
        self.graphs.clear()
        self._pool = None

    def step(self, rows: list[Row], ids_on_device: bool = False) -> torch.Tensor:
        """Next-token logits [len(rows), V] (in the order of `rows`) after feeding every row's pending
        token: from the rows (`row.pending`), or, `ids_on_device`, the ids `set_next_ids` left in the
        input buffer (the overlap scheduler: the host has not read them yet). Call with the model lock
        held, under no_grad."""
        # the scheduler thread's current device is cuda:0 whatever the model's (--device cuda:1):
        # capture and replay use the current device's streams, so make it the model's
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            return self._step(rows, ids_on_device)

    def set_next_ids(self, tokens: torch.Tensor) -> None:
        """Write the tokens just sampled for the last step's rows (row order) into their slots' input
        ids, device to device: the next step reads them there (`step(..., ids_on_device=True)`)."""
        if self._order is None:
            self.inputs[0, :len(tokens)].copy_(tokens)
        else:
            self.inputs[0].index_copy_(0, self._order, tokens)

    def must_grow(self, rows: list[Row]) -> bool:
        """Whether the next step of `rows` reallocates the cache (and drops the graphs)."""
        return max(r.next_pos for r in rows) + 1 > self.cache.capacity

    def _step(self, rows: list[Row], ids_on_device: bool) -> torch.Tensor:
        bs = self.batch.padded_size()
        need = max(r.next_pos for r in rows) + 1
        self.cache.ensure_capacity(need)
        kv_len = max(self.min_kv_len, next_pow2(need))
        # pinned, asynchronous: no host synchronization here (the host waits only for a step's sampled
        # tokens: sampling.HostCopy, one step later with the overlap scheduler)
        if ids_on_device:  # positions and write columns only; the ids are where the sampler put them
            pos = slot_positions(rows, bs)
            self.inputs[1:, :bs].copy_(device_tensor([pos, pos], torch.long, self.device))
        else:
            self.inputs[:, :bs].copy_(device_tensor(slot_inputs(rows, bs, self.pad_id), torch.long, self.device))
        if self.cache.generation != self._generation:
            self._drop_graphs()
            self._generation = self.cache.generation
        if self._check_addresses:
            self._verify_graphs()
        logits = None
        if self.use_graphs and bs <= self.graph_max_bs:
            entry = self.graphs.get((bs, kv_len)) or self._capture(bs, kv_len)
            if entry is not None:
                entry[0].replay()
                self.stats["graph_replays"] += 1
                logits = entry[1]
        if logits is None:
            logits = self._run(bs, kv_len)
            self.stats["static_eager_steps"] += 1
        self.stats["slot_moves"] = self.batch.moves
        slots = [r.slot for r in rows]
        if slots == list(range(len(rows))):  # rows in slot order (no compaction moved one): no gather
            self._order = None
            return logits[:len(rows)]  # a view of the graph's output; the sampler reads it before the next step
        self._order = device_tensor(slots, torch.long, self.device)
        return logits.index_select(0, self._order)

    def compiled_sampler(self, bs: int):
        """sampling.gumbel_pick compiled (compiled.CompiledSampler) when --enable-torch-compile covers
        a decode batch of `bs` rows, else None (the engine samples eagerly)."""
        if not (self.compile_max_bs and bs <= self.compile_max_bs):
            return None
        if self._sampler is None:
            from slime_rl.engines.embedded.compiled import CompiledSampler

            self._sampler = CompiledSampler()
        return self._sampler

    def _run(self, bs: int, kv_len: int) -> torch.Tensor:
        """`_forward`, with the compiled pieces (compiled.py) when --enable-torch-compile covers `bs`.
        The first step of a batch size compiles (once for all sizes but 1: dynamic shapes); under
        CUDA graphs that is `_capture`'s warm-up run, before the capture. If compiling fails, the
        engine warns and runs uncompiled from then on."""
        if not (self.compile_max_bs and bs <= self.compile_max_bs):
            return self._forward(bs, kv_len)
        if self._compiled is None:
            from slime_rl.engines.embedded.compiled import CompiledPieces

            self._compiled = CompiledPieces(self.model)
            logger.info("embedded engine: torch.compile pieces: %s", ", ".join(self._compiled.installed))
        self._compiled.active = True
        try:
            out = self._forward(bs, kv_len)
            self.stats["compiled_forwards"] += 1
            return out
        except Exception as e:  # noqa: BLE001 - any compiler failure: fall back, say why
            if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise
            logger.warning("embedded engine: torch.compile of the decode step failed (bs %d, kv_len %d); "
                           "decoding without it from now on: %s", bs, kv_len, e)
            self.compile_max_bs = 0
        finally:
            self._compiled.active = False
        return self._forward(bs, kv_len)

    def _forward(self, bs: int, kv_len: int) -> torch.Tensor:
        """The step on the first bs slots, reading the static input buffer (what a graph captures)."""
        ids = self.inputs[0, :bs].unsqueeze(1)
        pos = self.inputs[1, :bs].unsqueeze(1)
        cols = self.inputs[2, :bs]
        self.cache.cols, self.cache.kv_len = cols, kv_len
        # a row sees its columns 0..cols[i] (its cached tokens and the one written now)
        visible = (torch.arange(kv_len, device=self.device)[None, :] <= cols[:, None])[:, None, None, :]
        if self.float_mask:
            mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
            mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)
        else:
            mask = visible
        # a 4-D tensor, not a {"layer type": mask} dict: every family's mask builder
        # (masking_utils.create_causal_mask) returns a 4-D mask as it is, while only Qwen2/Qwen3's
        # forward accepts the dict (Llama hands it to create_causal_mask, which calls .ndim on it)
        with slot_decode_attention(self.model):  # grouped-query decode without copying K/V (attention.py)
            out = self.model(input_ids=ids, position_ids=pos, attention_mask=mask,
                             use_cache=True, **{self.cache_kw: self.cache})
        return out.logits[:, -1, :]

    def _capture(self, bs: int, kv_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
                self._capture_stream = torch.cuda.Stream(self.device)
            main = torch.cuda.current_stream(self.device)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                self._run(bs, kv_len)  # compiles here first under --enable-torch-compile
            main.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: HTTP threads may touch CUDA (e.g. reading a weight) while we capture
            with torch.cuda.graph(graph, pool=self._pool, stream=self._capture_stream,
                                  capture_error_mode="thread_local"):
                logits = self._run(bs, kv_len)
        except RuntimeError as e:
            logger.warning("embedded engine: capturing the decode step (bs %d, kv_len %d) failed, decoding "
                           "without CUDA graphs from now on: %s", bs, kv_len, e)
            self.use_graphs = False
            self._drop_graphs()
            return None
        if not self.graphs:
            self._graph_addresses = self.addresses()
        self.graphs[(bs, kv_len)] = (graph, logits)
        self.stats["graph_captures"] += 1
        logger.info("embedded engine: captured the decode step for bs %d, kv_len %d", bs, kv_len)
        return graph, logits

    def describe(self) -> str:
        graphs = f"CUDA graphs up to bs {self.graph_max_bs}" if self.use_graphs else "no CUDA graphs"
        compiled = f", torch.compile up to bs {self.compile_max_bs}" if self.compile_max_bs else ""
        return (f"static KV cache: {self.cache.slots} slots x {self.cache.capacity} columns (grows), "
                f"batch buckets {self.buckets}, {graphs}{compiled}")

