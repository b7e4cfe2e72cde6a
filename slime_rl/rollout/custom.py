"""Extension points of the rollout, loaded by dotted path ('pkg.module.fn' or 'pkg.module:fn').

| flag | protocol |
|---|---|
| --custom-generate-function-path | `async def generate(sample, sampling_params: dict, client_pool) -> Sample` |
| --custom-generate-function-path | an agent: `async def agent(client: openai.AsyncOpenAI, sample) -> reward or None` |
| --dynamic-sampling-filter-path | `def filter(group: list[Sample]) -> bool` (True keeps the group) |

An agent (a function of two parameters) talks to the model through an OpenAI client only; each sample is
one trajectory recorded token for token (`slime_rl.rollout.agent`).
slime's forms of both are accepted too, `async def generate(args, sample, sampling_params)` and
`def filter(args, samples) -> bool | DynamicFilterOutput`: the form is decided once, when the
function is loaded, from its signature (`config.dotted_path.choose_form`: a first parameter named
`args` is slime's), and a slime function runs through `slime_rl.rollout.slime_compat`.

A generate function fills `sample.response_ids` / `rollout_logprobs` / `loss_mask` (and the
per-token versions) through `slime_rl.rollout.partial.append_model_turn` and `append_env_tokens`,
asks the pool for requests (`await client_pool.generate(sample, input_ids, params)`, which routes,
names the request after the sample's group so aborts reach it, and returns SGLang's answer), and
keeps the response within `client_pool.budget(sample, sampling_params["max_new_tokens"])`. It may
be called again on a sample it returned ABORTED (partial rollout): it must continue from the
response so far, not start over. It leaves `sample.reward` None (the rollout scores finished
samples) unless it computes the reward itself. Examples: `generate_default` (one turn) and
`slime_rl.rollout.examples.calculator.generate` (a tool loop).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from slime_rl.config.dotted_path import choose_form, json_kwargs, load_by_path
from slime_rl.data import Sample
from slime_rl.rollout.partial import append_model_turn, mark_truncated
from slime_rl.rollout.routing import ClientPool
from slime_rl.rollout.slime_compat import FILTER_FLAG, GENERATE_FLAG, SlimeFilter, SlimeGenerate, default_args

GenerateFn = Callable[[Sample, dict[str, Any], ClientPool], Awaitable[Sample]]
FilterFn = Callable[[list[Sample]], bool]


async def generate_default(sample: Sample, sampling_params: dict[str, Any], client_pool: ClientPool) -> Sample:
    """One /generate call for the rest of the response: the prompt plus whatever a cut partial
    rollout already produced goes in as input_ids, max_new_tokens is what is left of the budget."""
    params = _budgeted(sample, sampling_params, client_pool)
    if params is None:
        return sample
    out = await client_pool.generate(sample, sample.prompt_ids + sample.response_ids, params)
    append_model_turn(sample, out, client_pool.tokenizer)
    return sample


def _budgeted(sample: Sample, sampling_params: dict[str, Any], client_pool: ClientPool) -> dict[str, Any] | None:
    """`sampling_params` with max_new_tokens cut to what is left of the sample's budget, or None (the
    sample marked truncated) when nothing is left."""
    budget = client_pool.budget(sample, sampling_params["max_new_tokens"])
    if budget <= 0:
        mark_truncated(sample)
        return None
    return {**sampling_params, "max_new_tokens": budget}


async def generate_group_default(samples: Sequence[Sample], sampling_params: dict[str, Any],
                                 client_pool: ClientPool) -> list[Sample]:
    """`generate_default` for several samples (the unfinished ones of a group) in as few /generate
    requests as the pool allows: SGLang's batch form, at most `client_pool.max_batch` samples per
    request, each sample with its own budget, seed and rid. The same tokens as one request per
    sample wherever the engine's sampling does not depend on the batch (deterministic rollout)."""
    todo = [(sample, params) for sample in samples
            if (params := _budgeted(sample, sampling_params, client_pool)) is not None]

    async def chunk(part: list[tuple[Sample, dict[str, Any]]]) -> None:
        outs = await client_pool.generate_many([s for s, _ in part], [s.prompt_ids + s.response_ids for s, _ in part],
                                               [p for _, p in part])
        for (sample, _), out in zip(part, outs, strict=True):
            append_model_turn(sample, out, client_pool.tokenizer)

    size = client_pool.max_batch
    await asyncio.gather(*(chunk(todo[k:k + size]) for k in range(0, len(todo), size)))
    return list(samples)


def load_generate_function(path: str | None, args: Any = None, agent_timeout_s: float | None = None,
                           agent_host: str = "127.0.0.1") -> GenerateFn:
    """The function `--custom-generate-function-path` names (an `async def`, ours or slime's), in our
    convention, or the built-in one. `args`: what a slime-style function gets first
    (`config.slime_args.slime_args(cfg)`; default: `slime_compat.default_args()`). `agent_timeout_s`,
    `agent_host`: an agent function's --agent-timeout-s and --agent-host."""
    if not path:
        return generate_default
    fn = load_by_path(path, GENERATE_FLAG)
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"{GENERATE_FLAG} {path!r}: {fn.__name__} must be an `async def` taking (sample, "
                         "sampling_params, client_pool), or slime's (args, sample, sampling_params), and returning "
                         "the Sample; or an agent's (client, sample) returning the reward")
    form = choose_form(fn, GENERATE_FLAG, path, {
        "ours": (3, "async generate(sample, sampling_params, client_pool) -> Sample"),
        "slime": (3, "async generate(args, sample, sampling_params) -> Sample"),
        "agent": (2, "async agent(client: openai.AsyncOpenAI, sample) -> float | None")})
    if form == "agent":
        from slime_rl.rollout.agent.runner import AgentGenerate

        return AgentGenerate(fn, path, agent_timeout_s, agent_host)
    return fn if form == "ours" else SlimeGenerate(fn, args if args is not None else default_args(), path)


def rollout_generate_function(rollout: Any, args: Any = None) -> GenerateFn:
    """The generate function of a run's rollout settings (a `RolloutConfig` or `RolloutOptions`): the
    --agent-env episode runner (a text environment's or a verifiers environment's), or what
    --custom-generate-function-path names, or the built-in one."""
    if getattr(rollout, "agent_env", None):
        from slime_rl.rollout.agent.envs import env_agent, load_env_factory
        from slime_rl.rollout.agent.runner import AgentGenerate
        from slime_rl.rollout.agent.verifiers_env import is_verifiers_spec, verifiers_agent

        if is_verifiers_spec(rollout.agent_env):  # a verifiers environment, its own harness and rewards
            agent = verifiers_agent(rollout.agent_env, rollout.agent_turn_max_tokens)
        else:
            agent = env_agent(load_env_factory(rollout.agent_env), rollout.agent_max_turns,
                              rollout.agent_turn_max_tokens)
        return AgentGenerate(agent, rollout.agent_env, getattr(rollout, "agent_timeout_s", None),
                             getattr(rollout, "agent_host", "127.0.0.1"))
    return load_generate_function(rollout.custom_generate_function_path, args,
                                  agent_timeout_s=getattr(rollout, "agent_timeout_s", None),
                                  agent_host=getattr(rollout, "agent_host", "127.0.0.1"))


def load_filter(path: str | None, args: Any = None, kwargs: str | dict[str, Any] | None = None) -> FilterFn | None:
    """The group filter `--dynamic-sampling-filter-path` names (ours or slime's), in our convention,
    or None (keep every group). `kwargs`: --dynamic-sampling-filter-kwargs (a JSON object), passed to
    it as keyword arguments."""
    if not path:
        if kwargs:
            raise ValueError("--dynamic-sampling-filter-kwargs needs --dynamic-sampling-filter-path")
        return None
    fn = load_by_path(path, FILTER_FLAG)
    if kwargs:
        fn = _bind_kwargs(fn, kwargs, "--dynamic-sampling-filter-kwargs")
    form = choose_form(fn, FILTER_FLAG, path, {"ours": (1, "filter(group) -> bool"),
                                              "slime": (2, "filter(args, samples) -> bool | DynamicFilterOutput")})
    return fn if form == "ours" else SlimeFilter(fn, args if args is not None else default_args(), path)


def _bind_kwargs(fn: Callable, kwargs: str | dict[str, Any], flag: str) -> Callable:
    """`fn` with keyword arguments from a JSON object (or dict), checked against its signature."""
    kwargs = json_kwargs(kwargs, flag)
    try:
        inspect.signature(fn).bind_partial(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{flag} {sorted(kwargs)}: {getattr(fn, '__name__', fn)} does not take them: {exc}") from exc
    return functools.wraps(fn)(functools.partial(fn, **kwargs))
