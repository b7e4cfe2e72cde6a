"""slime's generate and filter functions in our rollout.

`--custom-generate-function-path` written slime's way, `async def generate(args, sample,
sampling_params) -> Sample`, posts SGLang's /generate body to
`http://{args.sglang_router_ip}:{args.sglang_router_port}/generate` itself and fills slime's Sample
from the answer. `SlimeGenerate` runs it: `args` points at an HTTP endpoint on 127.0.0.1
(`SlimeEndpoint`, one per `ClientPool`, started at the first call, closed with the pool) that sends
each body on through the pool (least-busy engine, a rid, per-engine slots, failover, aborts);
`slime.utils.http_utils.post` (ours where slime is not installed) names the sample in a header, so
its requests are aborted with its group. The sample goes in as slime's Sample
(`data.slime_compat.to_slime`) and comes back through `from_slime`, which checks what the function
did: the prompt ids unchanged at the head of `tokens`, `response_length`, `loss_mask` and
`rollout_log_probs` one entry per response token, a final status. `sampling_params["max_new_tokens"]`
is the response budget plus the response so far (slime's generate subtracts `response_length`),
so the context cap (--rollout-max-context-len) holds too. A function with an `evaluation` parameter
gets `evaluation=False`. Returning several samples (slime's fan-out) is refused.

`--dynamic-sampling-filter-path` written slime's way, `filter(args, samples) -> bool |
DynamicFilterOutput`, gets the group as slime's Samples (rewards as floats); `keep` decides, and a
DynamicFilterOutput's `keep_when_insufficient` is not honoured (the group is dropped; warned once).
"""

from __future__ import annotations

import argparse
import copy
import inspect
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from slime_rl.data import Sample
from slime_rl.data.slime_compat import (
    CURRENT_SAMPLE,
    INTERNAL_METADATA,
    SAMPLE_HEADER,
    slime_sample_class,
    status_value,
    to_slime,
)
from slime_rl.engines.client import EngineError
from slime_rl.rewards import resolve_reward
from slime_rl.rollout.partial import ABORTED, COMPLETED, STATUS, TRUNCATED, token_versions
from slime_rl.rollout.routing import ClientPool

GENERATE_FLAG = "--custom-generate-function-path"
FILTER_FLAG = "--dynamic-sampling-filter-path"
# slime's status -> (our status, finish_reason); slime's FAILED is a finished sample (it is scored)
_STATUS = {"completed": (COMPLETED, "stop"), "truncated": (TRUNCATED, "length"), "aborted": (ABORTED, "abort"),
           "failed": (COMPLETED, "failed")}


def default_args() -> argparse.Namespace:
    """`args` for callers that have no Config (tests, direct calls): slime's generate-side names only."""
    return argparse.Namespace(reward_key=None, sglang_router_ip=None, sglang_router_port=None, partial_rollout=False,
                              ci_test=False, use_rollout_routing_replay=False, sglang_dp_size=None,
                              sglang_enable_deterministic_inference=False, rollout_global_dataset=True)


class SlimeEndpoint:
    """SGLang's /generate (and /health) on 127.0.0.1, answered through a `ClientPool`."""

    def __init__(self, pool: ClientPool) -> None:
        self.pool = pool
        self.host, self.port = "127.0.0.1", 0
        self._runner: Any = None

    async def start(self) -> tuple[str, int]:
        from aiohttp import web

        app = web.Application(client_max_size=1 << 30)
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        return self.host, self.port

    async def _health(self, request: Any) -> Any:
        from aiohttp import web

        return web.Response(text="ok")

    async def _generate(self, request: Any) -> Any:
        from aiohttp import web

        body = await request.json()
        group, index = None, 0
        named = request.headers.get(SAMPLE_HEADER)
        if named:
            g, _, i = named.partition("/")
            group, index = int(g), int(i)
        try:
            out = await self.pool.generate_body(body, group, index)
        except EngineError as exc:
            return web.json_response({"error": {"message": exc.message}}, status=exc.status or 502)
        except ValueError as exc:
            return web.json_response({"error": {"message": str(exc)}}, status=400)
        return web.json_response(out)

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def endpoint_of(pool: ClientPool) -> tuple[str, int]:
    """(host, port) of the pool's `SlimeEndpoint`, started on first use and closed by `pool.aclose()`."""
    endpoint = await pool.attach("slime_endpoint", lambda: SlimeEndpoint(pool))
    return endpoint.host, endpoint.port


def from_slime(out: Any, sample: Sample, path: str, reward_key: str | None = None) -> Sample:
    """What a slime generate function returned, written back into our `sample` (see the module
    docstring); errors name the flag, the path and the sample."""
    where = f"{GENERATE_FLAG} {path!r}: sample {sample.index}"
    if isinstance(out, list):
        raise ValueError(f"{where}: returned {len(out)} samples; one sample per prompt response is supported "
                         "(slime's fan-out into several training samples is not)")
    if not hasattr(out, "tokens") or not hasattr(out, "status"):
        raise ValueError(f"{where}: returned {type(out).__name__}; expected the Sample it was given")
    prompt = list(sample.prompt_ids)
    tokens = [int(t) for t in (out.tokens or prompt)]
    if tokens[:len(prompt)] != prompt:
        raise ValueError(f"{where}: sample.tokens no longer starts with the prompt's {len(prompt)} ids; tokens "
                         "must be the prompt ids followed by the response")
    response = tokens[len(prompt):]
    n = len(response)
    if int(out.response_length) != n:
        raise ValueError(f"{where}: response_length {out.response_length} but tokens hold {n} response tokens")
    mask = [int(m) for m in out.loss_mask] if out.loss_mask is not None else [1] * n
    logprobs = [float(x) for x in out.rollout_log_probs] if out.rollout_log_probs is not None else None
    if logprobs is None and n:
        raise ValueError(f"{where}: {n} response tokens and no rollout_log_probs; send return_logprob and keep the "
                         "engine's log-probs (sample.append_response_tokens(args, tokens=..., log_probs=...))")
    logprobs = logprobs or []
    if len(mask) != n or len(logprobs) != n:
        raise ValueError(f"{where}: loss_mask has {len(mask)} and rollout_log_probs {len(logprobs)} entries for "
                         f"{n} response tokens")
    status = status_value(out)
    if status not in _STATUS:
        raise ValueError(f"{where}: returned with status {status!r}; expected completed, truncated, aborted or "
                         "failed")
    latest = out.weight_versions[-1] if getattr(out, "weight_versions", None) else None
    before, versions = len(sample.response_ids), list(token_versions(sample))
    if n >= before and response[:before] == sample.response_ids:  # continued: earlier tokens keep their versions
        versions = versions[:before] + [latest if m else None for m in mask[before:]]
    else:  # rewritten from the start
        versions = [latest if m else None for m in mask]
    routed = getattr(out, "rollout_routed_experts", None)
    if routed is not None:  # slime's [rows, layers, top_k] (tensor or lists) -> ours [rows, layers * top_k]
        routed = np.asarray(routed.cpu() if hasattr(routed, "cpu") else routed, dtype=np.int32)
        if routed.ndim < 1 or not 0 < routed.shape[0] <= len(tokens) - 1:
            raise ValueError(f"{where}: rollout_routed_experts has {routed.shape[0] if routed.ndim else 0} rows for "
                             f"{len(tokens)} tokens (one per position fed to the engine: at most {len(tokens) - 1})")
        sample.rollout_routed_experts = routed.reshape(routed.shape[0], -1)
    sample.response_ids, sample.rollout_logprobs, sample.loss_mask = response, logprobs, mask
    sample.response = str(out.response or "")
    metadata = out.metadata if isinstance(out.metadata, dict) else {}
    sample.metadata.update({k: v for k, v in metadata.items() if k not in INTERNAL_METADATA})
    sample.metadata[STATUS], sample.finish_reason = _STATUS[status]
    token_versions(sample)[:] = versions
    if latest is not None:
        sample.weight_version = str(latest)
    if out.reward is not None:  # the function scored the sample itself
        result = resolve_reward(out.reward, reward_key or "score", path)
        sample.reward, sample.reward_metrics = result.score, dict(result.metrics)
    return sample


class SlimeGenerate:
    """A slime-style generate function in our convention `(sample, sampling_params, client_pool)`."""

    def __init__(self, fn: Callable, args: Any, path: str, evaluating: bool = False) -> None:
        self.fn, self.args, self.path = fn, args, path
        self.__name__ = getattr(fn, "__name__", "generate")
        try:
            self.evaluation = "evaluation" in inspect.signature(fn).parameters
        except (TypeError, ValueError):
            self.evaluation = False
        self.evaluating = evaluating  # what an `evaluation` parameter gets: True for eval samples (as slime)
        self._cls = slime_sample_class()

    def for_eval(self) -> SlimeGenerate:
        """The same function for eval samples: an `evaluation` parameter gets True, as slime's eval passes it."""
        return SlimeGenerate(self.fn, self.args, self.path, evaluating=True)

    async def __call__(self, sample: Sample, sampling_params: dict[str, Any], client_pool: ClientPool) -> Sample:
        host, port = await endpoint_of(client_pool)
        args = copy.copy(self.args)
        args.sglang_router_ip, args.sglang_router_port = host, port
        params = dict(sampling_params)
        # slime's generate subtracts response_length itself: give it our budget (context cap included) plus that
        params["max_new_tokens"] = client_pool.budget(sample, params["max_new_tokens"]) + len(sample.response_ids)
        token = CURRENT_SAMPLE.set((sample.group_index, sample.index))
        try:
            kwargs = {"evaluation": self.evaluating} if self.evaluation else {}
            out = await self.fn(args, to_slime(sample, self._cls), params, **kwargs)
        finally:
            CURRENT_SAMPLE.reset(token)
        return from_slime(out, sample, self.path, getattr(self.args, "reward_key", None))


class SlimeFilter:
    """A slime-style dynamic-sampling filter in our convention `(group) -> bool`."""

    def __init__(self, fn: Callable, args: Any, path: str) -> None:
        self.fn, self.args, self.path = fn, args, path
        self.__name__ = getattr(fn, "__name__", "filter")
        self._cls = slime_sample_class()
        self._warned = False

    def __call__(self, group: list[Sample]) -> bool:
        out = self.fn(self.args, [to_slime(s, self._cls) for s in group])
        if hasattr(out, "keep"):
            if not out.keep and getattr(out, "keep_when_insufficient", False) and not self._warned:
                self._warned = True
                print(f"[slime_rl] {FILTER_FLAG} {self.path}: DynamicFilterOutput.keep_when_insufficient is not "
                      "honoured; such groups are dropped like any other", file=sys.stderr, flush=True)
            out = out.keep
        try:
            return bool(out)
        except (TypeError, RuntimeError, ValueError) as exc:
            raise ValueError(f"{FILTER_FLAG} {self.path!r}: returned {out!r:.80}; expected a bool or a "
                             "DynamicFilterOutput") from exc
