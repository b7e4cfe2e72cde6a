"""Loading user functions by path and calling reward functions of any supported shape.

Protocol (the extension point, `--custom-rm-path`):

| shape                                   | signature                                                   |
|-----------------------------------------|-------------------------------------------------------------|
| one sample (default)                    | `def rm(sample: Sample) -> float \\| dict` or `async def`     |
| a whole group (`--group-rm`)            | `def rm(samples: list[Sample]) -> list[float \\| dict]`, or async |
| slime's, one sample                     | `async def rm(args, sample) -> float \\| dict` (slime's Sample) |
| slime's, a whole group (`--group-rm`)   | `async def rm(args, samples) -> list[float \\| dict]`           |
| EasyR1's file, `REWARD_TYPE = "batch"`  | `def compute_score(reward_inputs: list[dict]) -> list[float \\| dict]` |
| EasyR1's file, `REWARD_TYPE = "sequential"` | `def compute_score(reward_input: dict) -> float \\| dict`   |

The form is decided once, when the function is loaded (`config.dotted_path.choose_form`): by the
number of positional parameters (ours takes the sample, slime's `args` first), and for EasyR1 by
the module's `REWARD_TYPE`. slime's functions get slime's `args` (`config.slime_args`) and slime's
Sample (`data.slime_compat.SlimeSample`, a copy); EasyR1's get dicts with `response`,
`response_length` and `ground_truth` (the label), and a dict result's score is `overall` (unless
`--reward-key` names another key). A batch-type EasyR1 function scores one group per call.
`--custom-rm-kwargs` (a JSON object) is passed to the function as keyword arguments (EasyR1's
`reward_function_kwargs`).

A dict result holds the reward under `--reward-key` (default "score"; EasyR1's files use
"overall"); its other numeric keys (bools count as 0/1) are logged as metrics
(`sample.reward_metrics`). The path is `pkg.module:function`, `pkg.module.function` or a file,
`path/to/file.py:function`.

Concurrency: sync reward functions run in threads (`_in_thread`: a daemon thread per call, at most
min(32, cpus + 4) at once, the size of asyncio's default executor), so a slow rule-based reward
(sympy, regexes over long responses) does not block the event loop that keeps generation requests
flowing; async functions run on the loop itself. A sync reward must therefore be thread-safe (pure
functions of the sample are). Threads keep the loop responsive (the GIL is handed over every few ms)
but add no CPU parallelism. `--reward-timeout-s` bounds every call: past it the sample (or the group)
scores the failure value, its thread is left behind (a thread cannot be stopped; a daemon never holds
up the exit) and its slot goes to the next call, so a reward that never returns costs one thread, not
the run. An async reward that blocks inside (no await) holds the loop itself; no timeout can help it.

The run's reward, `make_reward_fn`: the default is `--custom-rm-path` when given, else
`--rm-type`; a sample whose `metadata["rm_type"]` names a built-in (or `remote_rm`) is scored by
that one instead, so one data file can mix math rows and f1 rows. It returns an ordinary async
reward function whose result is a `RewardResult`, so `call_reward` / `call_reward_full` take it
like any other; with `--group-rm` it returns a `GroupReward` (it scores a whole group).
`score_samples` scores a list of samples with either, writing `sample.reward` and
`sample.reward_metrics`.

Failure policy (`failure_value`, the flag `--reward-failure-value`, default 0.0): a reward function
that raises on a sample gives that sample `failure_value` instead of ending the run; the failure
is counted (`reward.failures`, a `RewardFailures`; the rollout logs it as `rollout/reward_failures`)
and the first traceback of the run is printed once. The caller stops the run when every sample of a
step failed (`RewardFailures.since`), since then the reward is broken rather than one input odd.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import math
import os
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from slime_rl.config.dotted_path import choose_form, json_kwargs, load_by_path
from slime_rl.config.flags_from_slime import SLIME_OPD_REWARD
from slime_rl.data import Sample
from slime_rl.data.slime_compat import slime_sample_class, to_slime
from slime_rl.rewards.builtin import BUILTIN, REWARDS
from slime_rl.rewards.remote import RemoteRewardModel
from slime_rl.rewards.teacher import fetch_teacher_logprobs

RewardFn = Callable[[Sample], object]
GroupRewardFn = Callable[[list[Sample]], object]


class RewardError(ValueError):
    """The reward function could not be found, loaded or understood; the message names the flag."""


@dataclass(frozen=True)
class RewardResult:
    """A resolved reward: the scalar the advantages use plus extra numbers to log."""

    score: float
    metrics: dict[str, float] = field(default_factory=dict)


def load_reward(rm_type: str | None, custom_rm_path: str | None) -> RewardFn:
    """The reward function the flags name (the custom path wins); sync or async. For `remote_rm`,
    per-sample `metadata["rm_type"]` and dict rewards, use `make_reward_fn`."""
    if custom_rm_path:
        return load_by_path(custom_rm_path, "--custom-rm-path", RewardError)
    if rm_type in BUILTIN:
        return BUILTIN[rm_type]
    if rm_type == "remote_rm":
        raise RewardError("--rm-type remote_rm needs --rm-url; build it with make_reward_fn(..., rm_url=...)")
    raise RewardError(f"--rm-type {rm_type!r}: unknown (built-in: {', '.join(sorted(BUILTIN))}, remote_rm)")


def _name(fn: Any) -> str:
    return str(getattr(fn, "__name__", fn))


def resolve_reward(value: Any, reward_key: str = "score", fn: Any = None) -> RewardResult:
    """A reward function's result (number, dict or RewardResult) -> RewardResult; errors name the
    function and, for dicts, `--reward-key`."""
    if isinstance(value, RewardResult):
        return value
    if isinstance(value, dict):
        if reward_key not in value:
            raise RewardError(f"reward function {_name(fn)!r} returned a dict without the key {reward_key!r} "
                              f"(--reward-key); keys: {sorted(value)}")
        score = value[reward_key]
        metrics = {str(k): float(v) for k, v in value.items()
                   if k != reward_key and isinstance(v, (int, float)) and math.isfinite(v)}
    else:
        score, metrics = value, {}
    if isinstance(score, bool) or not isinstance(score, (int, float)):
        raise RewardError(f"reward function {_name(fn)!r} returned {score!r}; expected a number")
    if not math.isfinite(score):
        raise RewardError(f"reward function {_name(fn)!r} returned {score!r}; a reward must be finite")
    return RewardResult(float(score), metrics)


def _is_async(fn: Any) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


class RewardTimeout(RewardError):
    """A reward call did not return within its time limit (`--reward-timeout-s`)."""


# sync reward calls running at once per event loop: asyncio's default executor's size
_SYNC_CALLS = min(32, (os.cpu_count() or 1) + 4)
_slots: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Semaphore] = weakref.WeakKeyDictionary()


async def _in_thread(fn: Callable, args: tuple, timeout_s: float | None) -> Any:
    """fn(*args) in a daemon thread of its own, at most _SYNC_CALLS at once. A call past `timeout_s`
    raises RewardTimeout and gives its slot back; its thread is left to finish or hang on its own
    (a thread cannot be stopped; daemon, so it never holds up the process's exit, where a pool's
    worker would)."""
    loop = asyncio.get_running_loop()
    slots = _slots.setdefault(loop, asyncio.Semaphore(_SYNC_CALLS))
    done: asyncio.Future = loop.create_future()

    def settle(value: Any, exc: BaseException | None) -> None:
        if not done.done():
            done.set_exception(exc) if exc is not None else done.set_result(value)

    def run(ctx: contextvars.Context) -> None:
        try:
            value, exc = ctx.run(fn, *args), None
        except BaseException as e:  # handed to the caller, as to_thread would
            value, exc = None, e
        try:
            loop.call_soon_threadsafe(settle, value, exc)
        except RuntimeError:  # the loop has closed: nobody waits for this call any more
            pass

    async with slots:
        threading.Thread(target=run, args=(contextvars.copy_context(),), daemon=True,
                         name=f"reward {_name(fn)}").start()
        try:
            return await asyncio.wait_for(asyncio.shield(done), timeout_s)
        except TimeoutError:
            raise RewardTimeout(f"{_name(fn)} did not return within {timeout_s:g} s (--reward-timeout-s)") from None


async def _invoke(fn: Callable, *args: Any, timeout_s: float | None = None) -> Any:
    """Await an async function on the loop; run a sync one in a thread (see module docstring); either
    raises RewardTimeout past `timeout_s` seconds (None: no limit)."""
    if _is_async(fn):
        try:
            return await asyncio.wait_for(fn(*args), timeout_s)
        except TimeoutError:
            raise RewardTimeout(f"{_name(fn)} did not return within {timeout_s:g} s (--reward-timeout-s)") from None
    value = await _in_thread(fn, args, timeout_s)
    if inspect.isawaitable(value):  # a sync wrapper that returns a coroutine
        value = await asyncio.wait_for(value, timeout_s)
    return value


async def call_reward_full(fn: RewardFn, sample: Sample, reward_key: str = "score",
                           timeout_s: float | None = None) -> tuple[float, dict[str, float]]:
    """Score one sample: (reward, extra metrics). Sync functions run in a thread; past `timeout_s`
    seconds RewardTimeout."""
    result = resolve_reward(await _invoke(fn, sample, timeout_s=timeout_s), reward_key, fn)
    return result.score, dict(result.metrics)


async def call_reward(fn: RewardFn, sample: Sample) -> float:
    """Score one sample with a sync or async reward function (dict results use the key "score").

    The reward is returned (the caller stores it); the extra numbers of a dict result are stored
    in `sample.reward_metrics` so that they reach the rollout metrics.
    """
    score, metrics = await call_reward_full(fn, sample)
    sample.reward_metrics = metrics
    return score


async def call_group_reward(fn: GroupRewardFn, samples: list[Sample], reward_key: str = "score",
                            timeout_s: float | None = None) -> list[tuple[float, dict[str, float]]]:
    """Score a whole group at once (`--group-rm`): one result per sample, in order; past `timeout_s`
    seconds RewardTimeout."""
    values = await _invoke(fn, list(samples), timeout_s=timeout_s)
    if not isinstance(values, (list, tuple)) or len(values) != len(samples):
        got = f"{len(values)} results" if isinstance(values, (list, tuple)) else repr(values)[:80]
        raise RewardError(f"group reward function {_name(fn)!r} (--group-rm) must return a list of "
                          f"{len(samples)} rewards, one per sample; got {got}")
    results = [resolve_reward(v, reward_key, fn) for v in values]
    return [(r.score, dict(r.metrics)) for r in results]


@dataclass
class RewardFailures:
    """Counts of a reward function's calls and failures over the run, with tracebacks."""

    calls: int = 0
    failures: int = 0
    timeouts: int = 0  # of the failures, calls past --reward-timeout-s
    first_traceback: str | None = None
    last_traceback: str | None = None
    first_timeout: str | None = None

    def record(self, sample: Sample, fn_name: str, failure_value: float, count: int = 1) -> None:
        """Count the exception being handled (call from an `except` block); `count` samples got
        `failure_value` (a group reward that raised or timed out fails its whole group)."""
        self.failures += count
        exc = sys.exc_info()[1]
        if isinstance(exc, RewardTimeout):  # no traceback to show: the call is still running somewhere
            self.timeouts += count
            self.last_traceback = f"sample {sample.index} (group {sample.group_index}): {exc}"
            if self.first_timeout is None:
                self.first_timeout = self.last_traceback
                print(f"[slime_rl] reward function {fn_name}: {exc}; the sample scores {failure_value:g} "
                      f"(--reward-failure-value) and further timeouts are only counted (rollout/reward_timeouts, "
                      f"also in rollout/reward_failures). First: sample {sample.index} (group "
                      f"{sample.group_index})", file=sys.stderr, flush=True)
            return
        tb = f"sample {sample.index} (group {sample.group_index}):\n{traceback.format_exc()}"
        self.last_traceback = tb
        if self.first_traceback is None:
            self.first_traceback = tb
            print(f"[slime_rl] reward function {fn_name} raised; the sample scores {failure_value:g} "
                  f"(--reward-failure-value) and further failures are only counted (rollout/reward_failures). "
                  f"First failure, {tb}", file=sys.stderr, flush=True)

    def mark(self) -> tuple[int, int, int]:
        return self.calls, self.failures, self.timeouts

    def check_step(self, mark: tuple[int, int, int], step: int) -> int:
        """Failures since `mark` (an earlier `mark()`); raises RewardError, with the last traceback,
        when every call since then failed: the reward is broken, not one input odd."""
        calls, failed = self.calls - mark[0], self.failures - mark[1]
        if calls and failed == calls:
            timed_out = self.timeouts - mark[2]
            how = "timed out" if timed_out == failed else "raised or timed out" if timed_out else "raised"
            raise RewardError(f"step {step}: the reward function {how} on every one of the step's {calls} "
                              f"samples; stopping the run. Last failure, {self.last_traceback}")
        return failed

    def timeouts_since(self, mark: tuple[int, int, int]) -> int:
        return self.timeouts - mark[2]


BUILTIN_KEY = "score"  # the built-ins' dict rewards keep their score here, whatever --reward-key is


@dataclass(frozen=True)
class GroupReward:
    """A `--group-rm` function (`list[Sample] -> list[float | dict]`) and the key of its score.
    `failure_value` as for per-sample rewards: a call that raises gives every sample of the group
    that value and counts them all in `failures`."""

    fn: GroupRewardFn
    reward_key: str = "score"
    failure_value: float | None = None
    failures: RewardFailures = field(default_factory=RewardFailures, compare=False)
    timeout_s: float | None = None  # per call (one group); past it the group fails

    async def __call__(self, samples: list[Sample]) -> list[tuple[float, dict[str, float]]]:
        self.failures.calls += len(samples)
        try:
            return await call_group_reward(self.fn, samples, self.reward_key, self.timeout_s)
        except Exception:
            if self.failure_value is None:
                raise
            self.failures.record(samples[0], _name(self.fn), self.failure_value, count=len(samples))
            return [(float(self.failure_value), {}) for _ in samples]


EASYR1_REWARD_TYPES = ("batch", "sequential")


def _easyr1_input(sample: Sample) -> dict[str, Any]:
    """EasyR1's RewardInput of a sample (verl/workers/reward/function.py): the decoded response, its
    length in tokens and the ground truth (our label; numbers as text, as EasyR1's datasets hold them)."""
    label = sample.label
    truth = label if label is None or isinstance(label, (str, list, dict)) else str(label)
    return {"response": sample.response, "response_length": sample.response_length, "ground_truth": truth}


def _named(wrapper: Callable, fn: Callable) -> Callable:
    wrapper.__name__ = _name(fn)
    return wrapper


def _bound(fn: Callable, kwargs: dict[str, Any]) -> Callable:
    """`fn` with `kwargs` bound (functools.partial, as EasyR1 binds `reward_function_kwargs`), named as `fn` and of
    its module (where EasyR1's REWARD_TYPE is read), its signature the partial's own: the bound parameters are no
    longer required (functools.wraps would set __wrapped__, and inspect.signature would report `fn`'s)."""
    bound = functools.partial(fn, **kwargs)
    for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
        with contextlib.suppress(AttributeError):
            setattr(bound, attr, getattr(fn, attr))
    return bound


def load_custom_reward(path: str, *, group_rm: bool = False, args: Any = None,
                       rm_kwargs: str | dict[str, Any] | None = None,
                       reward_key: str = "score") -> tuple[Callable, bool, str]:
    """The `--custom-rm-path` function in our calling convention, decided once from its signature
    (see the module docstring): (function, scores whole groups, the key of a dict result's score).
    Errors name the flag."""
    fn = load_by_path(path, "--custom-rm-path", RewardError)
    kwargs = json_kwargs(rm_kwargs, "--custom-rm-kwargs", RewardError)
    if kwargs:
        try:
            inspect.signature(fn).bind_partial(**kwargs)
        except TypeError as exc:
            raise RewardError(f"--custom-rm-kwargs {sorted(kwargs)}: {_name(fn)} does not take them: {exc}") from exc
        except ValueError:  # no signature to check against
            pass
        fn = _bound(fn, kwargs)
    reward_type = getattr(inspect.getmodule(fn) or sys.modules.get(getattr(fn, "__module__", ""), None),
                          "REWARD_TYPE", None)
    if reward_type is not None:  # EasyR1's reward file
        if reward_type not in EASYR1_REWARD_TYPES:
            raise RewardError(f"--custom-rm-path {path!r}: REWARD_TYPE {reward_type!r}; EasyR1's reward types are "
                              f"{' and '.join(EASYR1_REWARD_TYPES)}")
        arg = "reward_inputs: list[dict]" if reward_type == "batch" else "reward_input: dict"
        choose_form(fn, "--custom-rm-path", path, {"easyr1": (1, f"compute_score({arg})")}, RewardError)
        key = "overall" if reward_key == "score" else reward_key
        if reward_type == "sequential":
            async def sequential(sample: Sample) -> Any:
                return await _invoke(fn, _easyr1_input(sample))
            return _named(sequential, fn), False, key

        async def batch(samples: list[Sample]) -> Any:
            return await _invoke(fn, [_easyr1_input(s) for s in samples])
        return _named(batch, fn), True, key
    what = "samples" if group_rm else "sample"
    form = choose_form(fn, "--custom-rm-path", path,
                       {"ours": (1, f"rm({what})"), "slime": (2, f"async rm(args, {what})")}, RewardError)
    if form == "ours":
        return fn, group_rm, reward_key
    cls = slime_sample_class()
    if group_rm:
        async def slime_group(samples: list[Sample]) -> Any:
            return await _invoke(fn, args, [to_slime(s, cls) for s in samples])
        return _named(slime_group, fn), True, reward_key

    async def slime_one(sample: Sample) -> Any:
        return await _invoke(fn, args, to_slime(sample, cls))
    return _named(slime_one, fn), False, reward_key


def _zero_reward(sample: Sample) -> float:
    """slime's on-policy distillation scores every sample 0.0 (its post_process_rewards): the teacher's reverse KL
    in the advantages is the whole signal."""
    return 0.0


# slime's reward types that are not built here, and why (none today; a name here is refused with its reason)
NOT_BUILT: dict[str, str] = {}


def make_reward_fn(rm_type: str | None, custom_rm_path: str | None, rm_url: str | None = None,
                   reward_key: str = "score", *, group_rm: bool = False, rm_timeout_s: float = 30.0,
                   rm_max_retries: int = 3, rm_backoff_s: float = 0.5,
                   failure_value: float | None = None, args: Any = None,
                   rm_kwargs: str | dict[str, Any] | None = None,
                   timeout_s: float | None = None, generate_sets_reward: bool = False,
                   opd_teacher_url: str | None = None, opd_temperature: float = 1.0) -> RewardFn | GroupReward:
    """The run's reward function, checked now (unknown names, a missing URL, a bad path raise
    `RewardError` naming the flag) rather than at the first sample.

    - `rm_type`: a built-in name (`slime_rl.rewards.builtin.BUILTIN`) or `remote_rm`.
    - `custom_rm_path`: a user function (see the module docstring); wins over `rm_type`; its dicts are read
      with `reward_key`.
    - `rm_url` and `rm_*`: the remote reward model (`remote_rm`), also used by samples whose
      metadata asks for `remote_rm`.
    - `group_rm`: the custom function scores whole groups; returns a `GroupReward`.
    - `failure_value`: None: an exception propagates; a number: the failure policy of the module
      docstring (`reward.failures` counts); with `group_rm` a raising call fails its whole group.
    - `args`: what a slime-style function gets first (`config.slime_args.slime_args`);
      `rm_kwargs`: `--custom-rm-kwargs`.
    - `timeout_s`: `--reward-timeout-s`, per call (a sample, or a group); past it the call is a failure
      (RewardTimeout: `failure_value`, counted also in `failures.timeouts`). None: no limit.
    - `generate_sets_reward`: without `rm_type` and `custom_rm_path`, the custom generate function scores each
      sample itself (slime's agent examples); one it left unscored is a failure naming that.
    - `opd_teacher_url`: --opd-type sglang's teacher (--rm-url): each sample's teacher log-probs are fetched
      before it is scored (`rewards/teacher.py`; a failure is the sample's reward failure, and the sample is
      not trained). slime's OPD reward function (`--custom-rm-path` SLIME_OPD_REWARD) scores 0.0, as its
      post-process does.
    """
    if group_rm and not custom_rm_path:
        raise RewardError("--group-rm needs --custom-rm-path (a function of a list of samples)")
    distillation_only = custom_rm_path == SLIME_OPD_REWARD
    if distillation_only:  # slime's teacher call: --opd-type sglang fetches the log-probs, the reward is 0.0
        if opd_teacher_url is None:
            raise RewardError(f"--custom-rm-path {SLIME_OPD_REWARD} is slime's on-policy distillation: it needs "
                              "--use-opd --opd-type sglang and --rm-url (the teacher)")
        custom_rm_path = None
    custom = (load_custom_reward(custom_rm_path, group_rm=group_rm, args=args, rm_kwargs=rm_kwargs,
                                 reward_key=reward_key) if custom_rm_path else None)
    if custom is not None and custom[1]:  # --group-rm, or an EasyR1 batch file: one call per group
        return GroupReward(custom[0], custom[2], failure_value, timeout_s=timeout_s)

    remote = (RemoteRewardModel(rm_url, timeout_s=rm_timeout_s, max_retries=rm_max_retries, backoff_s=rm_backoff_s)
              if rm_url else None)

    def resolve(name: Any, where: str) -> tuple[Callable, str]:
        if name in BUILTIN:
            needs = REWARDS[name].needs
            if needs is not None:
                try:
                    needs()
                except ImportError as exc:
                    raise RewardError(f"{where} {name!r}: {exc}") from exc
            return BUILTIN[name], BUILTIN_KEY
        if name == "remote_rm":
            if remote is None:
                raise RewardError(f"{where} 'remote_rm' needs --rm-url")
            return remote, reward_key
        why = NOT_BUILT.get(name, "unknown reward type")
        raise RewardError(f"{where} {name!r}: {why} (built-in: {', '.join(sorted(BUILTIN))}, remote_rm)")

    if custom is not None:
        default = (custom[0], custom[2])
    elif distillation_only:
        default = (_zero_reward, BUILTIN_KEY)
    elif rm_type:
        default = resolve(rm_type, "--rm-type")
    elif generate_sets_reward:
        def unscored(sample: Sample) -> float:
            raise RewardError(f"sample {sample.index}: --custom-generate-function-path left its reward unset, and "
                              "no --rm-type or --custom-rm-path is given to score it")

        default = (unscored, BUILTIN_KEY)
    else:
        raise RewardError("no reward: set --rm-type or --custom-rm-path")

    failures = RewardFailures()
    name = f"reward[{custom_rm_path or rm_type}]"

    async def reward(sample: Sample) -> RewardResult:
        failures.calls += 1
        try:
            if opd_teacher_url is not None:  # the teacher's log-probs first: a sample without them is not trained
                sample.teacher_logprobs = None
                sample.teacher_logprobs = await fetch_teacher_logprobs(opd_teacher_url, sample, opd_temperature,
                                                                       rm_timeout_s)
            override = sample.metadata.get("rm_type") if isinstance(sample.metadata, dict) else None
            fn, key = resolve(override, f"sample {sample.index}: metadata['rm_type']") if override else default
            score, metrics = await call_reward_full(fn, sample, key, timeout_s)
        except Exception:  # user code may raise anything; the policy decides, the traceback is kept
            if failure_value is None:
                raise
            failures.record(sample, name, failure_value)
            return RewardResult(float(failure_value), {})
        return RewardResult(score, metrics)

    reward.__name__ = name
    reward.failures = failures
    return reward


async def score_samples(reward_fn: RewardFn | GroupReward, samples: Sequence[Sample],
                        reward_key: str = "score") -> list[float]:
    """Score samples with a per-sample or group reward; sets `reward` and `reward_metrics` on each.

    Per-sample functions run concurrently (sync ones in threads); a `GroupReward` gets the whole
    list at once, so pass one group. `reward_key` reads dicts of plain (unwrapped) functions.
    """
    samples = list(samples)
    if isinstance(reward_fn, GroupReward):
        results = await reward_fn(samples)
    else:
        results = await asyncio.gather(*(call_reward_full(reward_fn, s, reward_key) for s in samples))
    for sample, (score, metrics) in zip(samples, results, strict=True):
        sample.reward, sample.reward_metrics = score, metrics
    return [score for score, _ in results]


def reward_metric_means(samples: Sequence[Sample], prefix: str = "rollout/reward/") -> dict[str, float]:
    """Mean of each extra reward metric over the samples that report it, e.g.
    {"rollout/reward/accuracy": 0.5}; for the step's metrics.jsonl row."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for sample in samples:
        for key, value in sample.reward_metrics.items():
            sums[key] = sums.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    return {f"{prefix}{k}": sums[k] / counts[k] for k in sorted(sums)}
