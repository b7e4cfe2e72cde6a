"""Before/after evidence for each cpu_compat patch, in a fresh process (the patches are global).

    python -m tests.trainer.cpu_compat_probe   -> prints one JSON line: {patch: {before, after}}

`before` is the error megatron/torch raises without the patch (None would mean the patch is not
needed); `after` holds what the patched call returned. Triton is hidden first, to show the
paged_stash stub is what lets megatron import on machines without it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch


def attempt(fn: Callable[[], Any]) -> tuple[Any, str | None]:
    try:
        return fn(), None
    except Exception as e:  # any error: the report records which one the unpatched call raises
        return None, f"{type(e).__name__}: {e}"[:300]


def main() -> None:
    from slime_rl.trainer import cpu_compat

    assert not torch.cuda.is_available(), "the probe shows CPU behaviour"
    res: dict[str, dict] = {}

    # paged_stash: with triton unimportable, megatron.core fails to import unless stubbed
    sys.modules["triton"] = None  # makes `import triton` raise ImportError
    _, before = attempt(lambda: __import__("megatron.core"))
    for name in [m for m in sys.modules if m == "megatron" or m.startswith("megatron.")]:
        del sys.modules[name]
    cpu_compat.apply(only=("paged_stash",))
    _, after_err = attempt(lambda: __import__("megatron.core.pipeline_parallel"))
    res["paged_stash"] = {"before": before, "after_error": after_err}

    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    # rng: the tracker stores/restores CUDA generator states
    def fork_draw(seed: int) -> list[float]:
        tracker = CudaRNGStatesTracker()
        tracker.add("model-parallel-rng", seed)
        with tracker.fork("model-parallel-rng"):
            return torch.rand(3).tolist()

    _, before = attempt(lambda: fork_draw(7))
    cpu_compat.apply(only=("rng",))
    torch.manual_seed(0)
    outside = torch.get_rng_state()
    first, err = attempt(lambda: fork_draw(7))
    res["rng"] = {"before": before, "after_error": err, "same_seed_same_draw": first == fork_draw(7),
                  "other_seed_differs": first != fork_draw(8),
                  "default_state_restored": bool(torch.equal(outside, torch.get_rng_state()))}

    # current_device: allocation device of ~200 megatron call sites
    _, before = attempt(lambda: torch.cuda.current_device())
    cpu_compat.apply(only=("current_device",))
    t, err = attempt(lambda: torch.empty(2, device=torch.cuda.current_device()))
    res["current_device"] = {"before": before, "after_error": err, "device": str(t.device) if t is not None else None}

    # device_mode: device="cuda" allocations and the optimizer's tensor.type() asserts
    def clip() -> float:
        p = torch.nn.Parameter(torch.ones(4))
        p.grad = torch.full((4,), 2.0)
        clip_grad_by_total_norm_fp32([p], max_norm=1.0, total_norm=10.0)
        return float(p.grad[0])

    _, before = attempt(clip)
    _, before_alloc = attempt(lambda: torch.zeros(2, device="cuda"))
    cpu_compat.apply(only=("device_mode",))
    depth = torch._C._len_torch_function_stack()
    cpu_compat.apply(only=("device_mode",))  # idempotent: no second mode on this thread
    clipped, err = attempt(clip)
    x = torch.zeros(2, device="cuda")
    res["device_mode"] = {
        "before": before, "before_alloc": before_alloc, "after_error": err, "clipped_grad": clipped,
        "alloc_device": str(x.device), "to_cuda": str(x.to("cuda").device), "cuda_is_self": x.cuda() is x,
        "type": x.type(), "cast": x.type("torch.cuda.DoubleTensor").dtype == torch.float64,
        "stack_depth_stable": depth == torch._C._len_torch_function_stack(),
    }

    # streams: DDP's grad sync waits on torch.cuda.current_stream()
    def use_streams() -> bool:
        s = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(s)
        ev = torch.cuda.Event()
        ev.record()
        with torch.cuda.stream(side):
            torch.cuda.synchronize()
        return ev.query()

    _, before = attempt(use_streams)
    cpu_compat.apply(only=("streams",))
    ok, err = attempt(use_streams)
    res["streams"] = {"before": before, "after_error": err, "ok": ok}

    # moe_splits: the alltoall dispatcher's split sizes must reach all_to_all_single as numpy
    from megatron.core.transformer.moe import moe_utils

    splits = torch.tensor([3, 1])
    before_type = type(moe_utils.maybe_move_tensor_to_cpu(splits, as_numpy=True)).__name__
    cpu_compat.apply(only=("moe_splits",))
    from megatron.core.transformer.moe import token_dispatcher

    moved = token_dispatcher.maybe_move_tensor_to_cpu(splits, as_numpy=True)
    kept = moe_utils.maybe_move_tensor_to_cpu(splits)
    res["moe_splits"] = {"before": before_type, "after": type(moved).__name__, "values": moved.tolist(),
                         "tensor_kept": torch.is_tensor(kept)}

    cpu_compat.apply()  # the full set on top: still idempotent
    res["applied"] = sorted(cpu_compat.applied())

    # on_rank_thread: the device mode is per thread; a method called from another thread gets it
    # from the decorator (a plain function on that thread does not have it), generators included
    import threading

    from slime_rl.trainer.mcore import on_rank_thread

    def alloc() -> str:
        return str(torch.zeros(1, device="cuda").device)

    @on_rank_thread
    def decorated_gen():
        yield alloc()

    thread_res: dict[str, Any] = {}

    def on_thread() -> None:
        thread_res["plain_error"] = attempt(alloc)[1]
        thread_res["generator"] = next(decorated_gen())
        thread_res["decorated"] = on_rank_thread(alloc)()

    fresh = threading.Thread(target=on_thread)  # the generator first: it must not rely on a previous call
    fresh.start()
    fresh.join()
    res["on_rank_thread"] = thread_res
    print(json.dumps(res))


if __name__ == "__main__":
    main()
