"""A generate request inside the embedded engine and what the scheduler finishes it with.

`GenRequest` is one request as the scheduler holds it (its inputs, its sampling parameters, and the
results the scheduler thread writes); `Sampled` is one sampling of the running rows on its way to the
host; `abort_reason` is SGLang's abort finish reason; `device_wide` tells an error that is no
request's fault (the whole batch fails) from one that fails its request alone.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from slime_rl.engines.embedded.batch import Row
from slime_rl.engines.embedded.sampling import HostCopy, SamplingParams


@dataclass
class GenRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    generator: torch.Generator | None = None
    # images (vision-language models): processor outputs for the image pads in input_ids
    pixel_values: torch.Tensor | None = None
    image_grid_thw: torch.Tensor | None = None
    # SGLang's return_routed_experts / routed_experts_start_len (routing.py)
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    # results, written by the scheduler thread
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    finish_reason: dict | None = None
    aborted: bool = False
    retractions: int = 0
    created: float = field(default_factory=time.monotonic)
    finished_at: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)
    # with a RoutingCapture: [n, layers, top_k] int32 chunks, one per forward, of every position fed
    # to the model (a re-prefill after a retraction replaces them)
    routed: list[torch.Tensor] = field(default_factory=list)
    # called (from whichever thread finishes the request) right after `done` is set: the HTTP layer's
    # event loop wakes on it instead of holding a thread per waiting request
    on_done: Callable[[], None] | None = None


@dataclass
class Sampled:
    """One sampling of `rows` (a snapshot of them): tokens [len(rows)] on the device, tokens and
    log-probs on their way to the host, and the rows whose sampling raised (index -> error)."""

    rows: list[Row]
    tokens: torch.Tensor
    host: HostCopy
    failed: dict[int, Exception]
    routed: torch.Tensor | None = None  # a decode step's routed experts per row (routing.py), or None


def abort_reason(message: str = "Aborted", status_code: int | None = None, err_type: str | None = None) -> dict:
    # SGLang's FINISH_ABORT.to_json(). status_code None: an ordinary finish (200, partial output);
    # 400..599: the HTTP layer answers that status with the message, as SGLang does for non-streams.
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


def device_wide(e: BaseException) -> bool:
    """An error that is no request's fault and leaves the device unusable for the step (out of memory,
    a CUDA/NCCL/cuBLAS error): the batch fails; retrying row by row would only fail again."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return any(s in text for s in ("CUDA error", "CUDA out of memory", "device-side assert", "CUBLAS_STATUS",
                                   "cuDNN error", "NCCL error"))
