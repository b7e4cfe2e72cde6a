"""Routing of generate requests over the engines, request ids, and abort.

`LoadBalancer`: least-in-flight routing with at most `per_engine` requests in flight on each engine
(the rest wait here, not in the server's accept queue), and per-engine counters.

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
import contextlib
import itertools
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slime_rl.data import Sample
from slime_rl.data.images import IMAGE_PAD, VISION_START
from slime_rl.rollout.client import AsyncEngineClient, EngineError, image_data_of, one_pad_per_image
from slime_rl.rollout.health import EngineHealth, NoLiveEngineError

_WIDTH = 10  # digits in group and sample numbers: fixed width keeps prefixes prefix-free


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
    """Least-in-flight routing over engine clients, at most `per_engine` requests in flight on each;
    counts requests per engine (`sent`, `in_flight`, `peak`)."""

    def __init__(self, clients: Sequence[AsyncEngineClient], per_engine: int = 64) -> None:
        if not clients:
            raise ValueError("no rollout engines")
        if per_engine < 1:
            raise ValueError(f"--concurrency-per-engine {per_engine}: must be >= 1")
        self.clients = list(clients)
        self.in_flight = [0] * len(clients)
        self.sent = [0] * len(clients)
        self.peak = [0] * len(clients)
        # a router client stands for `num_engines` engines: the cap stays per engine
        self._slots = asyncio.Semaphore(per_engine * sum(getattr(c, "num_engines", 1) for c in clients))
        self.health: EngineHealth | None = None  # --use-fault-tolerance: dead engines get nothing

    async def acquire(self) -> int:
        await self._slots.acquire()
        live = range(len(self.clients)) if self.health is None else self.health.alive()
        if not live:
            self._slots.release()
            raise NoLiveEngineError(f"every rollout engine is dead: {self.health.reasons}")
        # ties go to the engine that got fewer requests so far, so a quiet start still alternates
        i = min(live, key=lambda k: (self.in_flight[k], self.sent[k]))
        self.in_flight[i] += 1
        self.sent[i] += 1
        self.peak[i] = max(self.peak[i], self.in_flight[i])
        return i

    def release(self, i: int) -> None:
        self.in_flight[i] -= 1
        self._slots.release()

    def counters(self) -> list[dict[str, Any]]:
        """Per engine: its URL, requests sent, in flight now, and the most in flight at once."""
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
                 health: EngineHealth | None = None) -> None:
        # sample_seed: every request carries SGLang's sampling_seed, drawn from this seed, the sample's
        # index and its length so far, so tokens depend on neither batching, engine nor restarts
        self.sample_seed = sample_seed
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

    async def generate(self, sample: Sample, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> dict:
        """POST /generate on the least busy engine, with log-probs, under a rid of the sample's group.
        After `stop()`, requests not yet sent are not sent: they answer an abort with no tokens.
        With `health` (fault tolerance), a request whose engine dies is sent again, unchanged, to a
        live engine (see `slime_rl.rollout.health`)."""
        while True:
            try:
                return await self._generate_once(sample, input_ids, sampling_params)
            except _EngineDied:
                self.health.retried += 1

    async def _generate_once(self, sample: Sample, input_ids: Sequence[int], sampling_params: dict[str, Any]) -> dict:
        if self.stopped:
            return stopped_response("rollout stopped before the request was sent")
        i = await self.balancer.acquire()
        if self.stopped:  # stop() ran while this request waited for a slot
            self.balancer.release(i)
            return stopped_response("rollout stopped before the request was sent")
        rid = request_id(self.nonce, sample.group_index, sample.index, next(self._n))
        live = self._live.setdefault(sample.group_index, {})
        live[rid] = i
        try:
            if self.sample_seed is not None:
                seed = (self.sample_seed * 1_000_003 + sample.index * 7919 + len(input_ids)) % (2**31 - 1)
                sampling_params = {**sampling_params, "sampling_seed": seed}
            ids = list(input_ids)
            if sample.images:  # SGLang wants one <|image_pad|> per image; the sample keeps them expanded
                ids = one_pad_per_image(ids, len(sample.prompt_ids), len(sample.images), *self._vision_ids())
            out = await self._unless_dead(i, self.balancer.clients[i].generate(
                input_ids=ids, sampling_params=sampling_params, return_logprob=True, rid=rid,
                image_data=image_data_of(sample.images)))
            expanded = (out.get("meta_info") or {}).get("prompt_tokens")
            if sample.images and expanded is not None and expanded != len(input_ids):
                # the response is aligned after the trainer's prompt only if both expanded the same way
                raise RuntimeError(f"sample {sample.index}: the engine expanded its images to a prompt of "
                                   f"{expanded} tokens, the trainer holds {len(input_ids)}: the engine's image "
                                   "processor sizes images unlike the data side (--min-pixels/--max-pixels)")
            return out
        finally:
            self.balancer.release(i)
            live.pop(rid, None)
            if not live:
                self._live.pop(sample.group_index, None)

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

    async def abort_groups(self, group_indices: Sequence[int]) -> int:
        """Abort every in-flight request of these groups by its exact rid, on the engine that has
        it; returns the number of abort calls sent."""
        calls = [self.clients[e].abort_request(rid=rid)
                 for g in group_indices for rid, e in sorted(self._live.get(g, {}).items())
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
