"""DAPO dynamic sampling with over-sampling, and partial rollout.

`generate_filtered_groups` keeps drawing prompts in batches of `over_sampling_batch_size` while
the groups kept plus the groups in flight fall short of `rollout_batch_size`, generates them
concurrently, and passes each finished, scored group through the filter
(`--dynamic-sampling-filter-path`, e.g. `slime_rl.rollout.filters.check_reward_nonzero_std`). Once
exactly `rollout_batch_size` groups are kept, or the deadline passes, or the prompts run out, it
stops sending and aborts what is still in flight, group by group, each request by its exact rid
(see `routing`: SGLang drops an abort whose rid is not a live one).

What was cut (groups with ABORTED samples: tokens and log-probs so far, per-token versions) and
what finished after the target was reached (surplus) is returned as `leftover` under
`--partial-rollout`: pass it back as `resume=` next step and those groups go first, each ABORTED
sample continued from prompt + response so far with the rest of its budget. Without partial
rollout these groups are dropped and only counted.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slime_rl.data import PromptRow, Sample
from slime_rl.engines.client import AsyncEngineClient
from slime_rl.observability import Progress
from slime_rl.rewards import GroupReward, RewardFn
from slime_rl.rollout.custom import FilterFn, GenerateFn, load_filter, rollout_generate_function
from slime_rl.rollout.generate import make_groups, run_group
from slime_rl.rollout.health import EngineHealth
from slime_rl.rollout.options import RolloutOptions, sampling_params
from slime_rl.rollout.partial import COMPLETED, group_status
from slime_rl.rollout.routing import ClientPool

# a request can reach an engine just after its abort (SGLang drops an abort for a rid it does not hold
# yet): abort the still-live rids again until drained
ABORT_RETRY_S = 0.5


@dataclass
class RolloutResult:
    groups: list[list[Sample]]  # kept: finished, scored, passed the filter; rollout_batch_size unless cut short
    leftover: list[list[Sample]] = field(default_factory=list)  # partial rollout: continue these next step
    metrics: dict[str, float] = field(default_factory=dict)
    counters: list[dict[str, Any]] = field(default_factory=list)  # per engine: url, sent, in_flight, peak
    next_index: int = 0  # first unused sample index / group index, for the caller's next call
    next_group: int = 0


async def generate_filtered_groups(clients: Sequence[AsyncEngineClient],
                                   next_rows: Callable[[int], Sequence[PromptRow]], opts: RolloutOptions,
                                   reward_fn: RewardFn | GroupReward, tokenizer: Any, *,
                                   resume: Sequence[list[Sample]] = (),
                                   first_index: int = 0, first_group: int = 0,
                                   generate_fn: GenerateFn | None = None, filter_fn: FilterFn | None = None,
                                   progress: bool = False, health: EngineHealth | None = None,
                                   slime_args: Any = None, progress_desc: str = "rollout") -> RolloutResult:
    """Exactly `opts.rollout_batch_size` kept groups (fewer only at the deadline or when `next_rows`
    returns nothing), plus leftover groups and metrics. `next_rows(k)` returns up to k rows.
    `health` (--use-fault-tolerance): route around dead engines and resend their requests.
    `slime_args`: what slime-style generate and filter functions get as `args`.
    `progress`: samples finished of those the batch needs (a filtered group's are added to it),
    shown as `observability.Progress` under `progress_desc`."""
    pool = ClientPool(clients, tokenizer, opts.concurrency_per_engine, opts.rollout_max_context_len,
                      sample_seed=opts.sample_seed, health=health, return_routed_experts=opts.return_routed_experts)
    gen = generate_fn or rollout_generate_function(opts, slime_args)
    keep = filter_fn or load_filter(opts.dynamic_sampling_filter_path, slime_args, opts.dynamic_sampling_filter_kwargs)
    try:
        return await _fill(pool, next_rows, opts, reward_fn, gen, keep, resume, first_index, first_group, progress,
                           progress_desc)
    finally:
        await pool.aclose()


async def _fill(pool: ClientPool, next_rows: Callable[[int], Sequence[PromptRow]], opts: RolloutOptions,
                reward_fn: RewardFn | GroupReward, gen: GenerateFn, keep: FilterFn | None,
                resume: Sequence[list[Sample]], first_index: int, first_group: int,
                progress: bool, progress_desc: str = "rollout") -> RolloutResult:
    params = sampling_params(opts)
    indices, group_ids = itertools.count(first_index), itertools.count(first_group)
    target = opts.rollout_batch_size
    stats: dict[str, int] = {}
    run_kw = {"mask_offpolicy_tokens": opts.mask_offpolicy_in_partial_rollout, "stats": stats}
    running: dict[asyncio.Task, list[Sample]] = {}
    kept: list[list[Sample]] = []
    surplus: list[list[Sample]] = []
    cut: list[list[Sample]] = []
    drawn = filtered = 0
    # every completed group's task rewards, kept or not: with a filter, the kept groups' mean is
    # biased (DAPO's filter drops the all-correct groups, so kept groups of 8 average <= 7/8)
    scored = [0.0, 0]
    deadline_hit = exhausted = False
    loop = asyncio.get_running_loop()
    t_end = None if opts.rollout_deadline_s is None else loop.time() + opts.rollout_deadline_s
    bar = Progress(target * opts.n_samples_per_prompt, progress_desc, enabled=progress)

    def launch(group: list[Sample]) -> None:
        running[asyncio.create_task(run_group(pool, group, params, gen, reward_fn, on_sample=lambda _: bar.update(1),
                                              **run_kw))] = group

    for group in resume:  # carried-over groups first: their prompts were drawn steps ago
        launch(group)
    try:
        while len(kept) < target:
            while not exhausted and len(kept) + len(running) < target:
                rows = list(next_rows(opts.draw_size))
                exhausted = not rows
                drawn += len(rows)
                for group in make_groups(rows, opts.n_samples_per_prompt, indices, group_ids):
                    launch(group)
            if not running:
                break
            timeout = None if t_end is None else max(0.0, t_end - loop.time())
            done, _ = await asyncio.wait(running, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                deadline_hit = True
                break
            for task in sorted(done, key=lambda t: running[t][0].group_index):
                group = task.result()
                del running[task]
                if group_status(group) != COMPLETED:  # aborted from outside (engine paused for an update)
                    cut.append(group)
                    continue
                scored[0] += sum(float(x.reward) for x in group)
                scored[1] += len(group)
                if len(kept) >= target:
                    surplus.append(group)
                elif keep is None or keep(group):
                    kept.append(group)
                else:
                    filtered += 1
                    bar.add_total(len(group))
                bar.note(f"{len(kept)}/{target} groups kept" + (f", {filtered} filtered" if filtered else ""))
    finally:
        bar.close()
        aborts = await _stop_and_drain(pool, running)
    for group in running.values():
        (surplus if group_status(group) == COMPLETED else cut).append(group)
    leftover = sorted(cut + surplus, key=lambda g: g[0].group_index) if opts.partial_rollout else []
    metrics = {
        "rollout/prompts_drawn": float(drawn),
        "rollout/groups_resumed": float(len(resume)),
        "rollout/groups_kept": float(len(kept)),
        "rollout/groups_filtered": float(filtered),
        "rollout/reward_mean_before_filter": scored[0] / scored[1] if scored[1] else float("nan"),
        "rollout/groups_aborted": float(len(cut)),
        "rollout/groups_surplus": float(len(surplus)),
        "rollout/groups_leftover": float(len(leftover)),
        "rollout/abort_requests": float(aborts),
        "rollout/deadline_hit": float(deadline_hit),
        "rollout/offpolicy_tokens_masked": float(stats.get("offpolicy_tokens_masked", 0)),
        **pool.metrics(),
    }
    return RolloutResult(groups=sorted(kept, key=lambda g: g[0].group_index), leftover=leftover, metrics=metrics,
                         counters=pool.counters(), next_index=next(indices), next_group=next(group_ids))


async def _stop_and_drain(pool: ClientPool, running: dict[asyncio.Task, list[Sample]]) -> int:
    """Send nothing more, abort every group still running, wait until all their requests answered.
    Returns the number of abort calls. Re-raises the first error a group task hit."""
    pool.stop()
    pending = set(running)
    aborts = 0
    while pending:
        groups = sorted({running[t][0].group_index for t in pending})
        aborts += await pool.abort_groups(groups)
        _, pending = await asyncio.wait(pending, timeout=ABORT_RETRY_S)
    for task in running:
        task.result()  # an engine error in a cut group is still an error
    return aborts
