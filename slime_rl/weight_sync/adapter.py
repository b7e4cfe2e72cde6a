"""--lora-sync adapter: a LoRA run's adapters sent to the engines alone, as SGLang 0.5.23 loads them.

Global rank 0 holds the adapters whole under PEFT's names (`hf_export.gather_peft_state`) and posts ONE
/load_lora_adapter_from_tensors per engine: the adapter_config as a dict and one serialized_named_tensors
entry per engine TP rank, each the whole adapter by value (`tensor_ipc.serialize_by_value`: the bytes travel
in the request, so an engine on another node takes it as one beside the trainer does; SGLang's LoRA layers
slice A and B per TP rank themselves, srt/managers/tp_worker.py load_lora_adapter_from_tensors). The
adapter of weight version v is loaded as `payloads.lora_adapter_name(v)`; the rollout's requests name it
once the sync is over (`client.AdapterChoice`), so until then a running rollout (--async, --fully-async)
still sends requests naming the version before: that one stays loaded until the next sync, which unloads
it in the background (SGLang unloads an adapter only once the requests that name it have finished:
srt/managers/tokenizer_control_mixin.py, wait_for_unload) and checks at the sync after.
No pause, no weight-update session: the engines keep generating under the adapter their requests name;
/update_weight_version then sets the version their answers report (without aborting anything).
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Sequence
from typing import Any

import torch

from slime_rl.engines.client import EngineClient
from slime_rl.engines.payloads import lora_adapter_name
from slime_rl.engines.tensor_ipc import serialize_by_value
from slime_rl.weight_sync.broadcast import EngineTarget, check_ok


class AdapterSender:
    """Global rank 0's link to every engine for --lora-sync adapter. `copies`: serialized_named_tensors
    entries per request, one per TP rank of an engine (the built-in engine reads the first)."""

    def __init__(self, targets: Sequence[EngineTarget], copies: int) -> None:
        self.targets = list(targets)
        self.copies = max(1, int(copies))
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, 2 * len(self.targets)))
        self.loaded: list[str] = []  # the names the engines hold adapters under, the newest last
        self._unloads: list[concurrent.futures.Future] = []  # the previous versions', in the background

    def send(self, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: str) -> dict[str, float]:
        """Load the adapters of weight version `version` into every engine (in parallel), then start unloading
        the previous version's. Returns the metrics: tensor bytes, request bytes over all engines, seconds."""
        start = time.perf_counter()
        self.wait_unloads()
        name = lora_adapter_name(version)
        entry = serialize_by_value(tensors)
        payload = [entry] * self.copies
        futures = [self._pool.submit(self._load, t, name, config, payload, version) for t in self.targets]
        for f in futures:
            f.result()
        # the rollout names the previous adapters until this sync ends (Cluster: use_adapter): they stay; the
        # ones before them are no longer named by any new request
        stale, self.loaded = self.loaded[:-1], [*self.loaded[-1:], name]
        self._unloads = [self._pool.submit(self._unload, t, old) for old in stale for t in self.targets]
        seconds = time.perf_counter() - start
        return {"weight_sync/bytes": float(len(entry) * self.copies * len(self.targets)),
                "weight_sync/adapter_bytes": float(sum(t.numel() * t.element_size() for t in tensors.values())),
                "weight_sync/seconds": seconds, "perf/weight_sync_adapter_s": seconds}

    @staticmethod
    def _load(target: EngineTarget, name: str, config: dict[str, Any], payload: list[str], version: str) -> None:
        with EngineClient(target.url, api_key=target.api_key) as client:
            check_ok(client.load_lora_adapter_from_tensors(name, config, payload), "load_lora_adapter_from_tensors")
            # the answers' meta_info.weight_version (partial rollouts, --max-staleness) counts adapter versions
            check_ok(client.update_weight_version(version, abort_all_requests=False), "update_weight_version")

    @staticmethod
    def _unload(target: EngineTarget, name: str) -> None:
        with EngineClient(target.url, api_key=target.api_key) as client:
            check_ok(client.unload_lora_adapter(name), "unload_lora_adapter")

    def wait_unloads(self) -> None:
        """Wait for the unloads the last send started (each send does first): an engine that refused one fails
        the sync, naming it (it would keep every version's adapters until its LoRA memory runs out)."""
        unloads, self._unloads = self._unloads, []
        for f in unloads:
            f.result()

    def close(self) -> None:
        for f in self._unloads:
            f.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
