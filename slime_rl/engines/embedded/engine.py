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
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from slime_rl.engines.embedded.attention import VARLEN_PREFILL, slot_decode_attention, uses_flash_decode
from slime_rl.engines.embedded.batch import Row, RunningBatch, can_merge, left_pad
from slime_rl.engines.embedded.graphs import StaticDecoder
from slime_rl.engines.embedded.routing import RoutingCapture
from slime_rl.engines.embedded.sampling import HostCopy, SamplerPlan, SamplingParams, device_tensor, token_logprobs
from slime_rl.engines.embedded.slots import unsupported
from slime_rl.engines.embedded.vision import is_vision_config, prefill_vision_kwargs

logger = logging.getLogger(__name__)


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
class _Sampled:
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


class Engine:
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
        self._inflight: _Sampled | None = None  # the launched decode step whose tokens the host has not read
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
            kind = "device-wide error" if _device_wide(e) else "failed step"
            logger.exception("embedded engine: %s; failing every running request", kind)
            self._fail_all(f"engine error ({kind}; every running request of the batch fails): "
                           f"{type(e).__name__}: {e}")

    def _fail_one(self, req: GenRequest, where: str, e: Exception) -> None:
        """Answer one request with its error (500); the rest of its batch goes on."""
        logger.error("embedded engine: request %s failed in %s (the rest of the batch continues)", req.rid, where,
                     exc_info=e)
        with self._cond:
            self._finish(req, abort_reason(f"engine error in request {req.rid} ({where}): {type(e).__name__}: {e}; "
                                           "the other requests of its batch continue", 500, "InternalServerError"))

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

    def _prefill(self, reqs: list[GenRequest]) -> None:
        ready = []
        for req in reqs:
            if req.params.max_new_tokens - len(req.output_ids) <= 0:
                with self._cond:
                    self._finish(req, {"type": "length", "length": req.params.max_new_tokens})
            else:
                ready.append(req)
        groups = []
        try:
            if ready:
                groups.append(self._prefill_forward(ready))
        except Exception as e:
            if _device_wide(e):
                raise
            if len(ready) == 1:
                self._fail_one(ready[0], "prefill", e)
            else:  # one request's fault (an id the embedding lacks, ...): prefill each alone to find it
                logger.warning("embedded engine: prefill of %d requests failed (%s: %s); prefilling them one "
                               "by one", len(ready), type(e).__name__, e)
                for req in ready:
                    try:
                        groups.append(self._prefill_forward([req]))
                    except Exception as e1:
                        if _device_wide(e1):
                            raise
                        self._fail_one(req, "prefill", e1)
        for rows, mask, cache, last in groups:
            self._record(self._launch_sample(rows, last))
            keep = [i for i, r in enumerate(rows) if not r.req.done.is_set()]
            with self._cond:
                n_old = len(self._batch)
                self._batch.merge(rows, mask, cache)
                self._batch.keep(list(range(n_old)) + [n_old + i for i in keep])
                self.stats["max_running_rows"] = max(self.stats["max_running_rows"], len(self._batch))
        with self._cond:
            self._admitting = []
            self._cond.notify_all()

    def _prefill_forward(self, ready: list[GenRequest]) -> tuple[list[Row], torch.Tensor, object, torch.Tensor]:
        """One prefill forward of `ready` (and their prompt log-probs); returns their rows, mask, KV cache
        and last logits, not yet sampled nor merged into the batch."""
        seqs = [r.input_ids + r.output_ids for r in ready]
        # prefix sharing: the n samples of a GRPO group carry the same prompt; prefill each distinct
        # sequence once and give every request a copy of its row (KV cache, mask, logits). Images
        # make requests differ beyond their ids, so vision models prefill every request.
        if self.is_vision:
            distinct, src = seqs, list(range(len(seqs)))
        else:
            first: dict[tuple[int, ...], int] = {}
            src = [first.setdefault(tuple(s), len(first)) for s in seqs]
            distinct = [list(k) for k in first]
        ids, mask, pos = left_pad(distinct, self.pad_id, self.device)
        want_input_lp = any(r.return_logprob and r.logprob_start_len >= 0 and not r.output_ids for r in ready)
        with self.model_lock, torch.no_grad():
            self.wait_weights()
            # images: embeddings holding the image features and 3-D mRoPE positions; the deltas
            # shift each row's later (text) positions
            vision, deltas = prefill_vision_kwargs(self.model, ready, ids, mask) if self.is_vision \
                else ({}, [0] * len(ready))
            pos = vision.pop("position_ids", pos)
            inputs = vision if vision else {"input_ids": ids}
            switch = slot_decode_attention(self.model, self._prefill_attention) if self._prefill_attention \
                else contextlib.nullcontext()
            with switch:
                out = self.model(**inputs, attention_mask=mask, position_ids=pos, use_cache=True,
                                 logits_to_keep=0 if want_input_lp else 1)
        self.stats["prefill_forwards"] += 1
        self.stats["prefill_shared_rows"] += len(ready) - len(distinct)
        self.stats["prefill_tokens"] += sum(len(s) for s in distinct)
        if self.routing is not None:
            routed = self.routing.take(ids.shape[0], ids.shape[1])
            for r, s, i in zip(ready, seqs, src, strict=True):
                r.routed = [routed[i, ids.shape[1] - len(s):]] if self.routing.keep else []
        if want_input_lp:
            self._input_logprobs(ready, src, out.logits, ids.shape[1])
        rows = [Row(req=r, next_pos=len(s) + d) for r, s, d in zip(ready, seqs, deltas, strict=True)]
        cache, last = _out_cache(out), out.logits[:, -1, :]
        if len(distinct) < len(ready):
            idx = torch.tensor(src, device=self.device)
            cache.batch_select_indices(idx)  # repeated indices: one copy of the row per request
            mask, last = mask.index_select(0, idx), last.index_select(0, idx)
        return rows, mask, cache, last

    def _decode(self) -> None:
        """Launch one decode step of every running row (forward and sampling); then read the tokens of
        the step before it (overlap) or of this one.

        Overlap (SGLang's overlap scheduler): the sampler writes each row's token into the next step's
        input ids on the device, so step n+1 is launched before the host reads step n's tokens, and
        on CUDA the host's work for step n (appending tokens, stop checks, answering finished
        requests) runs while the device computes step n+1. A row that stops at step n has then run
        step n+1 too: that token is never reported (the row's request is done) and the row leaves the
        batch when step n is read."""
        b = self._batch
        on_device = self._inflight is not None  # the in-flight step's tokens are this step's inputs
        routed = None
        if self._static is not None:
            with self.model_lock, torch.no_grad():
                self.wait_weights()
                logits = self._static.step(b.rows, ids_on_device=on_device)
        else:
            if on_device:
                ids = b.next_ids[:, None]
            else:
                ids = device_tensor([[r.pending] for r in b.rows], torch.long, self.device)
            pos = device_tensor([[r.next_pos] for r in b.rows], torch.long, self.device)
            b.mask = torch.cat([b.mask, b.mask.new_ones((len(b), 1))], dim=1)
            with self.model_lock, torch.no_grad():
                self.wait_weights()
                out = self.model(input_ids=ids, attention_mask=b.mask, position_ids=pos, use_cache=True,
                                 **{self._cache_kw: b.cache})
            logits = out.logits[:, -1, :]
            if self.routing is not None:
                # this step's experts per row; recorded with its tokens (_record), so a row that
                # stopped at the step before (overlap) gets none, as without overlap
                taken = self.routing.take(len(b.rows), 1)
                routed = taken if self.routing.keep else None
        self.stats["decode_forwards"] += 1
        for r in b.rows:
            r.next_pos += 1
        step = self._launch_sample(b.rows, logits)
        step.routed = routed
        if not self.overlap:
            self._finish_step(step)
            return
        if self._static is not None:
            self._static.set_next_ids(step.tokens)
        else:
            b.next_ids = step.tokens
        previous, self._inflight = self._inflight, step
        if previous is not None:
            self.stats["overlapped_steps"] += 1
            self._finish_step(previous)

    def _drain(self) -> None:
        """Read the in-flight step's tokens: afterwards every row's `pending` and output are exact."""
        if self._inflight is not None:
            t0 = time.perf_counter()
            self._finish_step(self._inflight)
            self.stats["decode_s"] += time.perf_counter() - t0
        with self._cond:  # only now: pause and weight updates wait for the tokens to be read
            self._inflight = None
            self._cond.notify_all()

    def _finish_step(self, step: _Sampled) -> None:
        """Record a decode step's tokens and drop the rows whose request is done from the batch."""
        self._record(step)
        with self._cond:
            b = self._batch
            b.keep([i for i, r in enumerate(b.rows) if not r.req.done.is_set()])
            self._cond.notify_all()

    def _input_logprobs(self, reqs: list[GenRequest], src: list[int], logits: torch.Tensor, width: int) -> None:
        """Prompt log-probs from `logprob_start_len` on; the first prompt token has none (None).
        Request j's prompt is row src[j] of `logits` (shared prefills)."""
        for j, req in enumerate(reqs):
            i = src[j]
            if not (req.return_logprob and req.logprob_start_len >= 0):
                continue
            n, off = len(req.input_ids), width - len(req.input_ids)
            temp = torch.tensor([req.params.temperature], device=self.device)
            lp = token_logprobs(logits[i, off:off + n - 1], temp.expand(n - 1))
            vals = lp.gather(1, torch.tensor(req.input_ids[1:], device=self.device)[:, None]).squeeze(1)
            req.input_logprobs = ([None] + vals.tolist())[req.logprob_start_len:]

    def _launch_sample(self, rows: list[Row], logits: torch.Tensor) -> _Sampled:
        """Sample one token per row on the device and start their copy to the host. A failing batched
        sampling is redone row by row: the sampler draws every row's noise only after the per-row
        tensors are built, so a failure there has not advanced any row's generator and the others
        draw what they would have drawn; the failing rows get token 0 (never reported)."""
        failed: dict[int, Exception] = {}
        try:
            tokens, chosen = self._draw(rows, logits)
        except Exception as e:
            if _device_wide(e):
                raise
            parts = []
            for i in range(len(rows)):
                try:
                    parts.append(self._draw(rows[i:i + 1], logits[i:i + 1]))
                except Exception as e1:
                    if _device_wide(e1):
                        raise
                    failed[i] = e1
                    parts.append((torch.zeros(1, dtype=torch.long, device=logits.device),
                                  torch.zeros(1, device=logits.device)))
            tokens, chosen = torch.cat([t for t, _ in parts]), torch.cat([c for _, c in parts])
        return _Sampled(list(rows), tokens, HostCopy(tokens, chosen), failed)

    def _draw(self, rows: list[Row], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' sampled tokens [B] and their log-probs [B], on the device."""
        plan = self._plan_of(rows, logits.shape[1])
        pick = self._static.compiled_sampler(len(rows)) if self._static is not None else None
        return plan.draw(logits, self.default_gen, pick)

    def _plan_of(self, rows: list[Row], vocab_size: int) -> SamplerPlan:
        """The sampler's plan of `rows`, rebuilt only when the rows changed (a request's parameters and
        generator do not change while it runs): most decode steps reuse the last one."""
        key = (tuple(map(id, rows)), vocab_size)
        if self._plan is None or self._plan[0] != key:
            plan = SamplerPlan([r.req.params for r in rows], [r.req.generator for r in rows], vocab_size,
                               self.device)
            # the rows are held with the key: ids of live objects are not reused
            self._plan = (key, list(rows), plan)
        return self._plan[2]

    def _record(self, step: _Sampled) -> None:
        """On the host: append each row's token and log-prob, finish the rows that stop. A row whose
        request is already done (it stopped at the step before: overlap) gets nothing; a row whose
        sampling or stop check raised is answered with its error alone."""
        tok_list, lp_list = step.host.get()
        for i, (row, tok, lp) in enumerate(zip(step.rows, tok_list, lp_list, strict=True)):
            req = row.req
            if req.done.is_set():
                continue
            if step.routed is not None:
                req.routed.append(step.routed[i])
            if i in step.failed:
                self._fail_one(req, "sampling", step.failed[i])
                continue
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            row.pending = tok
            try:
                reason = self._finish_reason(req, tok)
            except Exception as e:  # e.g. the stop-string check (the tokenizer's decode) of this request
                self._fail_one(req, "stop check", e)
                continue
            if reason is not None:
                with self._cond:
                    self._finish(req, reason)

    def _finish_reason(self, req: GenRequest, tok: int) -> dict | None:
        # SGLang's order (schedule_batch.update_finish_state): stop string, then stop token / EOS
        # (both skipped under ignore_eos), then length.
        p = req.params
        if p.stop:
            # as SGLang's Req.tail_str: only the last stop_str_max_len + 1 tokens, decoded as they are
            # (special tokens kept), so a step's check costs the same at any output length; decoding
            # the whole output each step cost O(length) per row per step
            if not p.stop_str_max_len:  # once per request (here, so a failure fails this request alone)
                p.normalize(self.tokenizer)
            text = self.tokenizer.decode(req.output_ids[-(p.stop_str_max_len + 1):])
            for s in p.stop:
                if s in text:
                    return {"type": "stop", "matched": s}
        if not p.ignore_eos and (tok in p.stop_token_ids or tok in self.eos_ids):
            return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        return None

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


def _device_wide(e: BaseException) -> bool:
    """An error that is no request's fault and leaves the device unusable for the step (out of memory,
    a CUDA/NCCL/cuBLAS error): the batch fails; retrying row by row would only fail again."""
    if isinstance(e, torch.OutOfMemoryError):
        return True
    text = str(e)
    return any(s in text for s in ("CUDA error", "CUDA out of memory", "device-side assert", "CUBLAS_STATUS",
                                   "cuDNN error", "NCCL error"))


def _out_cache(out) -> object:
    cache = out.get("cache")
    return cache if cache is not None else out.get("past_key_values")
