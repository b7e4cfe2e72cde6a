"""The embedded engine's scheduler: continuous batching of generate requests on one HF model.

One scheduler thread owns the model forward and the running batch. Each turn it (1) finishes rows
whose abort was requested, (2) admits waiting requests up to `max_running_requests` (prefill them
together, sample their first token, merge them into the running batch), (3) runs one decode step
for every running row. HTTP threads only enqueue requests, set flags and wait on events.

Overlap (SGLang's overlap scheduler, on unless --disable-overlap-schedule): a decode step's sampler
writes its tokens into the next step's input ids on the device and copies them to the host without
waiting (pinned memory, an event; sampling.HostCopy), and the scheduler launches step n+1 before it
reads step n's tokens (appending them, stop checks, answering finished requests), so on CUDA that
host work runs while the device computes. A row that stopped at step n has run step n+1 too: its
token there is never reported, and the row leaves the batch when step n is read. Anything else that
changes the batch or needs the device idle (admitting requests, an abort, a pause, a weight update,
growing the static cache, shutdown) first drains the pipeline: the in-flight step's tokens are read,
and the host state is then exactly that of the non-overlapped scheduler. With per-request seeds (or
greedy) both give the same tokens and log-probs.

Pause and weight updates follow SGLang's semantics (tokenizer_manager.py / io_struct.py,
SGLang 0.5.23):
- pause mode "abort" (default): abort every request, wait until none is running; new requests wait
  for `continue`. "in_place": running requests stay, with their KV cache, and resume on `continue`.
  "retract": running requests go back to the waiting queue and are re-prefilled (prompt + output so
  far) after `continue`, so their KV cache is recomputed with whatever weights are loaded then.
- a weight update while paused runs at once; otherwise it blocks admission, waits for the running
  requests to finish (SGLang's model_update_lock writer), and new requests wait for it.
- abort_request(rid) is dropped without a word unless `rid` is exactly the rid of a live request
  (SGLang's tokenizer manager, one tokenizer worker, forwards only a rid it holds); then, as SGLang's
  scheduler, every live request whose rid starts with `rid` is aborted. An aborted request finishes
  normally with finish_reason {"type": "abort", ...} and the tokens it had.

Decoding has two paths. The dynamic one (the default on CPU) keeps the running batch in a left-padded
DynamicCache (batch.py). The static one (the default on CUDA; `static_cache=True` elsewhere) keeps
it in a preallocated per-slot cache and, on CUDA, replays the decode step from CUDA graphs
(slots.py, graphs.py); models it does not support (vision-language, sliding-window layers, ...) stay
on the dynamic path. Both give the same tokens and log-probs.

A request that fails inside the scheduler fails alone (answered 500 with its rid and the error; the
HTTP layer has already refused what it can name, so this is the second line): a failed prefill is
redone one request at a time, a failed batched sampling one row at a time, and a row whose stop check
raises is dropped; the others of the batch go on with the tokens they would have drawn without it.
A failed decode step (no request to blame) or a device-wide error (out of memory, a CUDA error) still
fails every running request, with a message that says so.

This module is the scheduler: the HTTP threads' calls and the loop that decides each turn. How a
turn runs on the device (prefill, the decode step, sampling, reading the tokens back) is
steps.EngineSteps, a base class of Engine; the request it carries is request.GenRequest.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

import torch

from slime_rl.engines.embedded.attention import VARLEN_PREFILL, uses_flash_decode
from slime_rl.engines.embedded.batch import RunningBatch, can_merge
from slime_rl.engines.embedded.graphs import StaticDecoder
from slime_rl.engines.embedded.request import GenRequest, Sampled, abort_reason, device_wide
from slime_rl.engines.embedded.routing import RoutingCapture
from slime_rl.engines.embedded.slots import unsupported
from slime_rl.engines.embedded.steps import EngineSteps
from slime_rl.engines.embedded.vision import is_vision_config

logger = logging.getLogger(__name__)


class Engine(EngineSteps):
    def __init__(self, model: torch.nn.Module, tokenizer, eos_ids: set[int], pad_id: int,
                 max_running_requests: int = 64, seed: int = 0, static_cache: bool = False,
                 cuda_graph: bool = False, cuda_graph_max_bs: int | None = None, overlap: bool = True,
                 routing: RoutingCapture | None = None, **static_kw) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.routing = routing
        self.device = next(model.parameters()).device
        self.eos_ids, self.pad_id = eos_ids, pad_id
        self.max_running = max_running_requests
        self.overlap = overlap  # launch step n+1 before reading step n's tokens (off: --disable-overlap-schedule)
        self._inflight: Sampled | None = None  # the launched decode step whose tokens the host has not read
        self._busy = False  # the scheduler runs a prefill or a decode step (outside self._cond)
        self._plan: tuple | None = None  # (key, rows, SamplerPlan) of the last sampling (_plan_of)
        # transformers renamed the forward's `past_key_values` to `cache` (5.2x); take either.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.is_vision = is_vision_config(model.config)
        # --enable-deterministic-inference (precision.apply_deterministic_attention): prefills by the
        # trainer's varlen flash attention too, so the prompt's keys and values are the trainer's bits
        self._prefill_attention = VARLEN_PREFILL if uses_flash_decode(model) and not self.is_vision else None
        self.default_gen = torch.Generator(device=self.device).manual_seed(seed)
        self.model_lock = threading.Lock()  # held for every forward and every weight copy
        # CUDA: the last weight copy's event (it runs on a side stream); forwards wait for it
        self.weights_ready: torch.cuda.Event | None = None
        self._cond = threading.Condition()
        self._waiting: deque[GenRequest] = deque()
        self._static: StaticDecoder | None = None
        why_not = unsupported(model) if static_cache else None
        if static_cache and routing is not None and not why_not:
            # the recording router forward runs per eager forward; a captured graph would skip it
            why_not = "--enable-return-routed-experts records routing in eager forwards"

        if static_cache and why_not:
            logger.info("embedded engine: dynamic KV cache, no CUDA graphs: %s", why_not)
        elif static_cache:
            self._static = StaticDecoder(model, self._cache_kw, pad_id, max_running_requests, cuda_graph,
                                         cuda_graph_max_bs, **static_kw)
            logger.info("embedded engine: %s", self._static.describe())
        self._batch = self._static.batch if self._static else RunningBatch()
        self._admitting: list[GenRequest] = []  # popped from the queue, being prefilled
        self._paused: str | None = None  # None or the pause mode
        self._updating = 0
        self._abort_pending = False
        self._stopping = False
        self._unavailable: str | None = None  # memory released (colocated mode): why requests are refused
        self.stats = {"prefill_forwards": 0, "decode_forwards": 0, "max_running_rows": 0,
                      "requests_finished": 0, "requests_aborted": 0, "prefill_shared_rows": 0,
                      "prefill_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0,
                      "overlapped_steps": 0}  # decode steps launched before the previous one's tokens were read
        self._thread = threading.Thread(target=self._loop, name="embedded-scheduler", daemon=True)
        self._thread.start()

    # ---- called from HTTP threads ----
    def submit(self, reqs: list[GenRequest]) -> None:
        with self._cond:
            if self._unavailable is not None:
                for req in reqs:
                    self._finish(req, abort_reason(self._unavailable, 503, "ServiceUnavailable"))
                return
            self._waiting.extend(reqs)
            self._cond.notify_all()

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        if not abort_all and not rid:  # SGLang ignores it too (it would match everything on the scheduler)
            return
        with self._cond:
            running = self._admitting + [row.req for row in self._batch.rows]
            if not abort_all and all(req.rid != rid for req in [*self._waiting, *running]):
                return  # the tokenizer manager's check: not a live rid
            for req in list(self._waiting):
                if abort_all or req.rid.startswith(rid):  # the scheduler's match
                    self._waiting.remove(req)
                    self._finish(req, abort_reason("Abort in waiting queue"))
            for req in running:
                if abort_all or req.rid.startswith(rid):
                    req.aborted = self._abort_pending = True
            self._cond.notify_all()

    def pause(self, mode: str = "abort") -> None:
        with self._cond:
            self._paused = mode
        if mode == "abort":
            self.abort(abort_all=True)
        with self._cond:
            self._cond.notify_all()
            if mode != "in_place":  # abort: wait until drained; retract: until rows are requeued
                self._cond.wait_for(self._drained)
            else:  # until the scheduler stands still: no step running or in flight, every token read
                self._cond.wait_for(self._still)

    def _still(self) -> bool:
        return (not self._busy and self._inflight is None) or self._stopping

    def _drained(self) -> bool:
        # an in-flight step still reads the weights and the KV cache on the device
        return (not self._batch.rows and not self._admitting and self._inflight is None) or self._stopping

    def set_unavailable(self, message: str | None) -> None:
        """With a message: refuse every new and queued request with 503 and that message, abort the
        running ones and wait until none runs (the caller then frees memory). None: serve again."""
        with self._cond:
            self._unavailable = message
            if message is not None:
                for req in list(self._waiting):
                    self._finish(req, abort_reason(message, 503, "ServiceUnavailable"))
                self._waiting.clear()
            self._cond.notify_all()
        if message is not None:
            self.abort(abort_all=True)
            with self._cond:
                self._cond.wait_for(self._drained)

    @property
    def unavailable(self) -> str | None:
        return self._unavailable

    def resume(self) -> None:
        with self._cond:
            self._paused = None
            self._cond.notify_all()

    @property
    def paused(self) -> str | None:
        return self._paused

    @contextlib.contextmanager
    def weights_exclusive(self) -> Iterator[None]:
        """No forward runs inside; when not paused, running requests finish first and none start."""
        with self._cond:
            self._updating += 1
            if self._paused is None:
                self._cond.wait_for(self._drained)
            else:  # paused in place: rows stay, but no step may still run or be in flight on the device
                self._cond.wait_for(self._still)
        try:
            with self.model_lock:
                yield
        finally:
            with self._cond:
                self._updating -= 1
                self._cond.notify_all()

    def wait_weights(self) -> None:
        """Order the current stream after the last weight copy (device-side; call under model_lock)."""
        if self.weights_ready is not None:
            torch.cuda.current_stream(self.device).wait_event(self.weights_ready)

    def load(self) -> dict:
        with self._cond:
            # a row whose request is answered may sit in the batch until its step is read: not running
            running = sum(not r.req.done.is_set() for r in self._batch.rows)
            return {"num_running_reqs": running, "num_waiting_reqs": len(self._waiting),
                    "paused": self._paused, "overlap": self.overlap, **self.stats,
                    **(self._static.stats if self._static else {})}

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def drop_static_state(self) -> None:
        """Free the static KV cache, keeping the CUDA graphs (colocated release; call when idle):
        graphs.StaticDecoder.release."""
        if self._static is not None:
            self._static.release()

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout=30)

    # ---- scheduler thread ----
    def _can_step(self) -> bool:
        if self._stopping or self._abort_pending or self._inflight is not None:
            return True
        if self._paused is not None:
            return self._paused == "retract" and bool(self._batch.rows)
        return bool(self._batch.rows) or (bool(self._waiting) and not self._updating)

    def _merge_ok(self) -> bool:
        return self._static is not None or self._batch.cache is None or can_merge(self._batch.cache)

    def _can_overlap(self) -> bool:
        """Caller holds self._cond. Whether the next decode step may be launched while the in-flight
        one's tokens are unread: nothing but decoding is due. Everything else (an abort, a pause, a
        weight update, admitting waiting requests, growing the static cache, stopping) first drains
        the pipeline: the in-flight step's tokens are processed and the host state is exact again."""
        b = self._batch
        if self._stopping or self._abort_pending or self._paused is not None or self._updating or not b.rows:
            return False
        if self._waiting and len(b) < self.max_running and self._merge_ok():
            return False
        # every row reaches max_new_tokens with the in-flight step: a step launched now would be wasted
        if all(len(r.req.output_ids) + 1 >= r.req.params.max_new_tokens for r in b.rows):
            return False
        return self._static is None or not self._static.must_grow(b.rows)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._can_step)
                drain = self._inflight is not None and not self._can_overlap()
            if drain:
                self._guarded(self._drain)
                continue
            with self._cond:
                if self._inflight is not None and not self._can_overlap():
                    continue  # something came in since: drain first
                if self._stopping:
                    for req in [r.req for r in self._batch.rows] + list(self._waiting):
                        self._finish(req, abort_reason("Server shutting down"))
                    self._batch.clear()
                    self._waiting.clear()
                    self._cond.notify_all()
                    return
                if self._abort_pending:
                    self._reap_aborted()
                if self._paused == "retract" and self._batch.rows:
                    for row in self._batch.rows:
                        row.req.retractions += 1
                    self._waiting.extendleft(reversed([r.req for r in self._batch.rows]))
                    self._batch.clear()
                    self._cond.notify_all()
                    continue
                admit: list[GenRequest] = []
                if self._paused is None and not self._updating and self._merge_ok():
                    while self._waiting and len(self._batch) + len(admit) < self.max_running:
                        admit.append(self._waiting.popleft())
                self._admitting = admit
                run_decode = self._paused is None and bool(self._batch.rows)
                self._busy = bool(admit) or run_decode
            self._guarded(self._turn, admit, run_decode)
            if self._busy:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _turn(self, admit: list[GenRequest], run_decode: bool) -> None:
        # wall time per phase (each ends with a device->host copy of sampled tokens, so it includes
        # device work; with overlap a decode phase reads the previous step's tokens):
        # bench/engine_throughput.py reads them from /get_server_info
        t0 = time.perf_counter()
        if admit:
            self._prefill(admit)
        t1 = time.perf_counter()
        if run_decode:
            self._decode()
            self.stats["decode_s"] += time.perf_counter() - t1
        if admit:
            self.stats["prefill_s"] += t1 - t0

    def _guarded(self, fn: Callable[..., None], *args) -> None:
        try:
            fn(*args)
        except Exception as e:  # the scheduler must outlive a failed forward, or every caller hangs
            # what reaches here is not one request's fault (those fail alone in _prefill and
            # _record): a failed decode step or a device-wide error
            kind = "device-wide error" if device_wide(e) else "failed step"
            logger.exception("embedded engine: %s; failing every running request", kind)
            self._fail_all(f"engine error ({kind}; every running request of the batch fails): "
                           f"{type(e).__name__}: {e}")

    def _fail_all(self, message: str) -> None:
        with self._cond:
            for req in self._admitting + [r.req for r in self._batch.rows]:
                if not req.done.is_set():
                    self._finish(req, abort_reason(message, 500, "InternalServerError"))
            self._admitting = []
            self._inflight = None
            self._batch.clear()
            self._cond.notify_all()

    def _reap_aborted(self) -> None:
        self._abort_pending = False
        keep = []
        for i, row in enumerate(self._batch.rows):
            if row.req.aborted:
                self._finish(row.req, abort_reason())
            else:
                keep.append(i)
        self._batch.keep(keep)
        self._cond.notify_all()

    def _finish(self, req: GenRequest, reason: dict) -> None:
        """Caller holds self._cond."""
        req.finish_reason = reason
        req.finished_at = time.monotonic()
        self.stats["requests_finished"] += 1
        if reason["type"] == "abort":
            self.stats["requests_aborted"] += 1
        req.done.set()
        if req.on_done is not None:
            req.on_done()

