"""One error format for a run that stops: what failed, where, and what to run next.

    run stopped: <what failed> (during <phase> of step N). <advice> <how to resume>

`<how to resume>` names the last complete checkpoint under --save when there is one
("To resume: rerun with --load <save> (its last complete checkpoint: <save>/iter_0000002, step 2)"),
else says there is none. The driver (train.py) builds the sentence from the exception it caught,
whatever Ray wrapped it in (RayTaskError keeps the original as `.cause`)."""

from __future__ import annotations

from pathlib import Path

import ray


class RolloutStarved(RuntimeError):
    """A rollout kept no group, or drew the data over and over without filling the batch."""


class EngineFailure(RuntimeError):
    """A rollout engine request failed (engines.client.EngineError), in a form Ray can carry back to the
    driver: EngineError's constructor takes four arguments, so Ray cannot rebuild it and the driver
    would get an UnserializableException holding only its text. `status` None: no HTTP answer at all
    (the engine died)."""

    def __init__(self, url: str, endpoint: str, status: int | None, message: str) -> None:
        self.url, self.endpoint, self.status, self.message = url, endpoint, status, message
        super().__init__(f"engine {url}{endpoint} answered {status}: {message}" if status is not None
                         else f"engine {url}{endpoint} unreachable: {message}")

    def __reduce__(self):
        return type(self), (self.url, self.endpoint, self.status, self.message)

    @classmethod
    def of(cls, error: Exception) -> EngineFailure:
        return cls(error.url, error.endpoint, error.status, error.message)


def root_cause(exc: BaseException) -> BaseException:
    """The original exception under Ray's wrappers (RayTaskError.cause) and `raise ... from`."""
    seen: set[int] = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = getattr(exc, "cause", None)
        if isinstance(inner, BaseException):
            exc = inner
            continue
        if isinstance(exc, ray.exceptions.RayError) and exc.__cause__ is not None:
            exc = exc.__cause__
            continue
        break
    return exc


_OOM_MARKS = ("OutOfMemoryError", "out of memory", "can't allocate memory", "Cannot allocate memory",
              "MemoryError")


def is_out_of_memory(exc: BaseException) -> bool:
    """CUDA (torch.OutOfMemoryError), CPU (torch's allocator: "can't allocate memory"), Python's
    MemoryError, or Ray's memory monitor killing a worker (ray.exceptions.OutOfMemoryError)."""
    for e in (exc, root_cause(exc)):
        if isinstance(e, (MemoryError, ray.exceptions.OutOfMemoryError)):
            return True
        if type(e).__name__.endswith("OutOfMemoryError"):
            return True
        text = str(e)
        if any(mark in text for mark in _OOM_MARKS):
            return True
    return False


def resume_hint(save: str | None) -> str:
    """What to run next: --load with the save folder and the checkpoint it would resume from."""
    if not save:
        return "No checkpoint to resume from (--save is not set): rerun to start over."
    from slime_rl.trainer.checkpoint_layout import latest_checkpoint, read_checkpoint_info

    path = latest_checkpoint(save)
    if path is None:
        return f"No checkpoint to resume from (none complete under --save {save} yet): rerun to start over."
    step = read_checkpoint_info(path).step
    return f"To resume: rerun with --load {save} (its last complete checkpoint: {Path(path)}, step {step})."


def _last_line(exc: BaseException) -> str:
    lines = [x for x in str(exc).strip().splitlines() if x.strip()]
    return lines[-1].strip() if lines else ""


def describe(exc: BaseException, *, phase: str, step: int | None, save: str | None,
             fault_tolerance: bool) -> tuple[str, bool]:
    """The sentence for a run stopped by `exc`, raised during `phase` ("rollout", "train",
    "weight sync", "checkpoint save", "start", ...) of `step` (None: before the loop), and whether
    the failure is one of the known kinds (False: its traceback is worth printing too)."""
    from slime_rl.data import DataError
    from slime_rl.engines.client import EngineError
    from slime_rl.engines.launch import EngineLaunchError
    from slime_rl.orchestration.trainer_group import LOAD_WHAT, TrainerRankError
    from slime_rl.rewards import RewardError
    from slime_rl.rollout.health import NoLiveEngineError

    cause = root_cause(exc)
    where = phase if step is None else f"{phase} of step {step}"
    advice = ""
    known = True
    load_failed = False  # the hint is then the other checkpoints, not --save's
    if isinstance(exc, TrainerRankError) or isinstance(cause, TrainerRankError):
        rank_error = exc if isinstance(exc, TrainerRankError) else cause
        what = str(rank_error)
        where = ""  # the rank's message says what it was doing
        if rank_error.what.startswith(LOAD_WHAT):  # the other checkpoints, each with its --load
            from slime_rl.trainer.checkpoint_layout import intact_checkpoints

            folder = Path(rank_error.what[len(LOAD_WHAT):].strip())
            load_failed = True
            advice = f"{folder.name} could not be loaded; {intact_checkpoints(folder.parent, damaged=folder)}."
        if is_out_of_memory(rank_error.__cause__ or rank_error):
            advice = ("The rank ran out of memory: lower --micro-batch-size (or --max-tokens-per-gpu), "
                      "or spread the model over more GPUs (--tensor-model-parallel-size).")
    elif isinstance(cause, NoLiveEngineError):
        what = f"no live rollout engine: {cause}"
        advice = ("--use-fault-tolerance restarts dead engines and generates the step again." if not fault_tolerance
                  else "The engines died again after each restart: their own logs (lines prefixed [engine K] "
                       "in Ray's logs) say why.")
    elif isinstance(cause, EngineLaunchError):
        what = f"a rollout engine did not start: {_last_line(cause)}"
    elif isinstance(cause, (EngineError, EngineFailure)) and cause.status is None:
        what = f"rollout engine at {cause.url} died ({cause.message})"
        if not fault_tolerance:
            advice = "--use-fault-tolerance restarts a dead engine and resends its requests."
    elif isinstance(cause, (EngineError, EngineFailure)):
        what = f"rollout engine at {cause.url} refused {cause.endpoint} ({cause.status}: {cause.message})"
    elif isinstance(cause, RewardError):
        what = f"the reward function failed: {cause}"
    elif isinstance(cause, (RolloutStarved, DataError)):  # DataError: a --load-debug-rollout-data file
        what = str(cause)
    elif is_out_of_memory(exc):
        what = f"out of memory: {type(cause).__name__}: {_last_line(cause)}"
        advice = "Lower --rollout-batch-size, --sglang-mem-fraction-static or --micro-batch-size."
    elif isinstance(exc, ray.exceptions.RayActorError):
        what = f"a Ray actor died: {_last_line(exc)}"
    else:
        what = f"{type(cause).__name__}: {_last_line(cause)}"
        known = False
    parts = [f"run stopped: {what}" + (f" (during {where})." if where else ".")]
    if advice:
        parts.append(advice)
    if not load_failed:
        parts.append(resume_hint(save))
    return " ".join(parts), known
