"""Colocated weight sync (`--colocate`): each GPU holds one trainer rank and one engine TP rank, so the
weights are handed over IN PLACE: the trainer fills a bucket buffer and sends the engine handles to
it (CUDA IPC on GPU, a named /dev/shm file on CPU; engines/tensor_ipc.py) through SGLang's
/update_weights_from_tensor; the engine copies from the trainer's memory straight into its
parameters. No bytes over a socket.

Engine e of N devices (`--rollout-num-gpus-per-engine`) runs beside trainer ranks e*N .. e*N+N-1
(orchestration/placement.py), its TP rank i on trainer rank e*N+i's GPU. Per bucket, as slime does
it (slime/backends/megatron_utils/update_weight/update_weight_from_tensor.py):
1. every trainer rank holds the bucket's full tensors in one of its two bucket buffers: the TP
   gathers are collective and leave every rank of a stage with the stage's full tensors; with PP > 1
   a stage's ranks fill the buffer and broadcast it over their PP group (`PipelineStages`), so every
   rank gets every stage's buckets, stage 0's first;
2. each rank serializes a handle to its own buffer (a device both it and the engine's TP rank beside
   it see);
3. the N handles of one engine are gathered (gloo, `EngineShare`) to the rank beside its TP rank 0,
   which posts ONE /update_weights_from_tensor whose `serialized_named_tensors[i]` is the handle made
   on TP rank i's GPU: SGLang's TP rank i decodes entry i alone (srt/managers/tp_worker.py,
   deserialize_own_rank).
A rank without an engine beside it still takes part in the gathers (and, with PP, the broadcasts).

The buffers are reused: a buffer is refilled only after the engine has answered the request that
used it (it copies before answering), which keeps the handed memory alive exactly as long as the
engine may read it; with N > 1 the posting rank's wait is passed on to the others by a barrier of the
engine's group before each fill. Two buffers let the fill of bucket k+1 overlap the engine's copy of
bucket k. Both are freed at the end of `sync()`: during the rollout the device memory belongs to the
engine.

The caller releases the engines' memory (MEMORY_TAGS) before training, resumes the weights alone before
`sync()` and the KV cache and CUDA graphs after it. A release drops the weights (SGLang without
--enable-weights-cpu-backup), so the sync after one sends every tensor, frozen ones included; the
embedded engine refuses to generate until every tensor has been refilled.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from slime_rl.config import WeightSyncConfig
from slime_rl.engines.client import EngineClient, EngineError
from slime_rl.engines.tensor_ipc import serialize_named_tensors, use_file_system_sharing
from slime_rl.weight_sync.broadcast import EngineControl, EngineTarget, buckets, check_ok, flatten_bucket, with_last

# SGLang's memory-saver tags (srt/constants.py, 0.5.23). Training takes all three; the sync resumes the
# weights alone (it writes into them), and the KV cache and CUDA graphs come back only after it, so
# the trainer's bucket buffers and the engine's KV pool are never on the device at once (slime's order).
MEMORY_TAGS = ["weights", "kv_cache", "cuda_graph"]
RESUME_BEFORE_SYNC = ["weights"]
RESUME_AFTER_SYNC = ["kv_cache", "cuda_graph"]

Meta = tuple[str, torch.dtype, tuple[int, ...]]  # an HF tensor: name, dtype, HF shape


@dataclass(frozen=True)
class EngineShare:
    """This trainer rank's place among the N trainer ranks beside one engine's N devices: `index` i
    (the engine TP rank on this rank's GPU), `root` the global rank beside TP rank 0 (it gathers the
    handles and posts), `group` a gloo group of the N ranks (None when N is 1)."""

    index: int
    size: int
    root: int
    group: object | None = None

    @classmethod
    def create(cls, rank: int, spans: Sequence[Sequence[int]]) -> EngineShare | None:
        """Every trainer rank calls this with every engine's ranks (`spans[e]`, in the engine's TP order),
        in the same order: torch.distributed.new_group is collective over the whole world. Returns
        this rank's share (None: no engine beside it)."""
        mine = None
        for ranks in spans:
            group = dist.new_group(list(ranks), backend="gloo") if len(ranks) > 1 else None
            if rank in ranks:
                mine = cls(list(ranks).index(rank), len(ranks), ranks[0], group)
        return mine

    @property
    def posts(self) -> bool:
        return self.index == 0

    def barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def gather(self, entry: str) -> list[str] | None:
        """Every rank's handle, in TP order, on the root (None elsewhere)."""
        if self.group is None:
            return [entry]
        out: list | None = [None] * self.size if self.posts else None
        dist.gather_object(entry, out, dst=self.root, group=self.group)
        return out


@dataclass(frozen=True)
class PipelineStages:
    """PP > 1: this rank's pipeline group (one rank per stage, `ranks[s]` the global rank of stage s),
    its own stage, and every stage's tensors (`metas[s]`, in the order stage s yields them)."""

    group: object
    ranks: tuple[int, ...]
    stage: int
    metas: tuple[tuple[Meta, ...], ...]
    device: torch.device

    @classmethod
    def exchange(cls, group: object, stage: int, own: Sequence[Meta], device: torch.device) -> PipelineStages:
        """Collective over the PP group: every stage learns what the others will yield."""
        metas: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(metas, [(n, d, tuple(s)) for n, d, s in own], group=group)
        return cls(group, tuple(dist.get_process_group_ranks(group)), stage,
                   tuple(tuple(m) for m in metas), device)


@dataclass
class _Bucket:
    metas: list[Meta]
    nbytes: int
    device: torch.device
    copy: Callable[[torch.Tensor], None]  # this rank's bytes into the buffer's head (if it owns the bucket)
    share: Callable[[torch.Tensor], None]  # PP: the owning stage's broadcast of the head to the others


def _nothing(_: torch.Tensor) -> None:
    return None


def _local_buckets(named: Iterable[tuple], max_bytes: int) -> Iterator[_Bucket]:
    """PP 1: every rank yields every tensor; a bucket is copied from its own tensors."""
    for bucket in buckets(named, max_bytes):
        metas = [(name, x.dtype, tuple(shape[0]) if shape else tuple(x.shape)) for name, x, *shape in bucket]
        yield _Bucket(metas, sum(x.numel() * x.element_size() for _, x, *_ in bucket), bucket[0][1].device,
                      lambda buf, b=bucket: flatten_bucket(b, buf), _nothing)


def _pipeline_buckets(own: Iterable[tuple], stages: PipelineStages, max_bytes: int) -> Iterator[_Bucket]:
    """PP > 1: every stage's buckets, stage 0's first, on every rank: the ranks of the owning stage
    copy from their own tensors (consuming `own` in step: its TP gathers run then), and the owner of
    this PP group broadcasts the buffer's head to the other stages' ranks."""
    own_iter = iter(own)
    for s, metas in enumerate(stages.metas):
        plans = list(buckets([(n, torch.empty(shape, dtype=dtype, device="meta"), shape)
                              for n, dtype, shape in metas], max_bytes))
        for k, plan in enumerate(plans):
            nbytes = sum(t.numel() * t.element_size() for _, t, _ in plan)
            names = [n for n, *_ in plan]
            copy = partial(_copy_own, own_iter, names, s, k == len(plans) - 1) if s == stages.stage else _nothing
            share = partial(_broadcast_head, nbytes, stages.ranks[s], stages.group)
            yield _Bucket([(n, t.dtype, shape) for n, t, shape in plan], nbytes, stages.device, copy, share)


def _copy_own(own: Iterator[tuple], names: list[str], stage: int, last: bool, buf: torch.Tensor) -> None:
    """The next len(names) tensors of this stage into the buffer's head; they must be the announced
    ones, and after the stage's `last` bucket there must be none left."""
    items = [next(own) for _ in names]
    got = [it[0] for it in items]
    if got != names:
        raise RuntimeError(f"stage {stage} yields {got}, announced {names}: the pipeline stages disagree")
    flatten_bucket(items, buf)
    left = [it[0] for it in own] if last else []
    if left:
        raise RuntimeError(f"stage {stage} yields {left} after the tensors it announced")


def _broadcast_head(nbytes: int, src: int, group: object, buf: torch.Tensor) -> None:
    dist.broadcast(buf[:nbytes], src=src, group=group)


class ColocatedUpdater(EngineControl):
    """One per trainer rank. `engines`: every engine (rank 0 pauses and continues them all); `mine`:
    the engine beside this rank's device ([] or [e]); `share`: this rank's place among that engine's
    devices (None: the engine has one device, this rank's)."""

    def __init__(self, engines: Sequence[EngineTarget], mine: Sequence[int], cfg: WeightSyncConfig,
                 share: EngineShare | None = None) -> None:
        if len(mine) > 1:
            raise ValueError(f"one engine beside a trainer rank's device, got {list(mine)}")
        self.engines = list(engines)
        self.mine = list(mine)
        self.share = share if share is not None else EngineShare(0, 1, -1) if self.mine else None
        self.cfg = cfg
        self._clients = [EngineClient(e.url, api_key=e.api_key) for e in self.engines]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)))
        self._buffers: list[torch.Tensor | None] = [None, None]

    @property
    def is_source(self) -> bool:
        """Whether this rank posts to an engine (the one beside the engine's TP rank 0)."""
        return self.share is not None and self.share.posts

    def sync(self, named_weights: Iterable[tuple], version: str, own_session: bool = True,
             stages: PipelineStages | None = None) -> dict[str, float]:
        """Hand every tensor of `named_weights` (HF names: (name, tensor) or (name, source, HF shape);
        with `stages`, this pipeline stage's) to the engine beside this rank; returns the broadcaster's
        perf keys on the rank that posts ({} on the others, which still take part in the gathers).
        `own_session`: open/close the weight-update session on this rank's engine around it (False:
        the caller, rank 0, holds one open on every engine)."""
        if self.share is None and stages is None:
            for _ in named_weights:
                pass
            return {}
        if not (own_session and self.is_source):
            return self._send(named_weights, version, stages)
        client = self._clients[self.mine[0]]
        client.open_weight_update_session()
        try:
            metrics = self._send(named_weights, version, stages)
        except BaseException:
            try:
                client.close_weight_update_session()
            except EngineError as e:
                print(f"[slime_rl] {client.base_url}: /end_weight_update after a failed sync: {e}", flush=True)
            raise
        client.close_weight_update_session()
        return metrics

    def _send(self, named_weights: Iterable[tuple], version: str, stages: PipelineStages | None) -> dict[str, float]:
        start = time.perf_counter()
        phases = {"build": 0.0, "fill": 0.0, "http_wait": 0.0}
        pending: list[list[Future]] = [[], []]  # the requests that read each buffer (on the posting rank)
        size = self.cfg.update_weight_buffer_size
        stream = _local_buckets(named_weights, size) if stages is None else _pipeline_buckets(named_weights, stages,
                                                                                                size)
        total, n_buckets = 0, 0
        t = time.perf_counter()
        for i, (bucket, last) in enumerate(with_last(stream)):
            phases["build"] += time.perf_counter() - t
            slot = i % 2
            t = time.perf_counter()
            if self.share is not None:  # the engine has copied out of this buffer: it may be refilled
                self._wait(pending[slot])
                self.share.barrier()
            phases["http_wait"] += time.perf_counter() - t
            t = time.perf_counter()
            buf = self._buffer(slot, bucket.nbytes, bucket.device)
            bucket.copy(buf)
            phases["fill"] += time.perf_counter() - t
            t = time.perf_counter()
            bucket.share(buf)  # PP: the stage broadcast, counted with the gathers
            phases["build"] += time.perf_counter() - t
            t = time.perf_counter()
            if self.share is not None:
                entries = self.share.gather(serialize_named_tensors(_views(buf, bucket.metas)))
                if entries is not None:
                    client = self._clients[self.mine[0]]
                    pending[slot] = [self._pool.submit(client.update_weights_from_tensor, entries,
                                                       flush_cache=last, weight_version=version)]
            phases["fill"] += time.perf_counter() - t
            total += bucket.nbytes
            n_buckets += 1
            t = time.perf_counter()
        t = time.perf_counter()
        for futures in pending:
            self._wait(futures)
        if self.share is not None:
            self.share.barrier()  # every engine answered: no member frees a buffer it may still read
        phases["http_wait"] += time.perf_counter() - t
        self._free_buffers()  # colocated: the engine needs the device memory during the rollout
        if not self.is_source:
            return {}
        return {"weight_sync/bytes": float(total), "weight_sync/seconds": time.perf_counter() - start,
                "weight_sync/buckets": float(n_buckets),
                **{f"weight_sync/{k}_seconds": v for k, v in phases.items()}}

    def _buffer(self, slot: int, nbytes: int, device: torch.device) -> torch.Tensor:
        """Buffer `slot`, grown when too small (on CPU in shared memory, which the engine maps)."""
        buf = self._buffers[slot]
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            if device.type == "cpu":
                use_file_system_sharing()
                buf.share_memory_()
            self._buffers[slot] = buf
        return buf

    @staticmethod
    def _wait(futures: list[Future]) -> None:
        for f in futures:
            check_ok(f.result(), "update_weights_from_tensor")

    def close(self) -> None:
        self._close_clients()
        self._free_buffers()

    def _free_buffers(self) -> None:
        self._buffers = [None, None]
        if torch.cuda.is_available():
            torch.cuda.ipc_collect()  # blocks the engines mapped and have since dropped
            torch.cuda.empty_cache()


def _views(buf: torch.Tensor, metas: Sequence[Meta]) -> list[tuple[str, torch.Tensor]]:
    """Each tensor of a bucket as a view of the buffer's head, under its name, in its HF shape."""
    views, offset = [], 0
    for name, dtype, shape in metas:
        n = dtype.itemsize * (torch.Size(shape).numel())
        views.append((name, buf[offset:offset + n].view(dtype).view(shape)))
        offset += n
    return views
