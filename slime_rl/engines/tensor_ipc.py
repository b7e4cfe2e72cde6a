"""SGLang's `serialized_named_tensors` (UpdateWeightsFromTensorReqInput): tensors handed to an engine
on the same host IN PLACE, by reference, not by value.

Format (SGLang's MultiprocessingSerializer): one string per engine TP rank, each the base64 of a
`multiprocessing.reduction.ForkingPickler` dump of `[(hf_name, tensor), ...]`. torch's reducers
(torch.multiprocessing.reductions) turn a tensor into a handle of its storage:
- CUDA: a CUDA IPC handle of the allocation (`rebuild_cuda_tensor`); the receiver maps the sender's
  memory. The device is named by its UUID, not by its index (as SGLang's `monkey_patch_torch_reductions`
  does, srt/utils/patch_torch.py): the trainer rank sees its GPU as cuda:0, the engine's TP rank i may
  see the same GPU as cuda:i (an engine of N GPUs sees all N), so the receiver maps the UUID to its own
  index. SGLang's receiver does so after its patch; `RestrictedUnpickler` does it here.
- CPU: with torch's "file_system" sharing strategy, the name of a shared-memory file under /dev/shm
  plus the sender's torch_shm_manager socket (`rebuild_storage_filename`). This works between any
  two processes of one host; torch's default "file_descriptor" strategy passes fds over a socket of
  the sender's multiprocessing manager, which an unrelated process (the engine) cannot join, so the
  sender must call `use_file_system_sharing()` (process-wide) before serializing CPU tensors.
The sender must keep the tensors alive until the engine has answered (the engine copies them into its
parameters before answering).

Decoding never runs a plain `pickle.loads` on what came over HTTP: `RestrictedUnpickler` resolves only
torch's rebuild functions, its storage classes, `torch.Size`, `torch.Tensor`, `torch.device` and dtypes
(and a storage's bytes, read by `torch.load(weights_only=True)`, for `serialize_by_value`'s entries);
any other global is refused with `UnsafePayloadError`.
"""

from __future__ import annotations

import base64
import binascii
import collections
import importlib
import io
import pickle
import threading
from collections.abc import Sequence
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing
import torch.multiprocessing.reductions  # noqa: F401 (registers torch's reducers with ForkingPickler)

_REDUCTIONS = "torch.multiprocessing.reductions"
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    (_REDUCTIONS, "rebuild_tensor"),            # CPU tensor over a shared storage
    (_REDUCTIONS, "rebuild_cuda_tensor"),       # CUDA tensor over an IPC handle
    (_REDUCTIONS, "rebuild_typed_storage"),
    (_REDUCTIONS, "rebuild_storage_filename"),  # CPU storage, "file_system" strategy
    (_REDUCTIONS, "rebuild_storage_empty"),     # a storage of 0 bytes
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch", "device"),
    # tensors BY VALUE (`serialize_by_value`): a plain pickle carries each storage's bytes
    ("torch._utils", "_rebuild_tensor_v2"),
    ("collections", "OrderedDict"),             # _rebuild_tensor_v2's (empty) backward hooks
})


# rebuild_cuda_tensor's storage_device argument (SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX)
_DEVICE_ARG = 6


def _device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def _reduce_tensor_by_uuid(tensor: torch.Tensor) -> tuple:
    """torch's reducer, with a CUDA tensor's device index replaced by the device's UUID."""
    rebuild, args = torch.multiprocessing.reductions.reduce_tensor(tensor)
    if rebuild is torch.multiprocessing.reductions.rebuild_cuda_tensor and isinstance(args[_DEVICE_ARG], int):
        args = (*args[:_DEVICE_ARG], _device_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1:])
    return rebuild, args


def _rebuild_cuda_tensor_by_uuid(*args: object) -> torch.Tensor:
    """torch's rebuild_cuda_tensor for a handle whose device is a UUID (or, from an older sender, an
    index): the UUID becomes the index under which this process sees that device."""
    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        found = [i for i in range(torch.cuda.device_count()) if _device_uuid(i) == device]
        if not found:
            raise UnsafePayloadError(f"serialized_named_tensors: CUDA device {device} is not visible to this engine "
                                     f"(it sees {torch.cuda.device_count()})")
        args = (*args[:_DEVICE_ARG], found[0], *args[_DEVICE_ARG + 1:])
    return torch.multiprocessing.reductions.rebuild_cuda_tensor(*args)


class UnsafePayloadError(ValueError):
    """serialized_named_tensors holds something other than named tensors (or an unknown global)."""


class RestrictedUnpickler(pickle.Unpickler):
    """An Unpickler whose `find_class` resolves only ALLOWED_GLOBALS and `torch.<dtype>`."""

    def find_class(self, module: str, name: str) -> object:
        if (module, name) == (_REDUCTIONS, "rebuild_cuda_tensor"):
            return _rebuild_cuda_tensor_by_uuid
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _storage_from_bytes
        if (module, name) in ALLOWED_GLOBALS:
            return getattr(importlib.import_module(module), name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafePayloadError(f"serialized_named_tensors: global {module}.{name} is not allowed (only torch's "
                                 "tensor/storage rebuild functions, storage classes, Size, device and dtypes)")


def _storage_from_bytes(data: bytes) -> torch.UntypedStorage | torch.TypedStorage:
    """torch.storage._load_from_bytes without its plain `torch.load`: weights_only, and a storage or nothing.
    What `RestrictedUnpickler` reads that name as, and what `serialize_by_value` pickles under it."""
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, (torch.UntypedStorage, torch.TypedStorage)):
        raise UnsafePayloadError(f"serialized_named_tensors: a storage's bytes hold a {type(storage).__name__}")
    return storage


_storage_from_bytes.__module__, _storage_from_bytes.__name__ = "torch.storage", "_load_from_bytes"
_storage_from_bytes.__qualname__ = "_load_from_bytes"
_NAMING = threading.Lock()  # serialize_by_value's moment of naming torch.storage._load_from_bytes


class _ByValuePickler(pickle.Pickler):
    """A plain pickle of CPU tensors carrying their bytes: a tensor as torch's `_rebuild_tensor_v2` of its
    storage, the views of one storage sharing one copy of its bytes (one wrapper object per storage, so the
    memo answers the later ones), a storage as `torch.storage._load_from_bytes` of its legacy torch.save
    bytes, as torch pickles one."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self._storages: dict[tuple[int, torch.dtype], torch.storage.TypedStorage] = {}

    def reducer_override(self, obj: object) -> object:
        if type(obj) is torch.Tensor and obj.layout == torch.strided and obj.device.type == "cpu":
            key = (obj.untyped_storage().data_ptr(), obj.dtype)
            storage = self._storages.setdefault(key, obj._typed_storage())
            return torch._utils._rebuild_tensor_v2, (storage, obj.storage_offset(), tuple(obj.size()), obj.stride(),
                                                     False, collections.OrderedDict())
        if isinstance(obj, torch.storage.TypedStorage):
            buf = io.BytesIO()
            torch.save(obj, buf, _use_new_zipfile_serialization=False)  # as TypedStorage.__reduce__ does
            return _storage_from_bytes, (buf.getvalue(),)
        return NotImplemented


def serialize_by_value(named: dict[str, torch.Tensor]) -> str:
    """One entry of serialized_named_tensors that carries the tensors' bytes (a plain pickle of {name: CPU
    tensor}): any host decodes it, SGLang's SafeUnpickler and `deserialize_named_tensors` alike. For what is
    small enough to copy (LoRA adapters); the weights go by reference."""
    by_dtype: dict[torch.dtype, list[tuple[str, torch.Tensor]]] = {}
    for n, t in named.items():
        by_dtype.setdefault(t.dtype, []).append((str(n), t.detach()))
    views: dict[str, torch.Tensor] = {}
    for group in by_dtype.values():  # one buffer per dtype, the tensors views of it: one storage's bytes each
        flat = torch.empty(sum(t.numel() for _, t in group), dtype=group[0][1].dtype)
        offset = 0
        for n, t in group:
            views[n] = flat[offset:offset + t.numel()].view(t.shape)
            views[n].copy_(t)
            offset += t.numel()
    buf = io.BytesIO()
    # pickle names a function by its module's attribute, which must be the function itself: torch's name
    # holds ours while the dump runs (megatron-core replaced it with its own, a global receivers refuse)
    with _NAMING:
        kept, torch.storage._load_from_bytes = torch.storage._load_from_bytes, _storage_from_bytes
        try:
            _ByValuePickler(buf, pickle.HIGHEST_PROTOCOL).dump({n: views[n] for n in named})
        finally:
            torch.storage._load_from_bytes = kept
    return base64.b64encode(buf.getvalue()).decode("ascii")


def use_file_system_sharing() -> None:
    """CPU tensors are shared through named /dev/shm files (see the module doc). Process-wide."""
    if torch.multiprocessing.get_sharing_strategy() != "file_system":
        torch.multiprocessing.set_sharing_strategy("file_system")


def serialize_named_tensors(named: Sequence[tuple[str, torch.Tensor]]) -> str:
    """One entry of serialized_named_tensors. CUDA tensors: the pending work on the current stream
    is waited for first, so the engine never reads a buffer that is still being filled; the device
    is named by its UUID (see the module doc). CPU tensors
    must live in shared memory (`share_memory_()` after `use_file_system_sharing()`), or
    ForkingPickler moves them there itself (a copy)."""
    if any(t.is_cuda for _, t in named):
        torch.cuda.current_stream().synchronize()
    if any(not t.is_cuda for _, t in named) and torch.multiprocessing.get_sharing_strategy() != "file_system":
        raise RuntimeError("CPU tensors need torch's 'file_system' sharing strategy: call "
                           "use_file_system_sharing() first (fd passing does not reach the engine process)")
    buf = io.BytesIO()
    pickler = ForkingPickler(buf, pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor_by_uuid  # detach() gives plain tensors
    pickler.dump([(str(n), t.detach()) for n, t in named])
    return base64.b64encode(buf.getvalue()).decode("ascii")


def deserialize_named_tensors(entry: object) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `serialize_named_tensors`, through RestrictedUnpickler; the result is checked
    to be a list of (str, Tensor) pairs. Raises UnsafePayloadError naming what is wrong."""
    if isinstance(entry, str):
        try:
            raw = base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError) as e:
            raise UnsafePayloadError(f"serialized_named_tensors: not valid base64 ({e})") from e
    else:
        raise UnsafePayloadError(f"serialized_named_tensors: expected a base64 string per TP rank, got "
                                 f"{type(entry).__name__}")
    try:
        named = RestrictedUnpickler(io.BytesIO(raw)).load()
    except UnsafePayloadError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, RuntimeError) as e:
        raise UnsafePayloadError(f"serialized_named_tensors: cannot decode ({type(e).__name__}: {e})") from e
    if isinstance(named, dict):
        named = list(named.items())
    if not isinstance(named, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and isinstance(p[0], str) and isinstance(p[1], torch.Tensor)
            for p in named):
        raise UnsafePayloadError("serialized_named_tensors: expected a list of (name, tensor) pairs")
    return [(n, t) for n, t in named]
