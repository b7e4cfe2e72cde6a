"""Routing of generate requests over the engines, request ids, and abort.

`LoadBalancer`: least-in-flight routing with at most `per_engine` samples in flight on each engine
(the rest wait here, not in the server's accept queue), and per-engine counters. A request may carry
several samples (`ClientPool.generate_many`: the samples of a group in SGLang's batch form of
/generate, one HTTP call and one server thread instead of n); it holds one slot per sample.

`ClientPool`: what a generate function (built-in or custom, see `slime_rl.rollout.custom`) talks
to. It routes, names every request after its group, remembers which requests of which group are
in flight on which engine, and can abort groups. Aborts name every live request by its exact rid:
SGLang 0.5.23's tokenizer manager drops an `/abort_request` whose rid is not the rid of a request it
holds (tokenizer_manager.abort_request, one tokenizer worker), so a rid prefix aborts nothing on a
real server. Request ids are `<nonce>-g<10 digits>-s<10 digits>-r<10 digits>`: unique per request (r
counts the pool's requests), readable in engine logs, and none a prefix of another (SGLang's
scheduler, past the tokenizer manager, aborts by prefix). The nonce is drawn per pool, so two rollouts
sharing the engines (training and eval) never collide.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from slime_rl.config.seeds import sampling_seed
from slime_rl.data import Sample
from slime_rl.data.images import IMAGE_PAD, VISION_START
from slime_rl.engines.client import AsyncEngineClient, EngineError
from slime_rl.engines.payloads import image_data_of, one_pad_per_image
from slime_rl.rollout.health import EngineHealth, NoLiveEngineError

_WIDTH = 10  # digits in group and sample numbers: fixed width keeps prefixes prefix-free
# `ClientPool.generate_body` files a request that names no sample here: aborted with any group
UNATTRIBUTED = -1


@dataclass
class EngineEndpoint:
    url: str
    api_key: str | None = None


def group_prefix(nonce: str, group_index: int) -> str:
    if not 0 <= group_index < 10**_WIDTH:
        raise ValueError(f"group index {group_index} does not fit {_WIDTH} digits")
    return f"{nonce}-g{group_index:0{_WIDTH}d}-"


def request_id(nonce: str, group_index: int, sample_index: int, n: int) -> str:
    # fixed width throughout: no rid is a prefix of another, which matters past the tokenizer manager,
    # since SGLang's scheduler aborts every request whose rid starts with the forwarded one
    return f"{group_prefix(nonce, group_index)}s{sample_index:0{_WIDTH}d}-r{n:0{_WIDTH}d}"


class LoadBalancer:
    """Least-in-flight routing over engine clients, at most `per_engine` samples in flight on each
    (a request of k samples holds k of those slots); counts samples per engine (`sent`, `in_flight`,
    `peak`). Waiters are served first come, first served, so a large request is not starved by
    small ones."""

    def __init__(self, clients: Sequence[AsyncEngineClient], per_engine: int = 64) -> None:
        if not clients:
            raise ValueError("no rollout engines")
        if per_engine < 1:
            raise ValueError(f"--concurrency-per-engine {per_engine}: must be >= 1")
        self.clients = list(clients)
        self.per_engine = per_engine
        self.in_flight = [0] * len(clients)
        self.sent = [0] * len(clients)
        self.peak = [0] * len(clients)
        # a router client stands for `num_engines` engines: the cap stays per engine
        self.capacity = per_engine * sum(getattr(c, "num_engines", 1) for c in clients)
        self._free = self.capacity
        self._waiters: collections.deque[tuple[int, asyncio.Future]] = collections.deque()
        self.health: EngineHealth | None = None  # --use-fault-tolerance: dead engines get nothing

    async def _take(self, weight: int) -> None:
        if not self._waiters and self._free >= weight:
            self._free -= weight
            return
        fut = asyncio.get_running_loop().create_future()
        entry = (weight, fut)
        self._waiters.append(entry)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled: hand the slots back
                self._give(weight)
            elif entry in self._waiters:
                self._waiters.remove(entry)
                self._give(0)  # the next waiter may fit now that this one left the head
            raise

    def _give(self, weight: int) -> None:
        self._free += weight
        while self._waiters and self._free >= self._waiters[0][0]:
            w, fut = self._waiters.popleft()
            if fut.done():
                continue
            self._free -= w
            fut.set_result(None)

    async def acquire(self, weight: int = 1) -> int:
        """An engine index for a request of `weight` samples (1 <= weight <= per_engine)."""
        if not 1 <= weight <= self.per_engine:
            raise ValueError(f"a request of {weight} samples: expected 1..{self.per_engine} "
                             "(--concurrency-per-engine)")
        await self._take(weight)
        live = range(len(self.clients)) if self.health is None else self.health.alive()
        if not live:
            self._give(weight)
            raise NoLiveEngineError(f"every rollout engine is dead: {self.health.reasons}")
        # ties go to the engine that got fewer requests so far, so a quiet start still alternates
        i = min(live, key=lambda k: (self.in_flight[k], self.sent[k]))
        self.in_flight[i] += weight
        self.sent[i] += weight
        self.peak[i] = max(self.peak[i], self.in_flight[i])
        return i

    def release(self, i: int, weight: int = 1) -> None:
        self.in_flight[i] -= weight
        self._give(weight)

    def counters(self) -> list[dict[str, Any]]:
        """Per engine: its URL, samples sent, in flight now, and the most in flight at once."""
        return [{"url": getattr(c, "base_url", str(k)), "sent": self.sent[k], "in_flight": self.in_flight[k],
                 "peak": self.peak[k]} for k, c in enumerate(self.clients)]


class _EngineDied(Exception):
    """The engine of a request was declared dead: send the request again elsewhere."""


def stopped_response(message: str) -> dict[str, Any]:
    """What a request that was never sent answers: SGLang's shape of an abort with no tokens."""
    return {"text": "", "output_ids": [],
            "meta_info": {"finish_reason": {"type": "abort", "message": message}, "output_token_logprobs": []}}


class ClientPool:
    """The engines as one generate endpoint, plus what a generate function needs around it.

    Attributes a custom generate function may use: `tokenizer` (to decode model turns and encode
    environment text), `max_context_len` (None: no cap), `budget(sample, max_new_tokens)`.
    """

    def __init__(self, clients: Sequence[AsyncEngineClient], tokenizer: Any, per_engine: int = 64,
                 max_context_len: int | None = None, sample_seed: int | None = None,
                 health: EngineHealth | None = None, return_routed_experts: bool = False) -> None:
        # sample_seed: every request carries SGLang's sampling_seed, drawn from this seed, the sample's
        # index and its length so far, so tokens depend on neither batching, engine nor restarts
        self.sample_seed = sample_seed
        # every /generate asks for SGLang's routed_experts (partial.append_model_turn keeps them)
        self.return_routed_experts = return_routed_experts
        self.balancer = LoadBalancer(clients, per_engine)
        self.balancer.health = self.health = health
        self.tokenizer = tokenizer
        self.max_context_len = max_context_len
        self.nonce = secrets.token_hex(4)
        self.stopped = False
        self.context_capped = 0  # requests whose max_new_tokens the context length cut
        self._n = itertools.count()
        # group -> {rid: engine index} of the requests sent and not yet answered: what an abort names
        self._live: dict[int, dict[str, int]] = {}
        self._aborts: set[asyncio.Future] = set()  # aborts of cancelled requests, in flight
        self._closers: list[Any] = []  # async callables `aclose` awaits (e.g. an HTTP endpoint's shutdown)
        self.attachments: dict[str, Any] = {}  # what callers keep per pool (e.g. that endpoint)

    @property
    def clients(self) -> list[AsyncEngineClient]:
        return self.balancer.clients

    def budget(self, sample: Sample, max_response_len: int, count: bool = True) -> int:
        """New tokens this sample may still generate: what is left of `max_response_len` after the
        response so far (earlier turns, a cut partial rollout), capped so that prompt + response
        stays within `max_context_len`. `count`: this budget is for a request, so a cut by the
        context length counts in `context_capped` (False for other uses, e.g. sizing tool output)."""
        left = max_response_len - len(sample.response_ids)
        if self.max_context_len is not None:
            room = self.max_context_len - len(sample.prompt_ids) - len(sample.response_ids)
            if room < left:
                self.context_capped += int(count)
                left = room
        return max(left, 0)

    @property
    def batches(self) -> bool:
        """Whether every client takes SGLang's batch form of /generate (a list of input_ids with a
        list of sampling_params): engines do; sglang-router does not (its /generate body has one
        sampling_params object), nor does a client that does not say so (`batch_generate`)."""
        return all(getattr(c, "batch_generate", False) for c in self.clients)

    @property
    def max_batch(self) -> int:
        """The most samples one request may carry: the per-engine cap (--concurrency-per-engine)."""
        return self.balancer.per_engine

    async def generate(self, sample: Sample, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> dict:
        """POST /generate on the least busy engine, with log-probs, under a rid of the sample's group.
        After `stop()`, requests not yet sent are not sent: they answer an abort with no tokens.
        With `health` (fault tolerance), a request whose engine dies is sent again, unchanged, to a
        live engine (see `slime_rl.rollout.health`)."""
        return (await self._send_retrying([sample], [input_ids], [sampling_params], batch=False))[0]

    async def generate_many(self, samples: Sequence[Sample], input_ids: Sequence[Sequence[int]],
                            sampling_params: Sequence[dict[str, Any]]) -> list[dict]:
        """`generate` for several samples in ONE /generate request (SGLang's batch form: lists of
        input_ids, sampling_params, rid and image_data, one entry per sample; the answer is the list
        of per-sample answers in the same order). Each sample keeps its own rid (so an abort names
        it alone), its own sampling_seed and budget. At most `max_batch` samples; needs `batches`."""
        if not samples or not len(samples) == len(input_ids) == len(sampling_params):
            raise ValueError(f"generate_many: {len(samples)} samples, {len(input_ids)} inputs and "
                             f"{len(sampling_params)} sampling_params (expected the same, >= 1)")
        if len(samples) > self.max_batch:
            raise ValueError(f"generate_many: {len(samples)} samples in one request, at most {self.max_batch} "
                             "(--concurrency-per-engine)")
        return await self._send_retrying(list(samples), list(input_ids), list(sampling_params), batch=True)

    async def _send_retrying(self, samples: list[Sample], inputs: list[Sequence[int]],
                             params: list[dict[str, Any]], batch: bool) -> list[dict]:
        while True:
            try:
                return await self._send(samples, inputs, params, batch)
            except _EngineDied:
                self.health.retried += 1

    def seeded(self, sample: Sample, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> dict[str, Any]:
        """`sampling_params` with the sample's sampling_seed (--deterministic-rollout), drawn from the
        pool's seed (the run seed), the sample's index and its length so far (`config.seeds.sampling_seed`)."""
        if self.sample_seed is None:
            return sampling_params
        return {**sampling_params, "sampling_seed": sampling_seed(self.sample_seed, sample.index, len(input_ids))}

    async def _send(self, samples: list[Sample], inputs: list[Sequence[int]], params: list[dict[str, Any]],
                    batch: bool) -> list[dict]:
        k = len(samples)
        if self.stopped:
            return [stopped_response("rollout stopped before the request was sent") for _ in range(k)]
        i = await self.balancer.acquire(k)
        if self.stopped:  # stop() ran while this request waited for a slot
            self.balancer.release(i, k)
            return [stopped_response("rollout stopped before the request was sent") for _ in range(k)]
        rids = [request_id(self.nonce, s.group_index, s.index, next(self._n)) for s in samples]
        for s, rid in zip(samples, rids, strict=True):
            self._live.setdefault(s.group_index, {})[rid] = i
        try:
            ids, images = [], []
            for s, x in zip(samples, inputs, strict=True):
                x = list(x)
                if s.images:  # SGLang wants one <|image_pad|> per image; the sample keeps them expanded
                    x = one_pad_per_image(x, len(s.prompt_ids), len(s.images), *self._vision_ids())
                ids.append(x)
                images.append(image_data_of(s.images))
            sps = [self.seeded(s, x, p) for s, x, p in zip(samples, inputs, params, strict=True)]
            client = self.balancer.clients[i]
            routed = {"return_routed_experts": True} if self.return_routed_experts else {}
            if batch:
                call = client.generate(input_ids=ids, sampling_params=sps, return_logprob=True, rid=rids,
                                       image_data=images if any(images) else None, **routed)
            else:
                call = client.generate(input_ids=ids[0], sampling_params=sps[0], return_logprob=True, rid=rids[0],
                                       image_data=images[0], **routed)
            out = await self._unless_dead(i, call)
            outs = out if batch else [out]
            if not isinstance(outs, list) or len(outs) != k:
                raise RuntimeError(f"engine {getattr(client, 'base_url', i)}: a /generate of {k} prompts "
                                   f"answered {len(outs) if isinstance(outs, list) else type(outs).__name__} "
                                   "items")
            for s, x, o in zip(samples, inputs, outs, strict=True):
                expanded = (o.get("meta_info") or {}).get("prompt_tokens")
                if s.images and expanded is not None and expanded != len(x):
                    # the response is aligned after the trainer's prompt only if both expanded the same way
                    raise RuntimeError(f"sample {s.index}: the engine expanded its images to a prompt of "
                                       f"{expanded} tokens, the trainer holds {len(x)}: the engine's image "
                                       "processor sizes images unlike the data side (--min-pixels/--max-pixels)")
            return outs
        except asyncio.CancelledError:
            # the caller gave up (an agent's timeout): the engine stops these requests too rather than decode
            # them to the end for nobody (shielded from this cancellation, not awaited)
            self._abort_later(i, rids)
            raise
        finally:
            self.balancer.release(i, k)
            for s, rid in zip(samples, rids, strict=True):
                live = self._live.get(s.group_index)
                if live is not None:
                    live.pop(rid, None)
                    if not live:
                        del self._live[s.group_index]

    async def generate_body(self, body: dict[str, Any], group_index: int | None = None,
                            sample_index: int = 0) -> dict:
        """A /generate body built by a user's function (slime's `generate` posts one), sent to the
        least busy engine with a rid of this pool. `group_index`: the sample's group (aborted with
        it); None: filed under UNATTRIBUTED, which any `abort_groups` call aborts too (a request of
        some group still running: the rollout aborts only once it stops, and then every running
        group). One prompt per body; routing, slots, `stop()`, failover and --deterministic-rollout
        seeds as for `generate`."""
        if isinstance(body.get("text"), list) or (isinstance(body.get("input_ids"), list) and body["input_ids"]
                                                  and isinstance(body["input_ids"][0], list)):
            raise ValueError("a /generate body of several prompts: send one prompt per request")
        group = UNATTRIBUTED if group_index is None else group_index
        while True:
            if self.stopped:
                return stopped_response("rollout stopped before the request was sent")
            i = await self.balancer.acquire(1)
            if self.stopped:
                self.balancer.release(i, 1)
                return stopped_response("rollout stopped before the request was sent")
            n = next(self._n)
            rid = (request_id(self.nonce, group, sample_index, n) if group >= 0
                   else f"{self.nonce}-x-r{n:0{_WIDTH}d}")
            self._live.setdefault(group, {})[rid] = i
            payload = {**body, "rid": rid}
            if self.sample_seed is not None and group >= 0 and isinstance(payload.get("sampling_params"), dict):
                length = len(payload.get("input_ids") or [])
                seed = (self.sample_seed * 1_000_003 + sample_index * 7919 + length) % (2**31 - 1)
                payload["sampling_params"] = {**payload["sampling_params"], "sampling_seed": seed}
            try:
                return await self._unless_dead(i, self.balancer.clients[i].generate_body(payload))
            except _EngineDied:
                self.health.retried += 1
            finally:
                self.balancer.release(i, 1)
                live = self._live.get(group)
                if live is not None:
                    live.pop(rid, None)
                    if not live:
                        del self._live[group]

    async def attach(self, name: str, make: Callable[[], Any]) -> Any:
        """The pool's object `name` (e.g. an HTTP endpoint in front of it): `make()`, started (`await
        obj.start()`) on first use, under a lock so concurrent first uses start one, and closed (`await
        obj.close()`) by `aclose`."""
        lock = self.attachments.setdefault(f"{name}_lock", asyncio.Lock())
        async with lock:
            obj = self.attachments.get(name)
            if obj is None:
                obj = make()
                await obj.start()
                self.attachments[name] = obj

                async def close() -> None:
                    self.attachments.pop(name, None)
                    await obj.close()
                self.on_close(close)
            return obj

    def on_close(self, closer: Any) -> None:
        """Have `aclose` await `closer()` (a coroutine function)."""
        self._closers.append(closer)

    async def aclose(self) -> None:
        """Run the closers (`on_close`), newest first, and let the aborts of cancelled requests reach their
        engines; the engine clients are the caller's to close."""
        while self._closers:
            await self._closers.pop()()
        if self._aborts:
            await asyncio.gather(*list(self._aborts), return_exceptions=True)

    def _vision_ids(self) -> tuple[int, int]:
        """(<|image_pad|>, <|vision_start|>) ids of the tokenizer."""
        return tuple(int(self.tokenizer.convert_tokens_to_ids(t)) for t in (IMAGE_PAD, VISION_START))

    async def _unless_dead(self, i: int, call: Any) -> dict:
        """The engine's answer; `_EngineDied` once engine `i` is declared dead (this request failed
        without an answer, or the health monitor found the engine hung)."""
        if self.health is None:
            return await call
        request = asyncio.ensure_future(call)
        dead = asyncio.ensure_future(self.health.dead_event(i).wait())
        try:
            await asyncio.wait({request, dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            dead.cancel()
            if not request.done():
                request.cancel()  # the engine hangs: give up on this copy of the request
                with contextlib.suppress(asyncio.CancelledError, EngineError):
                    await request
        if request.cancelled():
            raise _EngineDied
        try:
            return request.result()
        except EngineError as e:
            if self.health.failed(i, e):
                raise _EngineDied from e
            raise

    def stop(self) -> None:
        """No new requests from now on (those in flight run until aborted or finished)."""
        self.stopped = True

    def live_rids(self, group_index: int) -> dict[str, int]:
        """{rid: engine index} of this group's requests sent and not yet answered."""
        return dict(self._live.get(group_index, {}))

    def _abort_later(self, i: int, rids: Sequence[str]) -> None:
        if self.health is not None and not self.health.is_alive(i):
            return
        def done(task: asyncio.Future) -> None:
            self._aborts.discard(task)
            if not task.cancelled():
                task.exception()  # retrieved: an engine gone meanwhile has nothing left to stop

        for rid in rids:
            task = asyncio.ensure_future(self.clients[i].abort_request(rid=rid))
            self._aborts.add(task)
            task.add_done_callback(done)

    async def abort_groups(self, group_indices: Sequence[int]) -> int:
        """Abort every in-flight request of these groups by its exact rid, on the engine that has
        it; returns the number of abort calls sent."""
        groups = list(group_indices) + ([UNATTRIBUTED] if group_indices and UNATTRIBUTED in self._live else [])
        calls = [self.clients[e].abort_request(rid=rid)
                 for g in groups for rid, e in sorted(self._live.get(g, {}).items())
                 if self.health is None or self.health.is_alive(e)]
        await asyncio.gather(*calls)
        return len(calls)

    def counters(self) -> list[dict[str, Any]]:
        return self.balancer.counters()

    def metrics(self) -> dict[str, float]:
        """Per-engine request counts as flat metrics (`rollout/engine<i>_requests`)."""
        out: dict[str, float] = {f"rollout/engine{k}_requests": float(c["sent"])
                                 for k, c in enumerate(self.counters())}
        out["rollout/context_capped_requests"] = float(self.context_capped)
        return out | (self.health.metrics() if self.health is not None else {})
