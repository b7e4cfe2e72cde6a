"""Disaggregated weight sync: the trainer's source rank broadcasts HF-named tensors to every
engine device through one torch.distributed group (gloo on CPU, NCCL on GPU). The call sequence
and the SGLang 0.5.23 rules it follows (sessions, one call at a time): docs/sglang_contract.md.

Every trainer rank runs `sync()`: gathering TP shards is collective, so all ranks walk the
weights together; only the source rank (global rank 0) buckets and sends. The engines are driven
through SGLang's endpoints: `/init_weights_update_group` once, then per bucket
`/update_weights_from_distributed` (names, dtypes, shapes), whose HTTP call returns only after the
engine has received and loaded the bucket, so it must be in flight while we broadcast. Buckets are
pipelined (see `sync`): on 2xH200 a 4B-shape sync went from 0.80 s to 0.028 s (BENCHMARKS.md).
What is left per sync is fixed host cost, so everything that repeats is kept: the trainer's HF views
(hf_io.iter_hf_sources), each bucket's plan and the send buffers here, the engine's bucket layouts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from slime_rl.config import WeightSyncConfig
from slime_rl.engines.client import EngineError, KeepAliveEngineClient
from slime_rl.engines.dist_group import broadcast_async, destroy_group, dtype_name, init_custom_group

GROUP_NAME = "weight_update_group"


@dataclass(frozen=True)
class EngineTarget:
    url: str
    rank_offset: int
    api_key: str | None = None
    pullers: tuple = ()  # the Ray actors of the engine's hosts (--update-weight-transport disk: each pulls)


# SGLang 0.5.23's DeepSeek loader (deepseek_common/deepseek_weight_loader.py) fuses a layer's q_a_proj and
# kv_a_proj_with_mqa into one parameter when both arrive in the same load_weights call, and drops one that
# arrives alone; the registry sends the pair one after the other (config/families.py), and a bucket never
# ends between them (slime's megatron_to_hf pairs them for the same reason)
_PAIRED = (".self_attn.q_a_proj.weight", ".self_attn.kv_a_proj_with_mqa.weight")


def _pairs_with_last(bucket: list[tuple], name: str) -> bool:
    first, second = _PAIRED
    return bool(bucket) and name.endswith(second) and bucket[-1][0] == name[: -len(second)] + first


def buckets(named: Iterable[tuple], max_bytes: int) -> Iterator[list[tuple]]:
    """Consecutive groups of tensors of at most max_bytes each (a larger tensor goes alone), one
    dtype per bucket so every tensor of a flattened bucket starts aligned for its dtype. The items
    are (name, tensor) or (name, tensor, announced shape). A DeepSeek layer's kv_a_proj_with_mqa stays in
    the bucket of the q_a_proj sent just before it (the pair may pass max_bytes; _PAIRED says why)."""
    bucket: list[tuple] = []
    size = 0
    for item in named:
        tensor = item[1]
        nbytes = tensor.numel() * tensor.element_size()
        together = _pairs_with_last(bucket, item[0]) and tensor.dtype == bucket[0][1].dtype
        if bucket and not together and (size + nbytes > max_bytes or tensor.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(item)
        size += nbytes
    if bucket:
        yield bucket


def _dest_views(tensors: list[torch.Tensor], out: torch.Tensor) -> list[torch.Tensor]:
    """Views of the head of the uint8 buffer `out`, one per tensor (its shape and dtype), back to back."""
    if len({t.dtype for t in tensors}) == 1:  # buckets() makes them so: one split, one view each
        parts = out[:sum(t.numel() * t.element_size() for t in tensors)].view(tensors[0].dtype).split(
            [t.numel() for t in tensors])
        return [p.view(t.shape) for p, t in zip(parts, tensors, strict=True)]
    views, offset = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append(out[offset:offset + n].view(t.dtype).view(t.shape))
        offset += n
    return views


def flatten_bucket(bucket: list[tuple], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's tensors' bytes back to back, in order: one uint8 tensor. With `out` (a uint8
    buffer at least that large) they are copied straight into its head, one multi-tensor copy, and
    that view is returned: no intermediate per-tensor flattening."""
    if out is None:
        return torch.cat([it[1].detach().contiguous().reshape(-1).view(torch.uint8) for it in bucket])
    tensors = [it[1] for it in bucket]
    with torch.no_grad():  # the sources may be strided views (QKV/gate-up splits): copy_ reads them in place
        torch._foreach_copy_(_dest_views(tensors, out), tensors)
    return out[:sum(t.numel() * t.element_size() for t in tensors)]


@dataclass
class _BucketPlan:
    """Everything about sending one bucket except its bytes: it depends only on the bucket's names,
    source shapes/dtypes/contiguity and announced shapes (`key`) and on the send buffer, which
    repeat from sync to sync, so it is built once per bucket index and reused (`sync`)."""
    key: tuple
    buffer: torch.Tensor
    request: dict  # /update_weights_from_distributed's names, dtypes, shapes
    nbytes: int
    # contiguous sources and strided ones (QKV splits) in two multi-tensor copies: on CUDA the first
    # takes the fused multi-tensor kernel, which one strided tensor in the list would rule out
    dense: tuple[list[int], list[torch.Tensor]]
    strided: tuple[list[int], list[torch.Tensor]]

    @staticmethod
    def key_of(bucket: list[tuple]) -> tuple:
        return tuple((it[0], it[1].shape, it[1].dtype, it[1].is_contiguous(), it[2] if len(it) > 2 else None)
                     for it in bucket)

    @classmethod
    def build(cls, bucket: list[tuple], key: tuple, buffer: torch.Tensor) -> _BucketPlan:
        tensors = [it[1] for it in bucket]
        views = _dest_views(tensors, buffer)
        dense = [j for j, t in enumerate(tensors) if t.is_contiguous()]
        strided = [j for j, t in enumerate(tensors) if not t.is_contiguous()]
        request = {"names": [it[0] for it in bucket], "dtypes": [dtype_name(t.dtype) for t in tensors],
                   "shapes": [list(it[2] if len(it) > 2 else it[1].shape) for it in bucket]}
        return cls(key, buffer, request, sum(t.numel() * t.element_size() for t in tensors),
                   (dense, [views[j] for j in dense]), (strided, [views[j] for j in strided]))

    def fill(self, bucket: list[tuple]) -> torch.Tensor:
        with torch.no_grad():
            for idx, dst in (self.dense, self.strided):
                if idx:
                    torch._foreach_copy_(dst, [bucket[j][1] for j in idx])
        return self.buffer[:self.nbytes]


def with_last[T](items: Iterable[T]) -> Iterator[tuple[T, bool]]:
    """(item, is_last) for each item: one item of look-ahead. The updaters ask the engine to flush its
    cache on the last bucket only (UpdateWeightsFromDistributedReqInput.flush_cache, default True in
    SGLang): a flush per bucket repeats work the next bucket makes stale again."""
    it = iter(items)
    try:
        prev = next(it)
    except StopIteration:
        return
    for item in it:
        yield prev, False
        prev = item
    yield prev, True


def in_stage_order[R](pp_rank: int, pp_size: int, barrier: Callable[[], None], send: Callable[[], R]) -> R | None:
    """Run `send` on this pipeline stage's turn: stage 0 first, then 1, ..., every rank meeting at
    `barrier` after each turn. Why: an SGLang engine serves one weight-update call at a time and
    holds it for the whole call (its broadcast included). Stages sending at once to every engine can
    reach engine A stage 0 first and engine B stage 1 first: A waits in group 0 for B, B in group 1
    for A, forever. One global order rules that out. A failing `send` still takes part in the
    remaining barriers (the other ranks wait there), then raises."""
    result, error = None, None
    for stage in range(pp_size):
        if stage == pp_rank:
            try:
                result = send()
            except Exception as e:  # re-raised below, after the barriers the other ranks wait at
                error = e
        barrier()
    if error is not None:
        raise error
    return result


class EngineControl:
    """What both weight updaters (this broadcaster, colocated.ColocatedUpdater) do to the engines
    around a sync, through their `_clients` and `_pool`.

    Order around one sync (docs/sglang_contract.md): pause_engines, begin_update, the buckets,
    end_update, continue_engines. SGLang 0.5.23 refuses every update outside the session that
    /begin_weight_update opens; one caller must open it for all the senders of a sync (with PP
    the trainer's rank 0 does, `sync(own_session=False)` on every stage)."""

    _clients: list
    _pool: ThreadPoolExecutor | None

    def begin_update(self) -> None:
        """Open the weight-update session on every engine (not on an older server without sessions)."""
        for c in self._clients:
            c.open_weight_update_session()

    def end_update(self, quiet: bool = False) -> None:
        """Close it. `quiet`: after a failed sync, report a refusal instead of raising over the cause."""
        for c in self._clients:
            try:
                c.close_weight_update_session()
            except EngineError as e:
                if not quiet:
                    raise
                print(f"[slime_rl] {c.base_url}: /end_weight_update after a failed sync: {e}", flush=True)

    def _in_session(self, send: Callable[[], dict[str, float]]) -> dict[str, float]:
        self.begin_update()
        try:
            metrics = send()
        except BaseException:
            self.end_update(quiet=True)
            raise
        self.end_update()
        return metrics

    def pause_engines(self) -> None:
        """SGLang's /pause_generation on every engine: nothing generates while weights change."""
        for c in self._clients:
            c.pause_generation()

    def continue_engines(self) -> None:
        for c in self._clients:
            c.continue_generation()

    def _close_clients(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        for c in self._clients:
            c.close()


class WeightBroadcaster(EngineControl):
    """One per trainer rank. `connect()` once, then `sync(version)` after every update.

    With pipeline parallelism every stage has its own source rank and its own group (named per
    stage), each joined by every engine device at the same rank offsets; the stages send their
    own layers one stage after another (`in_stage_order`). The caller pauses the engines and opens
    their weight-update session before, and closes and continues after all stages are done
    (trainer_group does it around barriers)."""

    def __init__(self, engines: Sequence[EngineTarget], cfg: WeightSyncConfig, is_source: bool, master_addr: str,
                 master_port: int, world_size: int, backend: str, group_name: str = GROUP_NAME) -> None:
        self.group_name = group_name
        self.engines = list(engines)
        self.cfg = cfg
        self.is_source = is_source
        self.master_addr, self.master_port = master_addr, master_port
        self.world_size = world_size
        self.backend = backend
        self.group = None
        # http.client, not httpx: ~0.6 ms less per call, paid 2 + buckets times per sync
        self._clients = [KeepAliveEngineClient(e.url, api_key=e.api_key) for e in self.engines] if is_source else []
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines))) if is_source else None
        self._buffers: list[torch.Tensor | None] = [None, None]  # the two flat send buffers (sync)
        self._plans: dict[int, _BucketPlan] = {}  # bucket index -> its plan in the last sync

    def connect(self) -> None:
        """Create the group: rank 0 here (hosting the rendezvous), rank_offset.. on each engine."""
        if not self.is_source:
            return
        futures = [
            self._pool.submit(c.init_weights_update_group, master_address=self.master_addr,
                              master_port=self.master_port, rank_offset=e.rank_offset, world_size=self.world_size,
                              group_name=self.group_name, backend=self.backend)
            for c, e in zip(self._clients, self.engines, strict=True)
        ]
        self.group = init_custom_group(self.master_addr, self.master_port, 0, self.world_size, self.group_name,
                                       self.backend)
        for f in futures:
            check_ok(f.result(), "init_weights_update_group")

    def sync(self, named_weights: Iterable[tuple], version: str, own_session: bool = True) -> dict[str, float]:
        """Send every tensor of `named_weights` to every engine; returns perf metrics. `own_session`:
        open and close the engines' weight-update session around it (False: the caller holds one
        open around every stage's sync). Items are
        (hf_name, tensor) or (hf_name, source, hf_shape) where `source` holds the tensor's elements
        in row-major order in another shape (hf_io.iter_hf_sources: strided QKV views).

        Pipelined: bucket k's request is posted before its bytes are copied into one of two
        preallocated flat buffers, and the broadcast is only waited on (device-side, no host sync)
        before its buffer is refilled two buckets later, so the copy of bucket k+1 overlaps the
        wire time of bucket k and the host never blocks on the GPU until the end. The two buffers
        (2 x --update-weight-buffer-size at most) and each bucket's plan (request, destination views)
        are kept across syncs: the same weights make the same buckets every time."""
        if not self.is_source:
            for _ in named_weights:  # take part in the TP/PP gathers that produce the tensors
                pass
            return {}
        if own_session:
            return self._in_session(lambda: self._send(named_weights, version))
        return self._send(named_weights, version)

    def _send(self, named_weights: Iterable[tuple], version: str) -> dict[str, float]:
        start = time.perf_counter()
        total = 0
        phases = {"build": 0.0, "fill": 0.0, "http_wait": 0.0, "device_wait": 0.0}
        cap = self.cfg.update_weight_buffer_size
        buffers = self._buffers
        pending: list[object | None] = [None, None]  # the broadcast that last read each buffer
        futures: list = []
        n_buckets = 0
        t = time.perf_counter()
        for i, (bucket, last) in enumerate(with_last(buckets(named_weights, cap))):
            key = _BucketPlan.key_of(bucket)
            slot = i % 2
            plan = self._plans.get(i)
            if plan is None or plan.key != key or plan.buffer is not buffers[slot]:
                first = bucket[0][1]
                nbytes = sum(it[1].numel() * it[1].element_size() for it in bucket)
                if (buffers[slot] is None or buffers[slot].numel() < nbytes
                        or buffers[slot].device != first.device):
                    if pending[slot] is not None:  # the old buffer may still be read by a broadcast
                        pending[slot].wait()
                    old, buffers[slot] = buffers[slot], torch.empty(nbytes, dtype=torch.uint8, device=first.device)
                    # plans viewing the old buffer would keep it alive
                    self._plans = {k: p for k, p in self._plans.items() if p.buffer is not old}
                plan = self._plans[i] = _BucketPlan.build(bucket, key, buffers[slot])
            phases["build"] += time.perf_counter() - t
            t = time.perf_counter()
            for f in futures:  # the engine must have taken bucket k-1 before it is asked for bucket k
                check_ok(f.result(), "update_weights_from_distributed")
            phases["http_wait"] += time.perf_counter() - t
            futures = [
                self._pool.submit(c.update_weights_from_distributed, **plan.request, group_name=self.group_name,
                                  flush_cache=last, weight_version=version, load_format="flattened_bucket")
                for c in self._clients
            ]
            # one broadcast per bucket (SGLang's flattened bucket): per-tensor calls would pay a
            # collective's latency for every bias and norm
            t = time.perf_counter()
            if pending[slot] is not None:
                pending[slot].wait()  # NCCL: the current stream waits; gloo: the host waits
            pending[slot] = broadcast_async(self.group, plan.fill(bucket), 0)
            phases["fill"] += time.perf_counter() - t
            total += plan.nbytes
            n_buckets += 1
            t = time.perf_counter()
        self._plans = {k: p for k, p in self._plans.items() if k < n_buckets}  # fewer buckets this time
        t = time.perf_counter()
        for f in futures:
            check_ok(f.result(), "update_weights_from_distributed")
        phases["http_wait"] += time.perf_counter() - t
        t = time.perf_counter()
        for w in pending:
            if w is not None:
                w.wait()
        if buffers[0] is not None and buffers[0].is_cuda:
            torch.cuda.current_stream().synchronize()  # the bytes have left: buffers may be reused
        phases["device_wait"] = time.perf_counter() - t
        seconds = time.perf_counter() - start
        return {"weight_sync/bytes": float(total), "weight_sync/seconds": seconds,
                "weight_sync/buckets": float(n_buckets),
                **{f"weight_sync/{k}_seconds": v for k, v in phases.items()}}

    def destroy(self) -> None:
        """Leave the group for good (an engine of it was restarted): the engines that still answer
        drop their end (a dead one cannot, which is fine: its process is gone), then ours goes."""
        for c in self._clients:
            try:
                c.destroy_weights_update_group(group_name=self.group_name)
            except EngineError as e:
                print(f"[slime_rl] {self.group_name}: {e} (ignored: the engine is being replaced)", flush=True)
        if self.group is not None:
            destroy_group(self.group)
            self.group = None
        self.close()

    def close(self) -> None:
        self._buffers, self._plans = [None, None], {}  # the send buffers' memory goes back now
        self._close_clients()


def check_ok(response: object, endpoint: str) -> None:
    """An engine's {"success": false, "message": ...} answer as an error naming the endpoint."""
    if isinstance(response, dict) and response.get("success") is False:
        raise RuntimeError(f"engine refused /{endpoint}: {response.get('message')}")
