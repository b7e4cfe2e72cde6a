"""Group generation: each prompt sent `n_samples_per_prompt` times to the engines, every finished
sample scored as soon as it finishes, groups returned in prompt order.

Requests are spread over the engines by in-flight load (the least busy engine gets the next
request), so one slow engine does not hold the step. With the built-in generate function the
unfinished samples of a group travel in one /generate request (SGLang's batch form, see
`run_group`); SGLang answers it once every sample has finished or been aborted.

A sample is produced by a generate function (the built-in one turn, or
`--custom-generate-function-path`, see `slime_rl.rollout.custom`); a sample that is already done (a
surplus group carried over by partial rollout) is not generated again, and an ABORTED one is
continued from its response so far.

With `--group-rm` (a `GroupReward`) a group is scored in one call once all its samples are done.

`generate_groups` delivers exactly the rows it is given; `slime_rl.rollout.dynamic` adds
over-sampling, filters, aborts and partial rollout on top of the same pieces.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from slime_rl.config import RolloutConfig
from slime_rl.data import PromptRow, Sample
from slime_rl.engines.client import AsyncEngineClient
from slime_rl.observability import Progress
from slime_rl.rewards import GroupReward, RewardFn, call_reward
from slime_rl.rollout.custom import (
    GenerateFn,
    generate_default,
    generate_group_default,
    rollout_generate_function,
)
from slime_rl.rollout.options import RolloutOptions
from slime_rl.rollout.options import sampling_params as options_sampling_params
from slime_rl.rollout.partial import is_done, mask_offpolicy
from slime_rl.rollout.routing import ClientPool, EngineEndpoint, LoadBalancer

__all__ = ["ClientPool", "EngineEndpoint", "LoadBalancer", "generate_groups", "make_groups", "run_group",
           "run_sample", "sampling_params"]


def sampling_params(cfg: RolloutConfig, stop_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """SGLang sampling_params for the rollout flags (kept for callers holding a RolloutConfig)."""
    return options_sampling_params(RolloutOptions.from_config(cfg, rollout_stop_token_ids=tuple(stop_token_ids)))


def make_groups(rows: Sequence[PromptRow], n_samples_per_prompt: int, indices: itertools.count,
                groups: itertools.count) -> list[list[Sample]]:
    """Fresh groups for `rows`; `indices` / `groups` hand out run-wide unique sample and group numbers."""
    out = []
    for row in rows:
        g = next(groups)
        out.append([Sample(index=next(indices), group_index=g, prompt=row.prompt, prompt_ids=list(row.prompt_ids),
                           label=row.label, metadata=dict(row.metadata), images=list(row.images),
                           image_grid_thw=[list(g) for g in row.image_grid_thw])
                    for _ in range(n_samples_per_prompt)])
    return out


async def run_sample(pool: ClientPool, sample: Sample, params: dict[str, Any], generate_fn: GenerateFn,
                     reward_fn: RewardFn | GroupReward, mask_offpolicy_tokens: bool = False,
                     score_unfinished: bool = False, stats: dict[str, int] | None = None) -> Sample:
    """Generate (or continue) one sample and score it once it is done. `score_unfinished` also scores
    a sample that stayed ABORTED (a caller that has no way to continue it, like `generate_groups`)."""
    generated = not is_done(sample)
    if generated:
        sample = await generate_fn(sample, params, pool)
    return await _after_generate(sample, generated, reward_fn, mask_offpolicy_tokens, score_unfinished, stats)


async def _after_generate(sample: Sample, generated: bool, reward_fn: RewardFn | GroupReward,
                          mask_offpolicy_tokens: bool = False, score_unfinished: bool = False,
                          stats: dict[str, int] | None = None) -> Sample:
    if generated and is_done(sample) and mask_offpolicy_tokens:
        masked = mask_offpolicy(sample)
        if stats is not None:
            stats["offpolicy_tokens_masked"] = stats.get("offpolicy_tokens_masked", 0) + masked
    if not isinstance(reward_fn, GroupReward) and sample.reward is None and (is_done(sample) or score_unfinished):
        sample.reward = await call_reward(reward_fn, sample)
    return sample


async def run_group(pool: ClientPool, group: list[Sample], params: dict[str, Any], generate_fn: GenerateFn,
                    reward_fn: RewardFn | GroupReward, on_sample: Callable[[Sample], None] | None = None,
                    **kw: Any) -> list[Sample]:
    """All samples of one group concurrently; returns the group (the same list, entries replaced by
    what the generate function returned). With the built-in generate function and engines that take
    SGLang's batch form (`pool.batches`), the group's unfinished samples go in one /generate request
    (split at `pool.max_batch`); otherwise (a custom generate function, sglang-router) one request
    per sample."""
    async def one(k: int) -> None:
        group[k] = await run_sample(pool, group[k], params, generate_fn, reward_fn, **kw)
        if on_sample is not None:
            on_sample(group[k])

    async def after(k: int, generated: bool) -> None:
        group[k] = await _after_generate(group[k], generated, reward_fn, **kw)
        if on_sample is not None:
            on_sample(group[k])

    if generate_fn is generate_default and pool.batches:
        todo = [k for k, s in enumerate(group) if not is_done(s)]
        if todo:
            await generate_group_default([group[k] for k in todo], params, pool)
        sent = set(todo)
        await asyncio.gather(*(after(k, k in sent) for k in range(len(group))))
    else:
        await asyncio.gather(*(one(k) for k in range(len(group))))
    if isinstance(reward_fn, GroupReward):
        await _score_group(reward_fn, group, kw.get("score_unfinished", False))
    return group


async def _score_group(reward_fn: GroupReward, group: list[Sample], score_unfinished: bool) -> None:
    """`--group-rm`: the whole group in one call, once every sample is done (a group cut by an abort
    is scored when partial rollout has finished it, so the function always sees complete groups)."""
    if all(s.reward is not None for s in group):
        return  # a carried-over group scored before it was cut
    if not (score_unfinished or all(is_done(s) for s in group)):
        return
    for sample, (score, metrics) in zip(group, await reward_fn(group), strict=True):
        sample.reward, sample.reward_metrics = score, metrics


async def generate_groups(clients: Sequence[AsyncEngineClient], rows: Sequence[PromptRow], cfg: RolloutConfig,
                          reward_fn: RewardFn | GroupReward, tokenizer, first_index: int = 0, first_group: int = 0,
                          stop_token_ids: Sequence[int] = (), progress: bool = True, *,
                          options: RolloutOptions | None = None, generate_fn: GenerateFn | None = None,
                          pool: ClientPool | None = None, slime_args: Any = None) -> list[list[Sample]]:
    """One group of `n_samples_per_prompt` scored samples per row, in row order.

    `options` (default: built from `cfg`) adds stop strings, the context cap and the generate function
    path; `pool` lets the caller read the per-engine counters afterwards."""
    opts = options or RolloutOptions.from_config(cfg, rollout_stop_token_ids=tuple(stop_token_ids) or None)
    own_pool = pool is None
    pool = pool or ClientPool(clients, tokenizer, opts.concurrency_per_engine, opts.rollout_max_context_len,
                              return_routed_experts=opts.return_routed_experts)
    gen = generate_fn or rollout_generate_function(opts, slime_args)
    params = options_sampling_params(opts)
    groups = make_groups(rows, opts.n_samples_per_prompt, itertools.count(first_index), itertools.count(first_group))
    bar = Progress(sum(len(g) for g in groups), "rollout", enabled=progress)
    try:
        await asyncio.gather(*(run_group(pool, g, params, gen, reward_fn, on_sample=lambda _: bar.update(1),
                                         score_unfinished=True) for g in groups))
    finally:
        bar.close()
        if own_pool:
            await pool.aclose()
    return groups
