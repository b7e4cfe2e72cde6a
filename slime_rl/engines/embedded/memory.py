"""SGLang's /release_memory_occupation and /resume_memory_occupation on the embedded engine, for
colocated mode (trainer and engine on the same device: the engine gives its memory back while the
trainer trains).

Tags (ReleaseMemoryOccupationReqInput.tags / ResumeMemoryOccupationReqInput.tags): SGLang 0.5.23's
memory-saver tags "weights", "kv_cache", "cuda_graph" (srt/constants.py); None or [] means all three.
As SGLang's SchedulerWeightUpdaterManager does, a release records any tag (one it does not know frees
nothing), and a resume of a tag that is not released is an error (SGLang: a KeyError, answered 400).
- "weights": the parameters live in one storage (`pack_parameters`, done once at start), which is
  resized to 0 bytes; the Parameter objects stay (views of it), so the model's structure and the
  names the weight sync uses stay too.
  Buffers that are not weights (rotary inv_freq, ...) are kept: they are small and never synced.
- "cuda_graph": recorded; the captured graphs and their memory pool are KEPT (see below).
- "kv_cache": releasing it aborts whatever is running (which frees the dynamic path's per-batch
  cache) and frees the static path's preallocated slot cache.
Releasing anything aborts running requests and makes the engine refuse /generate (503, with a message
saying what to do) until it is resumed. On CUDA the freed blocks go back to the driver (empty_cache).

Resuming "weights" re-allocates the storages WITHOUT their old contents (SGLang drops released weights
unless --enable-weights-cpu-backup): the weights must be refilled by /update_weights_from_tensor (or
/update_weights_from_distributed) before the engine serves again; until every tensor has been
refilled, /generate answers 503 naming how many are missing. With `cpu_backup` (the flag) a release
keeps a host copy of every storage and the resume restores it: nothing to refill.

On the static-cache path (engine.py: slots.py, graphs.py) a release of any tag frees the slot KV cache
(one storage too; re-allocated and zeroed by the first prefill after the resume) and keeps the CUDA
graphs: a graph bakes in the parameters' and the cache's addresses, and a same-size re-allocation of
one storage usually returns the same address, so the graphs stay valid and nothing is captured
again. SGLang gets the same through torch_memory_saver, which keeps virtual addresses and unmaps the
physical memory. Before its first replay after a release the decoder compares every address its
graphs baked in with the current ones and drops the graphs if any moved (stats
`graphs_kept_after_release` / `graphs_dropped_moved`). The graphs' own pool (per graph: one decode
step's activations and its logits, batch x vocabulary floats) stays allocated through a release.
"""

from __future__ import annotations

import itertools
import threading

import torch

from slime_rl.engines.embedded.engine import Engine
from slime_rl.engines.embedded.sampling import RequestError

TAGS = ("weights", "kv_cache", "cuda_graph")


def _region(p: torch.Tensor) -> tuple[int, int, int]:
    """The bytes of its storage a parameter (or a view of one) covers: (storage, first byte, end).
    Tied parameters and another name or shape for the same bytes are one region; a checkpoint name
    for one part of a fused parameter (an MoE expert's gate rows of `mlp.experts.gate_up_proj`,
    engines/embedded/experts.py) is a region inside the parameter's, which the parts fill."""
    start = p.storage_offset() * p.element_size()
    return p.untyped_storage().data_ptr(), start, start + p.numel() * p.element_size()


def _parts(regions: set[tuple[int, int, int]]) -> dict[tuple[int, int, int], list[tuple[int, int, int]]]:
    """{region: the regions inside it} for the regions that contain others (views of parameters
    are nested or disjoint: in (storage, start, -end) order a region's parts follow it directly)."""
    order = sorted(regions, key=lambda r: (r[0], r[1], -r[2]))
    out = {}
    for i, r in enumerate(order):
        inner = list(itertools.takewhile(lambda q, r=r: q[0] == r[0] and q[1] < r[2], order[i + 1:]))
        if inner:
            out[r] = inner
    return out


ALIGN = 256  # bytes: every parameter's storage starts at a multiple of this in the arena


def pack_parameters(groups: list[list[torch.nn.Parameter]], device: torch.device) -> torch.UntypedStorage:
    """Move the parameters into ONE storage (the arena): each group of parameters sharing a storage
    (tied weights) gets its storage's bytes at an aligned offset, and every parameter becomes the
    same view of the arena it was of its own storage (ties kept). A release then frees one storage
    and a resume re-allocates one: every parameter's address moves by the same amount or, as a
    same-size allocation usually lands where the last one was, not at all, which is what lets the
    CUDA graphs (they bake the addresses in) survive a release/resume (graphs.py)."""
    offsets, total = [], 0
    for group in groups:
        total = -(-total // ALIGN) * ALIGN
        offsets.append(total)
        total += group[0].untyped_storage().nbytes()
    arena = torch.UntypedStorage(total, device=device)
    flat = torch.empty(0, dtype=torch.uint8, device=device).set_(arena)
    with torch.no_grad():
        for group, off in zip(groups, offsets, strict=True):
            old = group[0].untyped_storage()
            flat[off:off + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8, device=device).set_(old))
            for p in group:
                p.data = torch.empty(0, dtype=p.dtype, device=device).set_(
                    arena, off // p.element_size() + p.storage_offset(), p.shape, p.stride())
    return arena


class MemoryOccupation:
    def __init__(self, engine: Engine, params: dict[str, torch.nn.Parameter], cpu_backup: bool = False) -> None:
        self.engine = engine
        self.cpu_backup = cpu_backup
        self._backup: list[torch.UntypedStorage] = []  # host copies of the released storages (cpu_backup)
        self.device = engine.device
        groups: dict[int, list[torch.nn.Parameter]] = {}
        for p in params.values():
            groups.setdefault(p.untyped_storage().data_ptr(), []).append(p)
        # a checkpoint alias names the same Parameter twice: pack each Parameter once
        self._arena = pack_parameters([list({id(p): p for p in g}.values()) for g in groups.values()], self.device)
        # what a refill must cover: every region of a name that no other name's region lies inside (a fused
        # MoE parameter is refilled by the per-expert names inside it, which are what weight sync sends)
        self._key_of = {name: _region(p) for name, p in params.items()}
        self._inside = _parts(set(self._key_of.values()))
        self._leaves = {r for r in self._key_of.values() if r not in self._inside}
        self.weights_total_bytes = self._arena.nbytes()
        self.released: set[str] = set()
        self._missing: set[tuple] = set()  # views re-allocated by a resume and not refilled since
        self._lock = threading.Lock()

    @property
    def weights_released(self) -> bool:
        return "weights" in self.released

    def weights_bytes(self) -> int:
        """Bytes the parameters hold now (0 after a release of "weights")."""
        return self._arena.nbytes()

    def release(self, body: dict) -> None:
        tags = _tags(body)
        with self._lock:
            self.engine.set_unavailable(self._message(self.released | set(tags)))  # aborts, waits until idle
            with self.engine.model_lock:
                self.engine.wait_weights()
                # the static KV cache is freed; its graphs are kept and checked before their next replay
                self.engine.drop_static_state()
                if "weights" in tags and not self.weights_released:
                    if self.cpu_backup:
                        host = self._arena.cpu()
                        self._backup = [host.clone() if self.device.type == "cpu" else host]
                    self._arena.resize_(0)
                self.released |= set(tags)
            self._empty_cache()

    def resume(self, body: dict) -> None:
        tags = _tags(body)
        with self._lock:
            not_released = [t for t in tags if t not in self.released]
            if not_released:  # SGLang: offload_tags.remove(tag) raises KeyError, answered 400
                raise RequestError(f"tags: {not_released} are not released (released: {sorted(self.released)})")
            with self.engine.model_lock:
                if "weights" in tags:
                    self._arena.resize_(self.weights_total_bytes)
                    if self._backup:  # --enable-weights-cpu-backup: the old contents come back
                        self._arena.copy_(self._backup.pop())
                    else:
                        self._missing = set(self._leaves)
                self.released -= set(tags)
            self.engine.set_unavailable(self._message(self.released))

    def note_loaded(self, names: list[str]) -> None:
        """Weights were copied into these parameters: once every re-allocated one is refilled (and
        nothing is released), the engine serves again."""
        with self._lock:
            if not self._missing:
                return
            for n in names:
                region = self._key_of.get(n)
                if region is not None:
                    self._missing.discard(region)
                    self._missing.difference_update(self._inside.get(region, ()))
            self.engine.set_unavailable(self._message(self.released))

    def info(self) -> dict:
        """Reported in /get_server_info as "memory_occupation" (the GPU test compares the numbers)."""
        cuda = self.device.type == "cuda"
        return {"released_tags": sorted(self.released), "weights_bytes": self.weights_bytes(),
                "weights_total_bytes": self.weights_total_bytes, "weights_to_refill": len(self._missing),
                "cuda_allocated_bytes": torch.cuda.memory_allocated(self.device) if cuda else None,
                "cuda_reserved_bytes": torch.cuda.memory_reserved(self.device) if cuda else None}

    def _message(self, released: set[str]) -> str | None:
        released = released & set(TAGS)  # a tag SGLang does not know is recorded but frees nothing
        if released:
            return (f"engine memory is released (tags {sorted(released)}): POST /resume_memory_occupation, then "
                    "refill the weights with /update_weights_from_tensor before generating")
        if self._missing:
            return (f"weights were re-allocated by /resume_memory_occupation but {len(self._missing)} of "
                    f"{len(self._leaves)} tensors are not refilled yet: send them with "
                    "/update_weights_from_tensor or /update_weights_from_distributed")
        return None

    def _empty_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def _tags(body: object) -> list[str]:
    tags = body.get("tags") if isinstance(body, dict) else None
    if not tags:  # None or []: every tag, as SGLang
        return list(TAGS)
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise RequestError("tags: expected a list of strings")
    return list(dict.fromkeys(tags))
