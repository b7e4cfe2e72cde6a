"""`slime-rl train`: the RL loop.

    generate (engines) -> reward -> advantages -> train (Megatron ranks) -> broadcast weights -> ...

Everything the loop touches is validated before any actor starts: flags (ConfigError names the
flag), the dataset (DataError names the row) and the reward function (RewardError names the flag).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import sys
import time
from collections.abc import Sequence

import torch
from transformers import AutoTokenizer

from slime_rl.config import Config, ConfigError, RolloutConfig, build_config
from slime_rl.data import DataError, PromptDataset, num_rollout_for_epochs
from slime_rl.observability import MetricsLogger, Timer, summary_line
from slime_rl.orchestration.placement import PlacementPlan, plan_placement
from slime_rl.rewards import RewardError, make_reward_fn
from slime_rl.rollout.custom import load_filter, load_generate_function


def preflight(cfg: Config) -> tuple[Config, PlacementPlan]:
    """Check data, reward and placement before anything is started; returns the config (with
    --num-epoch turned into steps) and the plan."""
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
    dataset = PromptDataset(cfg.data, tokenizer)
    if dataset.filtered_too_long:
        print(f"[slime_rl] {dataset.filtered_too_long} prompts longer than --rollout-max-prompt-len dropped")
    if cfg.data.num_epoch is not None:
        steps = num_rollout_for_epochs(len(dataset), cfg.rollout.rollout_batch_size, cfg.data.num_epoch)
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_rollout=steps))
    reward_fn(cfg.rollout)
    # extension points load here, so a bad dotted path fails before any actor starts
    load_generate_function(cfg.rollout.custom_generate_function_path)
    load_filter(cfg.rollout.dynamic_sampling_filter_path)
    return cfg, plan_placement(cfg.parallel, cfg.engine, cluster_gpus=torch.cuda.device_count(),
                               cluster_cpus=os.cpu_count(), critic_world=cfg.critic.world_size if cfg.critic else 0)


def reward_fn(rollout: RolloutConfig):
    """The reward function the flags name (checked now: errors name the flag)."""
    return make_reward_fn(rollout.rm_type, rollout.custom_rm_path, rollout.rm_url, rollout.reward_key,
                          rm_timeout_s=rollout.rm_timeout_s, rm_max_retries=rollout.rm_max_retries,
                          rm_backoff_s=rollout.rm_backoff_s)


def dry_run(cfg: Config, plan: PlacementPlan) -> None:
    from slime_rl.orchestration.engines import engine_command

    print(plan.describe())
    for slot in plan.engines:
        cmd = engine_command(cfg, slot, host="<node-ip>", port=30000 + 10 * slot.engine_id, api_key="<run-secret>",
                             use_gpu=plan.use_gpu)
        print(f"engine {slot.engine_id}: {' '.join(cmd)}")


def train(cfg: Config, plan: PlacementPlan) -> list[dict]:
    """Run the loop; returns the metrics rows (also in <run_dir>/metrics.jsonl).

    Sync mode: generate(k) -> train(k) -> sync. Async mode (`--async`, one step off-policy):
    generate(k+1) runs while train(k) runs; the weights are broadcast only after generate(k+1) has
    finished, so they never change in the middle of a generate call, and rollout k+1 is one
    version behind the policy it trains (the trainer's old log-probs are recomputed, so the PPO
    ratio is exact; the engine/trainer gap shows in train/rollout_logprob_abs_diff).
    """
    from slime_rl.orchestration.cluster import Cluster

    steps_per_rollout = cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt // cfg.batch.global_batch_size
    n_steps, interval = cfg.rollout.num_rollout, cfg.rollout.update_weights_interval
    logger = MetricsLogger(cfg.logging, cfg.to_dict())
    timer = Timer()
    rows = []
    cluster = Cluster(cfg, plan, api_key=secrets.token_hex(16))
    try:
        cluster.start(train_iters=n_steps * steps_per_rollout)
        first = cluster.resume()
        if cfg.eval.enabled and not cfg.eval.skip_before_train and first == 0:
            with timer("eval"):
                row = logger.log(-1, cluster.evaluate() | timer.pop())  # step -1: before any update
            print(f"eval before training: {row}", flush=True)
        pending = cluster.generate_async(first) if first < n_steps else None
        for step in range(first, n_steps):
            start = time.perf_counter()
            with timer("rollout"):
                metrics = cluster.wait(pending)
            pending = None
            if cfg.rollout.async_mode and step + 1 < n_steps:
                pending = cluster.generate_async(step + 1)
            with timer("train"):
                metrics |= cluster.train(step)
            if pending is not None:
                with timer("rollout_overlap_wait"):
                    cluster.wait_done(pending)
            if (step + 1) % interval == 0 or step + 1 == n_steps:
                with timer("weight_sync"):
                    metrics |= cluster.sync_weights(version=str(step + 1))
            if cfg.eval.enabled and (step + 1) % cfg.eval.interval == 0:
                if pending is not None:  # eval must see the new weights: let the overlapped rollout finish first
                    cluster.wait_done(pending)
                with timer("eval"):
                    metrics |= cluster.evaluate()
            ckpt = cfg.checkpoint
            if ckpt.save and ((ckpt.save_interval and (step + 1) % ckpt.save_interval == 0) or step + 1 == n_steps):
                with timer("save"):
                    cluster.save(step)  # the rollout side is saved as it was before rollout step + 1
            if pending is None and step + 1 < n_steps:
                pending = cluster.generate_async(step + 1)
            metrics |= timer.pop()
            metrics.setdefault("perf/weight_sync_s", 0.0)
            metrics.setdefault("perf/weight_sync_GBps", 0.0)
            metrics["perf/step_s"] = time.perf_counter() - start
            row = logger.log(step, metrics)
            rows.append(row)
            print(summary_line(row), flush=True)
    finally:
        cluster.shutdown()
        logger.close()
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg, plan = preflight(build_config(argv))
    except (ConfigError, DataError, RewardError, ValueError) as exc:
        print(f"slime-rl train: error: {exc}", file=sys.stderr)
        return 2
    if cfg.dry_run:
        dry_run(cfg, plan)
        return 0
    train(cfg, plan)
    return 0


if __name__ == "__main__":
    sys.exit(main())
