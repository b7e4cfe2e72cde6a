"""--fully-async: a rollout that never stops generating.

`GroupStream` keeps groups in flight on the engines all the time, across steps and weight updates: while
fewer than `capacity` groups are running or finished-and-not-taken, it draws prompts and launches groups;
each group that finishes is scored, passed through the dynamic-sampling filter, and queued. A step `take`s
the first `rollout_batch_size` queued groups (waiting for more when the queue is short) while the others keep
generating, so the trainer trains on what finished first and the engines never wait for it.

A weight update pauses the engines (SGLang's /pause_generation, mode abort): every request in flight comes
back ABORTED with the tokens it had, and the stream relaunches its group at once; the continuation waits in
the engine until the update ends and then runs under the new weights (prompt + response so far, the rest of
the budget), exactly as partial rollout continues a group next step. Each response token keeps the weight
version that sampled it (`rollout.partial`'s per-token versions), so a group's staleness at the step that
trains it is the trainer's version minus the oldest version among its tokens; with `max_staleness` K a
group staler than K is dropped at `take` (counted), never trained.

What the step reports (`take`'s metrics): rollout/staleness_mean / _max and rollout/staleness_<k> (groups
taken at each staleness), rollout/stale_groups_dropped, rollout/groups_continued_after_update (groups an
update interrupted and that went on), rollout/engine_idle_s (seconds since the last take with no group of
the stream in flight: the stream was full, waiting for the trainer) and perf/trainer_wait_s (how long
`take` waited for groups).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Callable, Sequence

from slime_rl.data import PromptRow, Sample
from slime_rl.rewards import GroupReward, RewardFn
from slime_rl.rollout.custom import FilterFn, GenerateFn
from slime_rl.rollout.generate import make_groups, run_group
from slime_rl.rollout.options import RolloutOptions, sampling_params
from slime_rl.rollout.partial import COMPLETED, group_status, token_versions
from slime_rl.rollout.routing import ClientPool


def version_number(version: str) -> int:
    """A weight version as the trainer counts them: the weight sync after step k sends version "k + 1" (a
    resume sends the resumed step); an engine that has had no sync reports SGLang's "default", its checkpoint's
    weights, which is version 0."""
    return int(version) if str(version).isdigit() else 0


def oldest_version(group: list[Sample]) -> int | None:
    """The oldest weight version among the group's model tokens (None: no token carries one)."""
    versions = [version_number(v) for s in group for v in token_versions(s) if v is not None]
    return min(versions) if versions else None


class GroupStream:
    """Generation that runs until `close`, independent of the steps (module docstring)."""

    def __init__(self, pool: ClientPool, next_rows: Callable[[int], Sequence[PromptRow]], opts: RolloutOptions,
                 reward_fn: RewardFn | GroupReward, gen: GenerateFn, keep: FilterFn | None, *,
                 resume: Sequence[list[Sample]] = (), first_index: int = 0, first_group: int = 0,
                 capacity: int | None = None) -> None:
        self.pool, self.next_rows, self.opts = pool, next_rows, opts
        self.reward_fn, self.gen, self.keep = reward_fn, gen, keep
        self.params = sampling_params(opts)
        self.indices, self.group_ids = itertools.count(first_index), itertools.count(first_group)
        # one batch ahead by default: what the next step needs is generating while this one trains
        self.capacity = capacity or max(opts.rollout_batch_size, opts.draw_size)
        self.running: dict[asyncio.Task, list[Sample]] = {}
        self.ready: list[list[Sample]] = []
        self.changed = asyncio.Condition()
        self.stats: dict[str, int] = {}
        self.counts = {"filtered": 0, "continued": 0, "drawn": 0}
        self.exhausted = self.closed = False
        self.error: BaseException | None = None
        self.idle_s = 0.0
        self._idle_since: float | None = None
        self._resume = list(resume)
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def _launch(self, group: list[Sample]) -> None:
        task = asyncio.create_task(run_group(self.pool, group, self.params, self.gen, self.reward_fn,
                                             mask_offpolicy_tokens=self.opts.mask_offpolicy_in_partial_rollout,
                                             stats=self.stats))
        self.running[task] = group

    def _fill(self) -> None:
        while self._resume and len(self.running) + len(self.ready) < self.capacity:
            self._launch(self._resume.pop(0))
        while not self.exhausted and len(self.running) + len(self.ready) < self.capacity:
            rows = list(self.next_rows(self.opts.draw_size))
            self.exhausted = not rows
            self.counts["drawn"] += len(rows)
            for group in make_groups(rows, self.opts.n_samples_per_prompt, self.indices, self.group_ids):
                self._launch(group)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self.closed:
                self._fill()
                if not self.running:
                    if self.exhausted and not self._resume:
                        break
                    # full: every slot holds a finished group the trainer has not taken
                    self._idle_since = self._idle_since or loop.time()
                    async with self.changed:
                        await self.changed.wait()
                    continue
                if self._idle_since is not None:
                    self.idle_s += loop.time() - self._idle_since
                    self._idle_since = None
                done, _ = await asyncio.wait(self.running, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: self.running[t][0].group_index):
                    self.running.pop(task)
                    group = task.result()
                    if group_status(group) != COMPLETED:  # a weight update paused the engines: go on under it
                        if not self.closed:
                            self.counts["continued"] += 1
                            self._launch(group)
                    elif self.keep is None or self.keep(group):
                        self.ready.append(group)
                    else:
                        self.counts["filtered"] += 1
                async with self.changed:
                    self.changed.notify_all()
        except BaseException as exc:  # noqa: BLE001  (the next take raises it: the step names the failure)
            self.error = exc
        finally:
            self.exhausted = self.exhausted or self.error is not None
            async with self.changed:
                self.changed.notify_all()

    async def take(self, n: int, version: int, max_staleness: int | None = None,
                   deadline_s: float | None = None) -> tuple[list[list[Sample]], dict[str, float]]:
        """The first `n` finished groups not staler than `max_staleness` at trainer version `version` (fewer
        only when the prompts ran out or `deadline_s` passed), in group order; and the step's metrics."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        end = None if deadline_s is None else t0 + deadline_s
        out: list[list[Sample]] = []
        ages: list[int] = []
        dropped = 0
        while len(out) < n:
            async with self.changed:
                while not self.ready and self.error is None and not (self.exhausted and not self.running):
                    timeout = None if end is None else end - loop.time()
                    if timeout is not None and timeout <= 0:
                        break
                    try:
                        await asyncio.wait_for(self.changed.wait(), timeout)
                    except TimeoutError:
                        break
                if self.error is not None:
                    raise self.error
                if not self.ready:
                    break
                group = self.ready.pop(0)
                self.changed.notify_all()  # a slot is free: the stream draws again
            oldest = oldest_version(group)
            age = 0 if oldest is None else max(version - oldest, 0)
            if max_staleness is not None and age > max_staleness:
                dropped += 1
                continue
            out.append(group)
            ages.append(age)
        idle = self.idle_s + (0.0 if self._idle_since is None else loop.time() - self._idle_since)
        self.idle_s = 0.0
        self._idle_since = None if self._idle_since is None else loop.time()
        metrics = {"rollout/stale_groups_dropped": float(dropped),
                   "rollout/staleness_mean": sum(ages) / len(ages) if ages else 0.0,
                   "rollout/staleness_max": float(max(ages, default=0)),
                   "rollout/groups_continued_after_update": float(self.counts["continued"]),
                   "rollout/groups_filtered": float(self.counts["filtered"]),
                   "rollout/prompts_drawn": float(self.counts["drawn"]),
                   "rollout/groups_in_flight": float(len(self.running)),
                   "rollout/groups_ready": float(len(self.ready)),
                   "rollout/offpolicy_tokens_masked": float(self.stats.get("offpolicy_tokens_masked", 0)),
                   "rollout/engine_idle_s": idle, "perf/trainer_wait_s": loop.time() - t0}
        for k in sorted(set(ages)):
            metrics[f"rollout/staleness_{k}"] = float(ages.count(k))
        self.counts = {"filtered": 0, "continued": 0, "drawn": 0}
        self.stats.clear()
        return sorted(out, key=lambda g: g[0].group_index), metrics

    def snapshot(self) -> tuple[list[list[Sample]], int, int]:
        """(groups to continue after a resume: the queued ones and those in flight, as far as they got; the
        next sample index; the next group index), for a checkpoint."""
        groups = [copy.deepcopy(g) for g in [*self.ready, *self.running.values(), *self._resume]]
        nxt_i, nxt_g = next(self.indices), next(self.group_ids)
        self.indices, self.group_ids = itertools.count(nxt_i), itertools.count(nxt_g)
        return sorted(groups, key=lambda g: g[0].group_index), nxt_i, nxt_g

    async def close(self) -> None:
        """Stop drawing, abort what is in flight, wait for the run task."""
        self.closed = True
        self.pool.stop()
        groups = sorted({g[0].group_index for g in self.running.values()})
        if groups:
            await self.pool.abort_groups(groups)
        async with self.changed:
            self.changed.notify_all()
        if self._task is not None:
            await asyncio.wait({self._task}, timeout=30)
        for task in self.running:
            task.cancel()
        await self.pool.aclose()
        for client in self.pool.clients:
            await client.aclose()
