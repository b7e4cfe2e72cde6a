"""The embedded engine's scheduler: continuous batching of generate requests on one HF model.

One scheduler thread owns the model forward and the running batch. Each turn it (1) finishes rows
whose abort was requested, (2) admits waiting requests up to `max_running_requests` (prefill them
together, sample their first token, merge them into the running batch), (3) runs one decode step
for every running row. HTTP threads only enqueue requests, set flags and wait on events.

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

from slime_rl.engines.embedded.batch import Row, RunningBatch, can_merge, left_pad
from slime_rl.engines.embedded.graphs import StaticDecoder
from slime_rl.engines.embedded.routing import RoutingCapture
from slime_rl.engines.embedded.sampling import SamplingParams, device_tensor, sample, token_logprobs
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


def abort_reason(message: str = "Aborted", status_code: int | None = None, err_type: str | None = None) -> dict:
    # SGLang's FINISH_ABORT.to_json(). status_code None: an ordinary finish (200, partial output);
    # 400..599: the HTTP layer answers that status with the message, as SGLang does for non-streams.
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": err_type}


class Engine:
    def __init__(self, model: torch.nn.Module, tokenizer, eos_ids: set[int], pad_id: int,
                 max_running_requests: int = 64, seed: int = 0, static_cache: bool = False,
                 cuda_graph: bool = False, cuda_graph_max_bs: int | None = None,
                 routing: RoutingCapture | None = None, **static_kw) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.routing = routing
        self.device = next(model.parameters()).device
        self.eos_ids, self.pad_id = eos_ids, pad_id
        self.max_running = max_running_requests
        # transformers renamed the forward's `past_key_values` to `cache` (5.2x); take either.
        params = inspect.signature(model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.is_vision = is_vision_config(model.config)
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
                      "prefill_tokens": 0, "prefill_s": 0.0, "decode_s": 0.0}
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

    def _drained(self) -> bool:
        return (not self._batch.rows and not self._admitting) or self._stopping

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
            return {"num_running_reqs": len(self._batch), "num_waiting_reqs": len(self._waiting),
                    "paused": self._paused, **self.stats, **(self._static.stats if self._static else {})}

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
        if self._stopping or self._abort_pending:
            return True
        if self._paused is not None:
            return self._paused == "retract" and bool(self._batch.rows)
        return bool(self._batch.rows) or (bool(self._waiting) and not self._updating)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._can_step)
                if self._stopping:
                    for req in [r.req for r in self._batch.rows] + list(self._waiting):
                        self._finish(req, abort_reason("Server shutting down"))
                    self._batch.clear()
                    self._waiting.clear()
                    self._cond.notify_all()
                    return
                self._reap_aborted()
                if self._paused == "retract" and self._batch.rows:
                    for row in self._batch.rows:
                        row.req.retractions += 1
                    self._waiting.extendleft(reversed([r.req for r in self._batch.rows]))
                    self._batch.clear()
                    self._cond.notify_all()
                    continue
                admit: list[GenRequest] = []
                merge_ok = self._static is not None or self._batch.cache is None or can_merge(self._batch.cache)
                if self._paused is None and not self._updating and merge_ok:
                    while self._waiting and len(self._batch) + len(admit) < self.max_running:
                        admit.append(self._waiting.popleft())
                self._admitting = admit
                run_decode = self._paused is None and bool(self._batch.rows)
            try:
                # wall time per phase (each ends with a device->host copy of the sampled tokens, so it
                # includes the device work): bench/engine_throughput.py reads them from /get_server_info
                t0 = time.perf_counter()
                if admit:
                    self._prefill(admit)
                t1 = time.perf_counter()
                if run_decode:
                    self._decode()
                    self.stats["decode_s"] += time.perf_counter() - t1
                if admit:
                    self.stats["prefill_s"] += t1 - t0
            except Exception as e:  # the scheduler must outlive a failed forward, or every caller hangs
                # what reaches here is not one request's fault (those fail alone in _prefill and
                # _sample_and_check): a failed decode step or a device-wide error
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
            keep = self._sample_and_check(rows, last)
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
        b = self._batch
        if self._static is not None:
            with self.model_lock, torch.no_grad():
                self.wait_weights()
                logits = self._static.step(b.rows)
            self._after_decode(logits)
            return
        ids = device_tensor([[r.pending] for r in b.rows], torch.long, self.device)
        pos = device_tensor([[r.next_pos] for r in b.rows], torch.long, self.device)
        b.mask = torch.cat([b.mask, b.mask.new_ones((len(b), 1))], dim=1)
        with self.model_lock, torch.no_grad():
            self.wait_weights()
            out = self.model(input_ids=ids, attention_mask=b.mask, position_ids=pos, use_cache=True,
                             **{self._cache_kw: b.cache})
        if self.routing is not None:
            routed = self.routing.take(len(b.rows), 1)
            for i, r in enumerate(b.rows):
                if self.routing.keep:
                    r.req.routed.append(routed[i])
        self._after_decode(out.logits[:, -1, :])

    def _after_decode(self, logits: torch.Tensor) -> None:
        b = self._batch
        self.stats["decode_forwards"] += 1
        for r in b.rows:
            r.next_pos += 1
        keep = self._sample_and_check(b.rows, logits)
        with self._cond:
            b.keep(keep)
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

    def _sample_and_check(self, rows: list[Row], logits: torch.Tensor) -> list[int]:
        """Sample one token per row, record it, finish rows that stop; returns the indices to keep.
        A row whose sampling or stop check raises is answered with its error and dropped alone."""
        failed: dict[int, Exception] = {}
        try:
            tok_list, lp_list = self._sample(rows, logits)
        except Exception as e:
            if _device_wide(e):
                raise
            # one row's parameters broke the batched sampler: sample row by row to find it. The
            # sampler draws every row's noise only after the per-row tensors are built, so a failure
            # there has not advanced any row's generator and the others draw what they would have.
            tok_list, lp_list = [0] * len(rows), [0.0] * len(rows)
            for i in range(len(rows)):
                try:
                    (tok_list[i],), (lp_list[i],) = self._sample(rows[i:i + 1], logits[i:i + 1])
                except Exception as e1:
                    if _device_wide(e1):
                        raise
                    failed[i] = e1
        keep = []
        for i, (row, tok, lp) in enumerate(zip(rows, tok_list, lp_list, strict=True)):
            req = row.req
            if i in failed:
                self._fail_one(req, "sampling", failed[i])
                continue
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            row.pending = tok
            try:
                reason = self._finish_reason(req, tok)
            except Exception as e:  # e.g. the stop-string check (the tokenizer's decode) of this request
                self._fail_one(req, "stop check", e)
                continue
            if reason is None:
                keep.append(i)
            else:
                with self._cond:
                    self._finish(req, reason)
        return keep

    def _sample(self, rows: list[Row], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """The rows' sampled tokens and their log-probs, on the host."""
        params = [r.req.params for r in rows]
        temp = device_tensor([p.temperature for p in params], torch.float32, self.device)
        logprobs = token_logprobs(logits, temp)
        tokens = sample(logprobs, params, [r.req.generator for r in rows], self.default_gen)
        chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
        # one device->host copy per step (token ids < 2**53 are exact in float64)
        host = torch.stack([tokens.double(), chosen.double()]).cpu()
        return host[0].long().tolist(), host[1].tolist()

    def _finish_reason(self, req: GenRequest, tok: int) -> dict | None:
        # SGLang's order (schedule_batch.update_finish_state): stop string, then stop token / EOS
        # (both skipped under ignore_eos), then length.
        p = req.params
        if p.stop:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
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
