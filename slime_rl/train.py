"""`slime-rl train`: the RL loop.

    generate (engines) -> reward -> advantages -> train (Megatron ranks) -> broadcast weights -> ...

Everything the loop touches is validated before any actor starts: flags (ConfigError names the
flag), the dataset (DataError names the row) and the reward function (RewardError names the flag).
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import time
import traceback
import warnings
from collections.abc import Sequence

from slime_rl.config import Config, ConfigError, build_config
from slime_rl.config.checks import ConfigNote
from slime_rl.data import DataError
from slime_rl.observability import MetricsLogger, StepClock, Timer, summary_line
from slime_rl.orchestration.placement import PlacementPlan, assign_devices
from slime_rl.preflight import (  # noqa: F401  (the driver's checks, importable from here as before)
    check_model_features,
    check_ref_load,
    check_replay_files,
    preflight,
    reward_fn,
)
from slime_rl.rewards import RewardError


class RunFailed(RuntimeError):
    """The run stopped because a part of it failed; the message says what, where and what to run
    next (slime_rl.orchestration.failures). `known`: a failure the message fully explains (an
    unexpected one also gets its traceback printed by `main`)."""

    def __init__(self, message: str, known: bool = True) -> None:
        super().__init__(message)
        self.known = known


def dry_run(cfg: Config, plan: PlacementPlan, argv: Sequence[str] = ()) -> bool:
    """Print the plan (node/GPU ids, layout, steps, memory and weight-sync estimates, whether it fits
    its GPUs), the command that launches the job (from `argv`) and the engine and router commands a
    person can paste; nothing is started. False when it does not fit."""
    from slime_rl.orchestration.plan_report import engine_lines, launch_line, plan_report
    from slime_rl.trainer.convert import read_hf_config

    if cfg.plan.cluster is not None:
        devices = assign_devices(plan, cfg.plan.cluster.nodes, cfg.plan.cluster.gpus)
    else:  # this machine, or the Ray cluster of RAY_ADDRESS: the shape preflight planned for
        devices = assign_devices(plan, *plan.shape) if plan.use_gpu and plan.shape else None
    text, fits = plan_report(cfg, plan, devices, read_hf_config(cfg.model.hf_checkpoint))
    print(text)
    if not plan.use_gpu and cfg.plan.cluster is None:
        print("note: planned for this machine (no GPU); --cluster NODESxGPUS plans for a GPU cluster")
    print(launch_line(cfg, argv))
    for line in engine_lines(cfg, plan, devices):
        print(line)
    if not fits:
        print("slime-rl train: error: the plan does not fit its GPUs (the DOES NOT FIT lines above say where and "
              "what would fit)", file=sys.stderr)
    return fits


def train(cfg: Config, plan: PlacementPlan) -> list[dict]:
    """Run the loop; returns the metrics rows (also in <run_dir>/metrics.jsonl).

    Sync mode: generate(k) -> train(k) -> sync. Async mode (`--async`, one step off-policy):
    generate(k+1) runs while train(k) runs; the weights are broadcast only after generate(k+1) has
    finished, so they never change in the middle of a generate call, and rollout k+1 is one
    version behind the policy it trains (the trainer's old log-probs are recomputed, so the PPO
    ratio is exact; the engine/trainer gap shows in train/rollout_logprob_abs_diff).

    Fully async (`--fully-async`): the loop is the synchronous one, but the rollout never stops
    (rollout/stream.py): generate(k) takes the first finished groups while the others keep generating
    through training and weight syncs (a sync's pause interrupts them; they continue under the new weights).

    Train-only (`--load-debug-rollout-data`): each step's rollout is read from its file instead of
    generated; there are no engines, so no release, restart, weight sync or eval.
    """
    from slime_rl.orchestration.cluster import Cluster
    from slime_rl.orchestration.failures import describe
    from slime_rl.orchestration.trainer_group import TrainerRankError

    steps_per_rollout = cfg.optimizer_steps_per_rollout
    n_steps, interval = cfg.rollout.num_rollout, cfg.weight_sync.update_weights_interval
    engines = not cfg.debug.train_only  # --load-debug-rollout-data: no engine to release, heal or sync
    if not engines:
        print(f"[slime_rl] train-only: each step's rollout is read from --load-debug-rollout-data "
              f"{cfg.debug.load_rollout_data}; no rollout engine is started and no weights are synced", flush=True)
    _remove_partial_saves(cfg, "left by an earlier run")
    logger = MetricsLogger(cfg.logging, cfg.to_dict())
    timer = Timer()
    clock = StepClock(n_steps)  # elapsed time and ETA on each step's line
    rows = []
    cluster = Cluster(cfg, plan, api_key=secrets.token_hex(16))
    failed = False
    phase, step = "start", None  # where a failure happened, for the message
    generations: list[dict] = []  # --log-eval-generations: the step's eval samples, logged with its row
    try:
        cluster.start(train_iters=n_steps * steps_per_rollout)
        phase = "resume from --load"
        first = cluster.resume()
        logger.start(first)
        if cfg.eval.enabled and not cfg.eval.skip_before_train and first == 0:
            phase = "eval before training"
            with timer("eval"):
                eval_metrics, generations = cluster.evaluate()
            row = logger.log(-1, eval_metrics | timer.pop())  # step -1: before any update
            logger.log_generations(-1, generations)
            print(f"eval before training: {row}", flush=True)
        pending = cluster.generate_async(first) if first < n_steps else None
        for step in range(first, n_steps):
            start = time.perf_counter()
            phase = "rollout"
            with timer("rollout"):
                metrics = cluster.wait(pending)
            pending = None
            if cfg.rollout.async_mode and step + 1 < n_steps:
                pending = cluster.generate_async(step + 1)
            if engines and cfg.engine.colocate:  # the engines' memory goes to the trainer until the weight sync
                with timer("release"):
                    cluster.release_engines()
            phase = "train"
            with timer("train"):
                metrics |= cluster.train(step)
            if pending is not None:
                with timer("rollout_overlap_wait"):
                    cluster.wait_done(pending)
            phase = "engine restart"
            restarted = cluster.heal_engines() if engines and cfg.fault.use_fault_tolerance else 0
            if restarted:
                metrics["fault/engines_restarted"] = float(restarted)
            # a restarted engine needs weights
            if engines and (restarted or (step + 1) % interval == 0 or step + 1 == n_steps):
                phase = "weight sync"
                with timer("weight_sync"):
                    metrics |= cluster.sync_weights(version=str(step + 1))
            if cfg.eval.enabled and (step + 1) % cfg.eval.interval == 0:
                if pending is not None:  # eval must see the new weights: let the overlapped rollout finish first
                    cluster.wait_done(pending)
                phase = "eval"
                with timer("eval"):
                    eval_metrics, generations = cluster.evaluate()
                metrics |= eval_metrics
            if cfg.checkpoint.saves_at(step, n_steps):  # --save and/or --save-hf
                phase = "checkpoint save"
                with timer("save"):
                    cluster.save(step)  # the rollout side is saved as it was before rollout step + 1
            if pending is None and step + 1 < n_steps:
                pending = cluster.generate_async(step + 1)
            metrics |= timer.pop()
            metrics.setdefault("perf/weight_sync_s", 0.0)
            metrics.setdefault("perf/weight_sync_GBps", 0.0)
            metrics["perf/step_s"] = time.perf_counter() - start
            row = logger.log(step, metrics)
            if generations:
                logger.log_generations(step, generations)
                generations = []
            rows.append(row)
            print(summary_line(row, n_steps, **clock.step_done(step, metrics["perf/step_s"])), flush=True)
            if _STOP_AFTER_STEP:  # --exit-signal-handler: the signal came during this step, which is done now
                saved = cfg.checkpoint.saves_at(step, n_steps)
                if not saved:
                    phase = "checkpoint save on SIGTERM"
                    cluster.save(step)
                from slime_rl.orchestration.failures import resume_hint

                signum = _STOP_AFTER_STEP[0]
                print(f"slime-rl train: run stopped: {signal.Signals(signum).name} received; step {step} finished "
                      f"and {'was' if saved else 'is'} saved (--exit-signal-handler); stopping the engines and "
                      f"trainers. {resume_hint(cfg.checkpoint.save)}", file=sys.stderr, flush=True)
                raise SignalStop(signum, announced=True)
    except (SystemExit, KeyboardInterrupt) as exc:  # a preemption or Ctrl-C: one sentence too, then the exit
        if getattr(exc, "announced", False):  # --exit-signal-handler's stop after the save: said already
            raise
        # Ray's ray.get turns the SignalStop raised inside it into a plain SystemExit(1): the handler's
        # record says which signal it was
        signum = _SIGNALS[0] if _SIGNALS else signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None
        if signum is None:
            raise
        from slime_rl.orchestration.failures import resume_hint

        what = "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name
        where = phase if step is None else f"{phase} of step {step}"
        print(f"slime-rl train: run stopped: {what} received (during {where}); stopping the engines and trainers. "
              f"{resume_hint(cfg.checkpoint.save)}", file=sys.stderr, flush=True)
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise SignalStop(signum) from None
    except Exception as exc:  # every failure reads as one sentence: what, where, what to run next
        failed = isinstance(exc, TrainerRankError)
        text, known = describe(exc, phase=phase, step=step, save=cfg.checkpoint.save,
                               fault_tolerance=cfg.fault.use_fault_tolerance)
        raise RunFailed(text, known=known) from exc
    finally:
        cluster.shutdown(failed=failed)
        logger.close()
        _remove_partial_saves(cfg, "this run's save did not finish")  # every rank has stopped writing
    return rows


def _remove_partial_saves(cfg: Config, why: str) -> None:
    """The `iter_<step>.tmp` folders under --save and --critic-save (saves cut short: a full disk, a
    killed rank, a stop signal) are deleted when no rank writes there; complete checkpoints stay."""
    from slime_rl.trainer.checkpoint_layout import remove_partial_saves

    for root in (cfg.checkpoint.save, cfg.critic.save if cfg.critic is not None else None):
        removed = remove_partial_saves(root)
        if removed:
            print(f"[slime_rl] removed the partial save(s) {', '.join(p.name for p in removed)} under {root} "
                  f"({why})", flush=True)


def _show_config_notes() -> None:
    """The config's notes (config.checks.ConfigNote) print as one plain line each, `slime-rl train: note:
    ...`, not with Python's source location; other warnings as usual."""
    default = warnings.showwarning
    if getattr(default, "slime_rl_notes", False):  # installed already (main called again in one process)
        return

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, ConfigNote):
            print(f"slime-rl train: note: {message}", file=file or sys.stderr, flush=True)
        else:
            default(message, category, filename, lineno, file, line)

    show.slime_rl_notes = True
    warnings.showwarning = show


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    _show_config_notes()
    try:
        cfg, plan = preflight(build_config(argv))
    except (ConfigError, DataError, RewardError, ValueError) as exc:
        print(f"slime-rl train: error: {exc}", file=sys.stderr)
        return 2
    if cfg.dry_run:
        return 0 if dry_run(cfg, plan, argv) else 1
    if not os.environ.get("RAY_ADDRESS"):  # this driver starts Ray: what it starts goes with it, kill -9 included
        from slime_rl.orchestration.reaper import start_reaper

        start_reaper()
    # SIGTERM (kill, Slurm's or Kubernetes' preemption) unwinds like Ctrl-C: the engines and trainers
    # are stopped, one sentence says where and how to resume, the exit status is 143 (Ctrl-C: 130).
    # init_ray puts this handler back after ray.init, whose crash handler takes SIGTERM over.
    signal.signal(signal.SIGTERM, _stop_after_step if cfg.checkpoint.exit_signal_handler else _exit_on_signal)
    try:
        train(cfg, plan)
    except RunFailed as exc:
        if not exc.known and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"slime-rl train: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    return 0


class SignalStop(SystemExit):
    """SIGTERM arrived: the run unwinds as on Ctrl-C and exits 128 + the signal's number. `announced`: its
    sentence is printed already (--exit-signal-handler's stop after the step's save)."""

    def __init__(self, signum: int, announced: bool = False) -> None:
        super().__init__(128 + signum)
        self.signum, self.announced = signum, announced


_SIGNALS: list[int] = []  # the signals _exit_on_signal took, in order
_STOP_AFTER_STEP: list[int] = []  # --exit-signal-handler: the signal that asked to stop after the step


def _stop_after_step(signum: int, frame: object) -> None:
    """--exit-signal-handler (Megatron-LM's): the step under way finishes and is saved, then the run stops
    (train's loop); a second signal stops at once, as without the flag."""
    if _STOP_AFTER_STEP:
        _exit_on_signal(signum, frame)
    _STOP_AFTER_STEP.append(signum)
    print(f"slime-rl train: {signal.Signals(signum).name} received: the step under way finishes, a checkpoint is "
          f"saved, then the run stops (--exit-signal-handler); {signal.Signals(signum).name} again stops at once",
          file=sys.stderr, flush=True)


def _exit_on_signal(signum: int, frame: object) -> None:
    _SIGNALS.append(signum)
    # later ones while the run stops are ignored (a scheduler's SIGKILL still ends it)
    signal.signal(signum, lambda *_: print(f"slime-rl train: stopping ({signal.Signals(signum).name} again: "
                                           "ignored; SIGKILL ends it at once)", file=sys.stderr, flush=True))
    raise SignalStop(signum)


if __name__ == "__main__":
    sys.exit(main())
