"""Engine side of SGLang's weight-sync endpoints, on an HF model.

- init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
  backend}: join the trainer's group as rank `rank_offset` (TP 1: the local TP rank is 0).
- update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
  abort_all_requests, weight_version, load_format, ...}: receive one broadcast from rank 0 per name,
  in order (or, with load_format "flattened_bucket", ONE uint8 broadcast holding every tensor's
  bytes back to back, as SGLang's FlattenedTensorBucket), then copy into the HF parameters by HF
  name. The tensors are received BEFORE taking the model, so the trainer's broadcast is not held up
  by running requests; they are copied under `Engine.weights_exclusive()`, so no forward sees
  half-updated weights.
- update_weights_from_tensor {serialized_named_tensors, load_format, flush_cache, abort_all_requests,
  weight_version}: colocated mode. One entry per device of the engine (`colocated_devices`, SGLang's
  one per TP rank), each holding named tensors handed over in place (CUDA IPC handles or shared-memory
  CPU storages, engines/tensor_ipc.py) by the trainer rank on that device. The engine computes on its
  first device and has no tensor parallel, so it reads entry 0 alone, as SGLang's TP rank 0 does
  (each TP rank decodes only its own entry: srt/managers/tp_worker.py, deserialize_own_rank); every
  entry holds the same full tensors, since each trainer rank gathers them whole (on CPU, where
  decoding an entry maps only a shared-memory file, the engine checks that: `_differing_entries`;
  on CUDA it maps no other device's memory, as SGLang's ranks do not). The entry is decoded
  by a restricted unpickler and copied into the parameters under `Engine.weights_exclusive()`; on
  CUDA the copy is finished before the answer, so the sender may free or refill its buffer once
  answered.
- get_weights_by_name {name, truncate_size}: `param.float().tolist()[:truncate_size]`, as SGLang's
  models answer it (rows, not elements, are truncated).
Responses are SGLang's (success, message) pairs.
"""

from __future__ import annotations

import datetime
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

from slime_rl.engines import dist_group
from slime_rl.engines.embedded.engine import Engine
from slime_rl.engines.embedded.experts import expert_aliases
from slime_rl.engines.embedded.sampling import RequestError
from slime_rl.engines.embedded.vision import checkpoint_aliases
from slime_rl.engines.tensor_ipc import UnsafePayloadError, deserialize_named_tensors


class WeightSync:
    def __init__(self, model: torch.nn.Module, engine: Engine, weight_version: str, devices: int = 1,
                 group_timeout_s: float = 1800.0) -> None:
        self.model, self.engine = model, engine
        # how long a group's set-up waits for its ranks (a rank that never comes: a 400, the lock freed)
        self.group_timeout = datetime.timedelta(seconds=group_timeout_s)
        self.devices = devices  # serialized_named_tensors entries per update (ServerConfig.colocated_devices)
        self.device = next(model.parameters()).device
        # remove_duplicate=False keeps both names of a tied tensor (lm_head.weight and
        # model.embed_tokens.weight): updating either one updates the shared storage.
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.params.update(checkpoint_aliases(self.params, model.config))  # Qwen2.5-VL: HF checkpoint names
        # checkpoint tensors that are buffers, not parameters (GLM-4.5's e_score_correction_bias)
        self.params.update((n, b) for n, b in model.named_buffers() if n.endswith(".e_score_correction_bias"))
        # MoE: one name per expert (and MiniMax-M2's block_sparse_moe names of its router and bias)
        self.params.update(expert_aliases(self.params, model.config))
        # a checkpoint with multi-token-prediction layers (num_nextn_predict_layers): their tensors (HF's layers from
        # num_hidden_layers on, MiMo's model.mtp_layers.*) are the speculative draft model's, which SGLang's target
        # model skips and its draft loads; this engine has no draft, so it takes and drops them (None: no such layers)
        nextn = int(getattr(model.config, "num_nextn_predict_layers", 0) or 0)
        self._draft_from = int(model.config.num_hidden_layers) if nextn > 0 else None
        # (aliases and tied names count twice: a generous bound on what one update can announce)
        self._held_bytes = sum(p.numel() * p.element_size() for p in self.params.values())
        self.groups: dict[str, object] = {}
        self.weight_version = weight_version
        self._lock = threading.Lock()  # one group operation at a time
        self._copy_stream: torch.cuda.Stream | None = None
        self.memory = None  # memory.MemoryOccupation, set by the server: refills are reported to it
        self.adapters = None  # adapters.EngineAdapters, set by the server: a written base is merged again
        # a flattened bucket's request seen before (the trainer sends the same buckets every sync)
        # -> what its validation found: skips ~5 us of Python per tensor (checks, views) per bucket
        self._plans: dict[tuple, _FlatPlan] = {}

    def init_group(self, body: dict) -> tuple[bool, str]:
        master_address = _field(body, "master_address", str)
        master_port = _field(body, "master_port", int)
        rank_offset = _field(body, "rank_offset", int)
        world_size = _field(body, "world_size", int)
        group_name = _field(body, "group_name", str, "weight_update_group")
        backend = _field(body, "backend", str, "nccl")
        if backend == "nccl" and self.device.type != "cuda":
            raise RequestError("backend: 'nccl' needs the engine on CUDA; this engine runs on "
                               f"{self.device.type} (use backend 'gloo')")
        with self._lock:
            if group_name in self.groups:
                return False, f"Group {group_name} already exists; destroy it first."
            try:
                self.groups[group_name] = dist_group.init_custom_group(
                    master_address, master_port, rank_offset, world_size, group_name, backend, self.group_timeout)
            except (RuntimeError, ValueError) as e:  # torch's DistStoreError (a timeout) is a RuntimeError
                return False, f"Failed to initialize custom process group: {e}."
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, body: dict) -> tuple[bool, str]:
        group_name = _field(body, "group_name", str, "weight_update_group")
        with self._lock:
            group = self.groups.pop(group_name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        dist_group.destroy_group(group)
        return True, "Succeeded to destroy custom process group."

    def update_from_distributed(self, body: dict) -> tuple[bool, str]:
        plan = self._plans.get(_plan_key(body)) if body.get("load_format") == "flattened_bucket" else None
        if plan is not None and self.memory is not None and self.memory.weights_released:
            plan = None  # the full path receives the bytes, then refuses naming the released weights
        if plan is not None:  # exactly a request validated before: straight to the receive
            return self._update_planned(plan, body)
        names = _field(body, "names", list)
        dtypes = _field(body, "dtypes", list)
        shapes = _field(body, "shapes", list)
        group_name = _field(body, "group_name", str, "weight_update_group")
        version = _field(body, "weight_version", str, None)
        load_format = body.get("load_format")
        if load_format not in (None, "direct", "flattened_bucket"):
            raise RequestError(f"load_format: {load_format!r} is not supported by the embedded engine "
                               "(None or 'flattened_bucket')")
        if not (len(names) == len(dtypes) == len(shapes)):
            raise RequestError(f"names, dtypes, shapes: lengths differ ({len(names)}, {len(dtypes)}, "
                               f"{len(shapes)})")
        try:
            torch_dtypes = [dist_group.dtype_from_name(d) for d in dtypes]
        except ValueError as e:
            raise RequestError(f"dtypes: {e}") from e
        if not all(isinstance(s, list) and all(isinstance(x, int) and x >= 0 for x in s) for s in shapes):
            raise RequestError("shapes: expected a list of lists of non-negative ints")
        # every tensor is allocated before the broadcast: a request announcing more bytes than the model
        # holds cannot be a weight update (and would fail the allocation with a 500)
        announced = sum(math.prod(s) * d.itemsize for s, d in zip(shapes, torch_dtypes, strict=True))
        if announced > self._held_bytes:
            raise RequestError(f"shapes: {announced} bytes announced, more than the model's {self._held_bytes}")
        group, error = self._target_group(group_name, body)
        if group is None:
            return False, error
        # Receive every tensor even if a name is wrong: the trainer broadcasts them all, and a rank
        # that leaves the collective early would hang it.
        if load_format == "flattened_bucket":
            received = self._receive_flat(group, names, torch_dtypes, shapes)
        else:
            received = []
            with self._lock:
                for name, dtype, shape in zip(names, torch_dtypes, shapes, strict=True):
                    t = torch.empty(shape, dtype=dtype, device=self.device)
                    dist_group.broadcast(group, t, src=0)
                    received.append((name, t))
        kept = self._drop_draft(received)
        problems = [self._check(name, t) for name, t in kept]
        problems = [p for p in problems if p]
        if problems:
            return False, "Failed to update parameter online: " + "; ".join(problems)
        if load_format == "flattened_bucket" and len(set(torch_dtypes)) == 1 and kept and len(kept) == len(received):
            self._remember(body, [self.params[n] for n in names], torch_dtypes[0])
        return self._commit([self.params[n] for n, _ in kept], [t for _, t in kept],
                            [t for _, t in received], version, [n for n, _ in kept])

    def _target_group(self, group_name: str, body: dict) -> tuple[object | None, str]:
        """The named group (or None and SGLang's message), after `abort_all_requests` if asked."""
        group = self.groups.get(group_name)
        if group is None:
            return None, (f"Group {group_name} not in {sorted(self.groups)}. "
                          "Please call `init_weights_update_group` first.")
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
        return group, ""

    def _commit(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], keep: list[torch.Tensor],
                version: str | None, names: list[str]) -> tuple[bool, str]:
        with self.engine.weights_exclusive(), torch.no_grad():
            if dsts:  # none: a bucket of the draft model's tensors alone (_drop_draft)
                self._load(dsts, srcs, keep)
            if version is not None:
                self.weight_version = version
        return self._loaded(names, version)

    def _loaded(self, names: list[str], version: str | None) -> tuple[bool, str]:
        if self.memory is not None:
            self.memory.note_loaded(names)
        if self.adapters is not None:  # an adapted weight's new base: its adapter merged again
            self.adapters.base_written(names)
        message = "Succeeded to update parameter online."
        if version is not None:
            message += f" Weight version updated to {version}."
        return True, message

    def update_from_tensor(self, body: dict) -> tuple[bool, str]:
        entries = _field(body, "serialized_named_tensors", list)
        version = _field(body, "weight_version", str, None)
        load_format = body.get("load_format")
        if load_format not in (None, "direct"):
            raise RequestError(f"load_format: {load_format!r} is not supported by the embedded engine's "
                               "/update_weights_from_tensor (None: a list of (name, tensor) pairs)")
        if len(entries) != self.devices:
            raise RequestError(f"serialized_named_tensors: expected {self.devices} "
                               f"entr{'y' if self.devices == 1 else 'ies'} (one per device of the engine: "
                               f"--colocated-devices {self.devices}), got {len(entries)}")
        try:  # the entry of the device this engine computes on (see the module doc)
            received = deserialize_named_tensors(entries[0])
        except UnsafePayloadError as e:
            raise RequestError(str(e)) from e
        whole, received = received, self._drop_draft(received)
        problems = [p for p in (self._check(name, t) for name, t in received) if p]
        if not problems and self.device.type == "cpu":
            problems = _differing_entries(entries, whole)
        if problems:
            return False, "Failed to update parameter online: " + "; ".join(problems)
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
        with self.engine.weights_exclusive(), torch.no_grad():
            self.engine.wait_weights()
            if received:  # none: the draft model's tensors alone (_drop_draft)
                torch._foreach_copy_([self.params[n] for n, _ in received], [t for _, t in received])
            if self.device.type == "cuda":  # the sender's memory must not be read after we answer
                torch.cuda.synchronize(self.device)
            if version is not None:
                self.weight_version = version
        names = [n for n, _ in received]
        del received, whole  # drop the mapped IPC / shared-memory storages now
        return self._loaded(names, version)

    def update_from_disk(self, body: dict) -> tuple[bool, str]:
        """SGLang's /update_weights_from_disk: every tensor of the HF checkpoint folder `model_path` (its
        *.safetensors files) into the model, cast to the parameters' dtype; no session needed. Nothing is
        loaded when a tensor does not fit (SGLang loads and rolls back; the outcome is the same)."""
        from pathlib import Path

        from safetensors.torch import load_file

        folder = Path(_field(body, "model_path", str))
        version = _field(body, "weight_version", str, None)
        load_format = body.get("load_format")
        if load_format not in (None, "auto", "safetensors"):
            raise RequestError(f"load_format: {load_format!r} is not supported by the embedded engine's "
                               "/update_weights_from_disk (auto, safetensors)")
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if not files:
            return False, f"Failed to get weights iterator: no *.safetensors files in {folder}."
        received: list[tuple[str, torch.Tensor]] = []
        for f in files:
            received += load_file(str(f)).items()
        received = self._drop_draft(received)
        problems = [p for p in (self._check(name, t) for name, t in received) if p]
        if problems:
            return False, "Failed to update weights: " + "; ".join(problems)
        if body.get("abort_all_requests"):
            self.engine.abort(abort_all=True)
        with self.engine.weights_exclusive(), torch.no_grad():
            self.engine.wait_weights()
            for name, t in received:
                self.params[name].copy_(t)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            if version is not None:
                self.weight_version = version
        self._loaded([n for n, _ in received], version)
        return True, "Succeeded to update model weights." + (
            f" Weight version updated to {version}." if version is not None else "")

    def forget_plans(self) -> None:
        """Drop the cached bucket plans (their views): a memory release may give parameters new storage."""
        self._plans.clear()

    def _remember(self, body: dict, params: list[torch.Tensor], dtype: torch.dtype) -> None:
        """Cache a validated one-dtype flattened bucket whose parameters are all contiguous: later it
        is received and copied into 1-D views of the parameters, one split, no per-tensor view."""
        if not all(p.is_contiguous() and p.dtype == dtype for p in params):
            return
        if len(self._plans) >= 256:  # another model layout / bucket size each time: do not grow forever
            self._plans.clear()
        self._plans[_plan_key(body)] = _FlatPlan(dtype, [p.numel() for p in params],
                                                 sum(p.numel() for p in params) * dtype.itemsize,
                                                 [p.detach().view(-1) for p in params])

    def _update_planned(self, plan: _FlatPlan, body: dict) -> tuple[bool, str]:
        group_name = _field(body, "group_name", str, "weight_update_group")
        group, error = self._target_group(group_name, body)
        if group is None:
            return False, error
        flat = torch.empty(plan.nbytes, dtype=torch.uint8, device=self.device)
        with self._lock:
            dist_group.broadcast(group, flat, src=0)
        parts = flat.view(plan.dtype).split(plan.sizes)  # 1-D, as the parameters' cached views
        return self._commit(plan.dsts, list(parts), [flat], _field(body, "weight_version", str, None),
                            list(body["names"]))

    def _load(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor], keep: list[torch.Tensor]) -> None:
        """Copy into the parameters with one multi-tensor copy. On CUDA it runs on a side stream
        after the receive, and the engine's forwards wait for its event (Engine.weights_ready), so
        the NCCL receive of the next bucket, ordered after the default stream, is not held up by
        this copy. `keep`: the received buffers the sources live in."""
        if self.device.type != "cuda":
            torch._foreach_copy_(dsts, srcs)
            return
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(device=self.device)
        self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))  # the receive is done
        with torch.cuda.stream(self._copy_stream):
            torch._foreach_copy_(dsts, srcs)
        for t in keep:  # the receive buffer is freed by this thread: keep it until the copy ran
            t.record_stream(self._copy_stream)
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        self.engine.weights_ready = event

    def _receive_flat(self, group: object, names: list[str], dtypes: list[torch.dtype],
                      shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
        """One uint8 buffer: tensor i occupies bytes [offset_i, offset_i + numel_i * itemsize_i), in order;
        each offset must be a multiple of its dtype's item size (SGLang refuses unaligned buckets too)."""
        spans, offset = [], 0
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            if offset % dtype.itemsize:
                raise RequestError(f"names: {name} starts at byte {offset}, not aligned for {dtype}")
            size = torch.Size(shape).numel() * dtype.itemsize
            spans.append((name, dtype, shape, offset, offset + size))
            offset += size
        flat = torch.empty(offset, dtype=torch.uint8, device=self.device)
        with self._lock:
            dist_group.broadcast(group, flat, src=0)
        if len(set(dtypes)) == 1 and offset:  # the usual bucket: one split instead of a slice per tensor
            parts = flat.view(dtypes[0]).split([(b - a) // dtypes[0].itemsize for _, _, _, a, b in spans])
            return [(name, p.view(shape)) for (name, _, shape, _, _), p in zip(spans, parts, strict=True)]
        return [(name, flat[a:b].view(dtype).reshape(shape)) for name, dtype, shape, a, b in spans]

    def _drop_draft(self, received: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """`received` less the tensors of the multi-token-prediction layers (the draft model's; see __init__)."""
        if self._draft_from is None:
            return received
        return [(n, t) for n, t in received if not n.startswith("model.mtp_layers.")  # MiMo's names
                and not (n.startswith("model.layers.") and int(n.split(".")[2]) >= self._draft_from)]

    def _check(self, name: str, t: torch.Tensor) -> str | None:
        if self.memory is not None and self.memory.weights_released:
            return f"{name}: the weights are released; POST /resume_memory_occupation first"
        param = self.params.get(name)
        if param is None:
            return f"{name}: no such parameter in the model"
        if tuple(param.shape) != tuple(t.shape):
            return f"{name}: shape {list(t.shape)} does not match the model's {list(param.shape)}"
        return None

    def get_by_name(self, body: dict) -> list:
        name = _field(body, "name", str)
        truncate = _field(body, "truncate_size", int, 100)
        param = self.params.get(name)
        if param is None:
            raise RequestError(f"name: no parameter {name!r} in the model")
        if self.memory is not None and self.memory.weights_released:
            raise RequestError("the weights are released (/release_memory_occupation); resume and refill them first")
        with self.engine.model_lock:
            self.engine.wait_weights()
            return param.detach().float().cpu().tolist()[:truncate]


@dataclass
class _FlatPlan:
    dtype: torch.dtype
    sizes: list[int]  # elements per tensor, in order
    nbytes: int
    dsts: list[torch.Tensor]  # 1-D views of the parameters


def _plan_key(body: Any) -> tuple | None:
    """The request's layout (names, dtypes, shapes) as a hashable key; None if it is malformed
    (the full validation then names the field)."""
    try:
        key = (tuple(body["names"]), tuple(body["dtypes"]), tuple(tuple(s) for s in body["shapes"]))
        hash(key)
    except (TypeError, KeyError):
        return None
    return key


_MISSING = object()


def _field(body: Any, name: str, kind: type, default: Any = _MISSING) -> Any:
    """A typed field of a JSON body; a missing required or mistyped field is a 400 naming it."""
    if not isinstance(body, dict):
        raise RequestError("body: expected a JSON object")
    value = body.get(name)
    if value is None:
        if default is _MISSING:
            raise RequestError(f"{name}: required")
        return default
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise RequestError(f"{name}: expected {kind.__name__}")
    return value


def _differing_entries(entries: list, first: list[tuple[str, torch.Tensor]]) -> list[str]:
    """On CPU, where an entry names a shared-memory file and decoding it maps no other device's memory:
    the entries after the first that do not hold exactly the first one's tensors. They must all be
    equal: each trainer rank beside the engine gathers the full tensors (and with PP receives the other
    stages'), and an engine with tensor parallel gives each TP rank its own entry to shard from
    (SGLang's), so an entry that differs is a trainer-side error the first entry alone would hide."""
    problems = []
    for i, entry in enumerate(entries[1:], start=1):
        try:
            other = deserialize_named_tensors(entry)
        except UnsafePayloadError as e:
            raise RequestError(f"serialized_named_tensors[{i}]: {e}") from e
        same = [n for n, _ in other] == [n for n, _ in first] and all(
            a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(other, first, strict=True))
        if not same:
            problems.append(f"serialized_named_tensors[{i}] does not hold the same tensors as entry 0 (every device's "
                            "entry must hold the full tensors)")
    return problems
