"""Run megatron-core 0.19.x on a CPU-only torch (gloo backend): the CPU compatibility layer.

megatron-core assumes CUDA in a few dozen places that have nothing to do with the math: the RNG
tracker saves/restores the CUDA generator, ~200 call sites allocate on
`torch.cuda.current_device()`, schedules and the optimizer create tensors with device="cuda",
the optimizer and grad clipping assert `tensor.type() == 'torch.cuda.FloatTensor'`, and the DDP
grad-sync path calls `torch.cuda.current_stream()` unconditionally. Each patch below removes one
of those assumptions. `apply()` runs all of them; it is a no-op when CUDA is available, so the
GPU path runs megatron untouched. Call it before building any model (megatron may already be
imported, except for the triton stub which must precede the first megatron import).

The device-rewriting TorchFunctionMode is pushed for the life of the process and is thread-local;
CPU autograd runs the backward pass on the calling thread, so backward hooks see it too. Only
trainer processes call `apply()`: it changes global torch state and must not run inside a
process that also needs the real `Tensor.type()` (e.g. a pytest process running other rooms).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import threading
import types
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

_PAGED_STASH = "megatron.core.transformer.moe.ops.paged_stash"
_applied: set[str] = set()
_thread = threading.local()  # TorchFunctionModes are per thread: which threads have one pushed


def _is_cuda_device(device: Any) -> bool:
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    # torch reads a bare int device as cuda:<int>
    return isinstance(device, int) and not isinstance(device, bool)


class CudaToCpuMode(TorchFunctionMode):
    """Rewrite device="cuda" / .cuda() / .to("cuda") to CPU and report CUDA tensor types.

    `Tensor.type()` with no argument returns the CUDA name ('torch.cuda.FloatTensor') because the
    megatron optimizer and clip_grads assert on it; `Tensor.type('torch.cuda.X')` casts to the CPU
    type instead.
    """

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):  # pinning needs a CUDA driver (RoPE's CP slicing asks for it)
            kwargs["pin_memory"] = False
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        if func is torch.Tensor.type:
            if len(args) == 1 and not kwargs:
                name = func(args[0])
                return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
            if len(args) > 1 and isinstance(args[1], str):
                args = (args[0], args[1].replace("torch.cuda.", "torch."), *args[2:])
        return func(*args, **kwargs)


class _NoopStream:
    """Stands in for torch.cuda.Stream: CPU ops are synchronous, so every wait is already done."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_event(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record_event(self, *args: Any, **kwargs: Any) -> _NoopEvent:
        return _NoopEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, 0)

    def __enter__(self) -> _NoopStream:
        return self

    def __exit__(self, *exc: Any) -> bool:
        return False


class _NoopEvent:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def patch_rng() -> None:
    """CUDA RNG tracker -> the CPU default generator.

    `model_parallel_cuda_manual_seed` and `CudaRNGStatesTracker.add/fork` read and write the CUDA
    generator state, which raises without a GPU. Each tracked state becomes a CPU generator state.
    (torch.manual_seed itself calls torch.cuda.manual_seed_all, which is lazy on CPU: left alone.)
    """
    cpu_get, cpu_set = torch.get_rng_state, torch.set_rng_state

    def get_state(device: Any = "cuda") -> torch.Tensor:
        return cpu_get()

    def set_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        cpu_set(new_state)

    def manual_seed(seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    torch.cuda.get_rng_state = torch.cuda.random.get_rng_state = get_state
    torch.cuda.set_rng_state = torch.cuda.random.set_rng_state = set_state
    torch.cuda.manual_seed = torch.cuda.random.manual_seed = manual_seed
    import megatron.core.tensor_parallel.random as mrandom

    mrandom._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: cpu_get()
    mrandom._set_cuda_rng_state = lambda new_state, device=-1, graph_safe=False: cpu_set(new_state)
    # fork() compares the CPU state before/after to catch CPU randomness inside a CUDA-RNG region;
    # here the two generators are the same one, so it would warn on every dropout call.
    logging.getLogger(mrandom.__name__).setLevel(logging.ERROR)


def patch_current_device() -> None:
    """torch.cuda.current_device() -> cpu (used as an allocation device all over megatron)."""
    torch.cuda.current_device = lambda: torch.device("cpu")


def patch_device_mode() -> None:
    """Push CudaToCpuMode on this thread for the life of the thread (see the class docstring)."""
    if getattr(_thread, "mode", None) is None:
        _thread.mode = CudaToCpuMode()
        _thread.mode.__enter__()


def patch_streams() -> None:
    """CUDA streams/events/synchronize -> no-ops (DDP's grad sync asks for the current stream)."""
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.cuda.current_stream = lambda *args, **kwargs: _NoopStream()
    torch.cuda.default_stream = lambda *args, **kwargs: _NoopStream()
    torch.cuda.Stream = _NoopStream
    torch.cuda.Event = _NoopEvent
    torch.cuda.stream = lambda *args, **kwargs: contextlib.nullcontext()


def patch_moe_splits() -> None:
    """MoE alltoall dispatcher: the split sizes as numpy arrays, as on GPU.

    megatron's `maybe_move_tensor_to_cpu(t, as_numpy=True)` converts only CUDA tensors (to a CPU
    numpy array); a CPU tensor stays a tensor, which torch.distributed.all_to_all_single refuses as
    split sizes. The patched function gives the numpy array for CPU tensors too."""
    import megatron.core.transformer.moe.moe_utils as moe_utils
    import megatron.core.transformer.moe.token_dispatcher as token_dispatcher

    original = moe_utils.maybe_move_tensor_to_cpu

    def move(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = move


def patch_uneven_collectives() -> None:
    """all_gather / reduce_scatter with tensors of different sizes, which gloo refuses (NCCL runs
    them): megatron's MoE alltoall dispatcher under TP gathers (and, in the backward,
    reduce-scatters) each rank's share of the tokens routed here, and the shares differ. Equal
    sizes gather on torch's own path, uneven ones are padded to the largest and sliced back; a list
    reduce-scatter (gloo has none) is summed whole and sliced. Same values as NCCL's; the tensors are tiny on CPU."""
    all_gather, reduce_scatter = dist.all_gather, dist.reduce_scatter

    def uneven_all_gather(tensor_list: list, tensor: torch.Tensor, group: Any = None, async_op: bool = False):
        if len({tuple(t.shape) for t in tensor_list}) <= 1 or async_op:
            return all_gather(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        padded = tensor.new_zeros((rows, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        got = [torch.empty_like(padded) for _ in tensor_list]
        all_gather(got, padded, group=group)
        for dst, src in zip(tensor_list, got, strict=True):
            dst.copy_(src[: dst.shape[0]])
        return None

    def uneven_reduce_scatter(output: torch.Tensor, input_list: list, op: Any = dist.ReduceOp.SUM, group: Any = None,
                              async_op: bool = False):
        if async_op:
            return reduce_scatter(output, input_list, op=op, group=group, async_op=async_op)
        flat = torch.cat([t.reshape(-1) for t in input_list])
        dist.all_reduce(flat, op=op, group=group)
        rank = dist.get_rank(group)
        start = sum(t.numel() for t in input_list[:rank])
        output.copy_(flat[start:start + input_list[rank].numel()].view_as(output))
        return None

    dist.all_gather, dist.reduce_scatter = uneven_all_gather, uneven_reduce_scatter


def stub_paged_stash_if_no_triton() -> bool:
    """Register a stub for megatron's paged_stash module when triton cannot be imported.

    megatron-core 0.19 imports triton unconditionally in exactly one module (MoE paged stash,
    reached from pipeline_parallel.schedules <- megatron.core); every other triton use is guarded.
    Must run before the first megatron import. Returns True when the stub was installed.
    """
    if importlib.util.find_spec("triton") is not None:
        return False
    stub = types.ModuleType(_PAGED_STASH)
    stub.GLOBAL_BLOCK_SIZE = 1024
    stub.paged_stash_copy_kernel = None
    stub.paged_stash_pop_kernel = None
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]
    sys.modules[_PAGED_STASH] = stub
    return True


@contextlib.contextmanager
def eager_jit_fuser():
    """While megatron is first imported on CPU, `torch.compile` is an identity decorator.

    megatron-core's `jit_fuser` is `torch.compile` (megatron/core/jit.py, bound when that module is
    imported) and decorates fused activations, norms and router helpers at import time. Decorating
    alone imports torch._dynamo and torch._inductor, ~1.5-2.7 s of CPU in every rank process, and a
    decorated function that runs on CPU is traced and compiled by inductor on its first call. On CPU
    the trainer runs them eagerly: `jit_fuser` keeps the identity for the life of the process, and
    torch.compile is itself again once the block ends. A no-op when CUDA is available or megatron's
    jit module is already imported (its `jit_fuser` is bound then).
    """
    if torch.cuda.is_available() or "megatron.core.jit" in sys.modules:
        yield
        return
    compile_fn = torch.compile

    def identity(model: Any = None, **_: Any) -> Any:
        return model if model is not None else (lambda fn: fn)

    torch.compile = identity
    try:
        yield
    finally:
        torch.compile = compile_fn


PATCHES = {
    "paged_stash": stub_paged_stash_if_no_triton,
    "rng": patch_rng,
    "current_device": patch_current_device,
    "device_mode": patch_device_mode,
    "streams": patch_streams,
    "moe_splits": patch_moe_splits,
    "uneven_collectives": patch_uneven_collectives,
}


def apply(only: tuple[str, ...] | None = None) -> None:
    """Apply the CPU patches (all, or the named ones); idempotent; no-op when CUDA is available.

    The process-wide patches run once; the device mode is pushed once per calling thread, so a
    host that calls the trainer from another thread (e.g. an actor's executor) calls apply() again.
    """
    if torch.cuda.is_available():
        return
    for name in only or tuple(PATCHES):
        if name not in _applied or name == "device_mode":
            PATCHES[name]()
            _applied.add(name)


def applied() -> frozenset[str]:
    return frozenset(_applied)
