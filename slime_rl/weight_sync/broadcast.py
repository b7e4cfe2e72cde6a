"""Disaggregated weight sync: the trainer's source rank broadcasts HF-named tensors to every
engine device through one torch.distributed group (gloo on CPU, NCCL on GPU).

Every trainer rank runs `sync()`: gathering TP shards is collective, so all ranks walk the
weights together; only the source rank (global rank 0) buckets and sends. The engines are driven
through SGLang's endpoints: `/init_weights_update_group` once, then per bucket
`/update_weights_from_distributed` (names, dtypes, shapes), whose HTTP call returns only after the
engine has received and loaded the bucket, so it must be in flight while we broadcast. Buckets are
pipelined (see `sync`): on 2xH200 a 4B-shape sync went from 0.80 s to 0.028 s (BENCHMARKS.md).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from slime_rl.config import WeightSyncConfig
from slime_rl.engines.dist_group import broadcast_async, destroy_group, dtype_name, init_custom_group
from slime_rl.rollout.client import EngineClient, EngineError

GROUP_NAME = "weight_update_group"


@dataclass(frozen=True)
class EngineTarget:
    url: str
    rank_offset: int
    api_key: str | None = None


def buckets(named: Iterable[tuple[str, torch.Tensor]], max_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of tensors of at most max_bytes each (a larger tensor goes alone), one
    dtype per bucket so every tensor of a flattened bucket starts aligned for its dtype."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (size + nbytes > max_bytes or tensor.dtype != bucket[0][1].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def flatten_bucket(bucket: list[tuple[str, torch.Tensor]], out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket's tensors' bytes back to back, in order: one uint8 tensor. With `out` (a uint8
    buffer at least that large) they are copied straight into its head, one multi-tensor copy, and
    that view is returned: no intermediate per-tensor flattening."""
    if out is None:
        return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for _, t in bucket])
    nbytes = sum(t.numel() * t.element_size() for _, t in bucket)
    if len({t.dtype for _, t in bucket}) == 1:  # buckets() makes them so: one split, one view each
        parts = out[:nbytes].view(bucket[0][1].dtype).split([t.numel() for _, t in bucket])
        views = [p.view(t.shape) for p, (_, t) in zip(parts, bucket, strict=True)]
    else:
        views, offset = [], 0
        for _, t in bucket:
            n = t.numel() * t.element_size()
            views.append(out[offset:offset + n].view(t.dtype).view(t.shape))
            offset += n
    with torch.no_grad():  # the sources may be strided views (QKV/gate-up splits): copy_ reads them in place
        torch._foreach_copy_(views, [t for _, t in bucket])
    return out[:nbytes]


class WeightBroadcaster:
    """One per trainer rank. `connect()` once, then `sync(version)` after every update.

    With pipeline parallelism every stage has its own source rank and its own group (named per
    stage), each joined by every engine device at the same rank offsets; the stages send their
    own layers, concurrently. The caller pauses the engines before and continues them after all
    stages are done (trainer_group does it around a barrier)."""

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
        self._clients = [EngineClient(e.url, api_key=e.api_key) for e in self.engines] if is_source else []
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines))) if is_source else None

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
            _check_ok(f.result(), "init_weights_update_group")

    def sync(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: str) -> dict[str, float]:
        """Send every tensor of `named_weights` (HF names) to every engine; returns perf metrics.

        Pipelined: bucket k's request is posted before its bytes are copied into one of two
        preallocated flat buffers, and the broadcast is only waited on (device-side, no host sync)
        before its buffer is refilled two buckets later, so the copy of bucket k+1 overlaps the
        wire time of bucket k and the host never blocks on the GPU until the end."""
        start = time.perf_counter()
        total = 0
        if not self.is_source:
            for _ in named_weights:  # take part in the TP/PP gathers that produce the tensors
                pass
            return {}
        phases = {"build": 0.0, "fill": 0.0, "http_wait": 0.0, "device_wait": 0.0}
        cap = self.cfg.update_weight_buffer_size
        buffers: list[torch.Tensor | None] = [None, None]
        pending: list[object | None] = [None, None]  # the broadcast that last read each buffer
        futures: list = []
        n_buckets = 0
        t = time.perf_counter()
        for i, bucket in enumerate(buckets(named_weights, cap)):
            phases["build"] += time.perf_counter() - t
            t = time.perf_counter()
            for f in futures:  # the engine must have taken bucket k-1 before it is asked for bucket k
                _check_ok(f.result(), "update_weights_from_distributed")
            phases["http_wait"] += time.perf_counter() - t
            futures = [
                self._pool.submit(c.update_weights_from_distributed, names=[n for n, _ in bucket],
                                  dtypes=[dtype_name(x.dtype) for _, x in bucket],
                                  shapes=[list(x.shape) for _, x in bucket], group_name=self.group_name,
                                  flush_cache=True, weight_version=version, load_format="flattened_bucket")
                for c in self._clients
            ]
            # one broadcast per bucket (SGLang's flattened bucket): per-tensor calls would pay a
            # collective's latency for every bias and norm
            t = time.perf_counter()
            nbytes = sum(x.numel() * x.element_size() for _, x in bucket)
            slot = i % 2
            if pending[slot] is not None:
                pending[slot].wait()  # NCCL: the current stream waits; gloo: the host waits
            if buffers[slot] is None or buffers[slot].numel() < nbytes:
                buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=bucket[0][1].device)
            flat = flatten_bucket(bucket, buffers[slot])
            pending[slot] = broadcast_async(self.group, flat, 0)
            phases["fill"] += time.perf_counter() - t
            total += nbytes
            n_buckets += 1
            t = time.perf_counter()
        t = time.perf_counter()
        for f in futures:
            _check_ok(f.result(), "update_weights_from_distributed")
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

    def pause_engines(self) -> None:
        """SGLang's /pause_generation on every engine: nothing generates while weights change."""
        for c in self._clients:
            c.pause_generation()

    def continue_engines(self) -> None:
        for c in self._clients:
            c.continue_generation()

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
        if self._pool is not None:
            self._pool.shutdown(wait=False)
        for c in self._clients:
            c.close()


def _check_ok(response: dict, endpoint: str) -> None:
    if isinstance(response, dict) and response.get("success") is False:
        raise RuntimeError(f"engine refused /{endpoint}: {response.get('message')}")
