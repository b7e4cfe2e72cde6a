"""The embedded engine's device work, turn by turn: prefill, the decode step, sampling, and reading the
sampled tokens back (appending them, stop checks, finishing requests).

`EngineSteps` is a base class of `engine.Engine` and holds no state of its own: the model, the running
batch, the condition and the stats it works on are set by `Engine.__init__`, and it finishes requests
through `Engine._finish`. The scheduler thread (engine.py) decides what runs each turn; what follows
is how a turn runs: prefix-shared prefills, the overlapped decode step (the module docstring of
engine.py), the row-by-row retries that make a failing request fail alone, and SGLang's stop order.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from slime_rl.engines.embedded.attention import slot_decode_attention
from slime_rl.engines.embedded.batch import Row, left_pad
from slime_rl.engines.embedded.request import GenRequest, Sampled, abort_reason, device_wide
from slime_rl.engines.embedded.sampling import HostCopy, SamplerPlan, device_tensor, token_logprobs
from slime_rl.engines.embedded.vision import prefill_vision_kwargs

# the scheduler's logger (engine.py's): its messages keep one logger name
logger = logging.getLogger("slime_rl.engines.embedded.engine")


class EngineSteps:
    """Prefill, decode step, sampling and recording of the scheduler thread (a base class of Engine)."""

    def _fail_one(self, req: GenRequest, where: str, e: Exception) -> None:
        """Answer one request with its error (500); the rest of its batch goes on."""
        logger.error("embedded engine: request %s failed in %s (the rest of the batch continues)", req.rid, where,
                     exc_info=e)
        with self._cond:
            self._finish(req, abort_reason(f"engine error in request {req.rid} ({where}): {type(e).__name__}: {e}; "
                                           "the other requests of its batch continue", 500, "InternalServerError"))

    def _prefill(self, reqs: list[GenRequest]) -> None:
        ready, scored = [], []
        for req in reqs:
            if req.params.max_new_tokens - len(req.output_ids) <= 0:
                if req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids:
                    scored.append(req)  # SGLang's prompt scoring: the prompt's log-probs, nothing generated
                    continue
                with self._cond:
                    self._finish(req, {"type": "length", "length": req.params.max_new_tokens})
            else:
                ready.append(req)
        if scored:
            self._score_prompts(scored)
        groups = []
        try:
            if ready:
                groups.append(self._prefill_forward(ready))
        except Exception as e:
            if device_wide(e):
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
                        if device_wide(e1):
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

    def _score_prompts(self, reqs: list[GenRequest]) -> None:
        """max_new_tokens 0 with return_logprob (a teacher's or a reward model's scoring of given tokens, as
        slime's on-policy distillation asks SGLang): one prefill forward for the prompt log-probs, no token
        sampled, no row kept; the requests finish as SGLang's do ("length", 0 tokens)."""
        try:
            self._prefill_forward(reqs)
        except Exception as e:
            if device_wide(e):
                raise
            for req in reqs:  # one request's fault: score each alone to find it
                if not req.input_logprobs:
                    try:
                        self._prefill_forward([req])
                    except Exception as e1:
                        if device_wide(e1):
                            raise
                        self._fail_one(req, "prefill", e1)
        with self._cond:
            for req in reqs:
                if not req.done.is_set():
                    self._finish(req, {"type": "length", "length": req.params.max_new_tokens})

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

    def _finish_step(self, step: Sampled) -> None:
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

    def _launch_sample(self, rows: list[Row], logits: torch.Tensor) -> Sampled:
        """Sample one token per row on the device and start their copy to the host. A failing batched
        sampling is redone row by row: the sampler draws every row's noise only after the per-row
        tensors are built, so a failure there has not advanced any row's generator and the others
        draw what they would have drawn; the failing rows get token 0 (never reported)."""
        failed: dict[int, Exception] = {}
        try:
            tokens, chosen = self._draw(rows, logits)
        except Exception as e:
            if device_wide(e):
                raise
            parts = []
            for i in range(len(rows)):
                try:
                    parts.append(self._draw(rows[i:i + 1], logits[i:i + 1]))
                except Exception as e1:
                    if device_wide(e1):
                        raise
                    failed[i] = e1
                    parts.append((torch.zeros(1, dtype=torch.long, device=logits.device),
                                  torch.zeros(1, device=logits.device)))
            tokens, chosen = torch.cat([t for t, _ in parts]), torch.cat([c for _, c in parts])
        return Sampled(list(rows), tokens, HostCopy(tokens, chosen), failed)

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

    def _record(self, step: Sampled) -> None:
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


def _out_cache(out) -> object:
    cache = out.get("cache")
    return cache if cache is not None else out.get("past_key_values")
