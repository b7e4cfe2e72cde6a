"""Colocated weight sync (`--colocate`): trainer rank r and engine e share a device, so the weights are
handed over IN PLACE: the trainer fills a bucket buffer and sends the engine handles to it (CUDA IPC
on GPU, a named /dev/shm file on CPU; engines/tensor_ipc.py) through SGLang's
/update_weights_from_tensor; the engine copies from the trainer's memory straight into its parameters.
No process group, no bytes over a socket.

Every trainer rank runs `sync()` over `iter_hf_weights()` (the TP gathers are collective, and with
PP 1 every rank ends up with every full tensor); a rank sends only to the engines placed on its own
device (`mine`), so the IPC handle always names a device both processes see under the same index.
Buckets (`buckets()`, as the broadcaster) are flattened into one of two reused buffers; every tensor
of a bucket is a view of that buffer, so one handle maps the whole bucket. A buffer is refilled
only after the engine has answered the request that used it (it copies before answering), which keeps
the handed memory alive exactly as long as the engine may read it; two buffers let the fill of bucket
k+1 overlap the engine's copy of bucket k. Both are freed at the end of `sync()`: during the
rollout the device memory belongs to the engine.

The caller releases the engines' memory (MEMORY_TAGS) before training, resumes the weights alone before
`sync()` and the KV cache and CUDA graphs after it. A release drops the weights (SGLang without
--enable-weights-cpu-backup), so the sync after one sends every tensor, frozen ones included; the
embedded engine refuses to generate until every tensor has been refilled.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

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


class ColocatedUpdater(EngineControl):
    """One per trainer rank. `engines`: every engine (rank 0 pauses and continues them all); `mine`:
    indices of the engines on this rank's device (it sends to them)."""

    def __init__(self, engines: Sequence[EngineTarget], mine: Sequence[int], cfg: WeightSyncConfig) -> None:
        self.engines = list(engines)
        self.mine = list(mine)
        self.cfg = cfg
        self._clients = [EngineClient(e.url, api_key=e.api_key) for e in self.engines]
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(self.engines)))
        self._buffers: list[torch.Tensor | None] = [None, None]

    @property
    def is_source(self) -> bool:
        return bool(self.mine)

    def sync(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: str,
             own_session: bool = True) -> dict[str, float]:
        """Hand every tensor of `named_weights` (HF names) to the engines on this device; returns the
        broadcaster's perf keys ({} on a rank with no engine, which still walks the gathers).
        `own_session`: open/close the weight-update session on this rank's engines around it (False:
        the caller, rank 0, holds one open on every engine)."""
        if not self.mine:
            for _ in named_weights:
                pass
            return {}
        if own_session:
            mine = [self._clients[e] for e in self.mine]
            for c in mine:
                c.open_weight_update_session()
            try:
                metrics = self._send(named_weights, version)
            except BaseException:
                for c in mine:
                    try:
                        c.close_weight_update_session()
                    except EngineError as e:
                        print(f"[slime_rl] {c.base_url}: /end_weight_update after a failed sync: {e}", flush=True)
                raise
            for c in mine:
                c.close_weight_update_session()
            return metrics
        return self._send(named_weights, version)

    def _send(self, named_weights: Iterable[tuple[str, torch.Tensor]], version: str) -> dict[str, float]:
        start = time.perf_counter()
        phases = {"build": 0.0, "fill": 0.0, "http_wait": 0.0}
        pending: list[list[Future]] = [[], []]  # the requests that read each buffer
        total, n_buckets = 0, 0
        t = time.perf_counter()
        for i, (bucket, last) in enumerate(with_last(buckets(named_weights, self.cfg.update_weight_buffer_size))):
            phases["build"] += time.perf_counter() - t
            slot = i % 2
            t = time.perf_counter()
            self._wait(pending[slot])  # the engine has copied out of this buffer: it may be refilled
            phases["http_wait"] += time.perf_counter() - t
            t = time.perf_counter()
            views = self._fill(slot, bucket)
            entry = serialize_named_tensors(views)
            phases["fill"] += time.perf_counter() - t
            pending[slot] = [self._pool.submit(self._clients[e].update_weights_from_tensor, [entry],
                                               flush_cache=last, weight_version=version) for e in self.mine]
            total += sum(x.numel() * x.element_size() for _, x, *_ in bucket)
            n_buckets += 1
            t = time.perf_counter()
        t = time.perf_counter()
        for futures in pending:
            self._wait(futures)
        phases["http_wait"] += time.perf_counter() - t
        self._free_buffers()  # colocated: the engine needs the device memory during the rollout
        return {"weight_sync/bytes": float(total), "weight_sync/seconds": time.perf_counter() - start,
                "weight_sync/buckets": float(n_buckets),
                **{f"weight_sync/{k}_seconds": v for k, v in phases.items()}}

    def _fill(self, slot: int, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """The bucket copied into buffer `slot` (grown when too small; on CPU in shared memory), and
        each tensor as a view of it, under its name."""
        nbytes = sum(x.numel() * x.element_size() for _, x, *_ in bucket)
        buf = self._buffers[slot]
        device = bucket[0][1].device
        if buf is None or buf.numel() < nbytes or buf.device != device:
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            if device.type == "cpu":
                use_file_system_sharing()
                buf.share_memory_()
            self._buffers[slot] = buf
        flat = flatten_bucket(bucket, buf)
        views, offset = [], 0
        for name, x, *hf_shape in bucket:  # (name, tensor) or weight sync's (name, source, HF shape)
            n = x.numel() * x.element_size()
            views.append((name, flat[offset:offset + n].view(x.dtype).view(hf_shape[0] if hf_shape else x.shape)))
            offset += n
        return views

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

