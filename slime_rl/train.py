"""`slime-rl train`: the RL loop.

    generate (engines) -> reward -> advantages -> train (Megatron ranks) -> broadcast weights -> ...

Everything the loop touches is validated before any actor starts: flags (ConfigError names the
flag), the dataset (DataError names the row) and the reward function (RewardError names the flag).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import secrets
import signal
import sys
import time
import traceback
from collections.abc import Sequence

import torch
from transformers import AutoTokenizer

from slime_rl.config import Config, ConfigError, RewardConfig, build_config
from slime_rl.data import DataError, PromptDataset, TokenLimit, num_rollout_for_epochs
from slime_rl.engines.launch import check_engine_config
from slime_rl.observability import MetricsLogger, Timer, summary_line
from slime_rl.orchestration.placement import PlacementPlan, plan_placement
from slime_rl.rewards import RewardError, reward_fn_from_config
from slime_rl.rewards.labels import label_problem
from slime_rl.rollout.custom import load_filter, load_generate_function


class RunFailed(RuntimeError):
    """The run stopped because a part of it failed; the message says what, where and what to run
    next (slime_rl.orchestration.failures). `known`: a failure the message fully explains (an
    unexpected one also gets its traceback printed by `main`)."""

    def __init__(self, message: str, known: bool = True) -> None:
        super().__init__(message)
        self.known = known


def preflight(cfg: Config) -> tuple[Config, PlacementPlan]:
    """Check data, reward and placement before anything is started; returns the config (with
    --num-epoch turned into steps) and the plan."""
    # --sglang-* / --router-* against the programs' own flags: a typo fails here, not on a GPU node
    cfg = dataclasses.replace(cfg, engine=check_engine_config(cfg.engine))
    if cfg.engine.use_router and not cfg.dry_run and importlib.util.find_spec("sglang_router") is None:
        raise ConfigError("--use-sglang-router: the 'sglang_router' package is not installed on the head node "
                          "(pip install slime_rl[router])")
    check_model_features(cfg)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
    labels = label_problem(cfg.reward.rm_type, cfg.reward.custom_rm_path)  # what the reward needs of a label
    dataset = PromptDataset(cfg.data, tokenizer, token_limit=token_limit(cfg, cfg.rollout.max_response_len),
                            label_check=labels)
    for _, path in cfg.eval.datasets:  # as the rollout manager reads them: unshuffled, same limits
        PromptDataset(dataclasses.replace(cfg.data, prompt_data=path, rollout_shuffle=False), tokenizer,
                      token_limit=token_limit(cfg, cfg.eval.max_response_len, "--eval-max-response-len"),
                      label_check=labels)
    if dataset.filtered_too_long:
        print(f"[slime_rl] {dataset.filtered_too_long} prompts longer than --rollout-max-prompt-len dropped")
    if cfg.data.num_epoch is not None:
        steps = num_rollout_for_epochs(len(dataset), cfg.rollout.rollout_batch_size, cfg.data.num_epoch)
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_rollout=steps))
    reward_fn(cfg.reward)
    if cfg.reward.rm_type == "reasoning_gym" and cfg.reward.custom_rm_path is None:
        check_reasoning_gym_rows(cfg.data.prompt_data, dataset)
    # extension points load here, so a bad dotted path fails before any actor starts
    load_generate_function(cfg.rollout.custom_generate_function_path)
    load_filter(cfg.rollout.dynamic_sampling_filter_path)
    return cfg, plan_placement(cfg.parallel, cfg.engine, cluster_gpus=torch.cuda.device_count(),
                               cluster_cpus=os.cpu_count(), critic_world=cfg.critic.world_size if cfg.critic else 0)


def token_limit(cfg: Config, max_response_len: int, flag: str = "--rollout-max-response-len") -> TokenLimit | None:
    """The engines' context (--sglang-context-length, else the checkpoint's max_position_embeddings)
    and what a prompt must leave of it: --rollout-max-context-len caps max_new_tokens per request,
    else the whole max_response_len must fit (SGLang refuses the request otherwise)."""
    from slime_rl.trainer.convert import read_hf_config

    hf = read_hf_config(cfg.model.hf_checkpoint)
    given = cfg.engine.sglang_args.get("context_length")
    if given is not None:
        context, source = int(given), "--sglang-context-length"
    else:
        context = hf.get("max_position_embeddings") or (hf.get("text_config") or {}).get("max_position_embeddings")
        if context is None:
            return None
        source = f"max_position_embeddings of {cfg.model.hf_checkpoint}"
    cap = cfg.rollout.rollout_max_context_len
    if cap is not None:
        return TokenLimit(min(context, cap), 1, source if cap >= context else "--rollout-max-context-len")
    if max_response_len >= context:
        raise ConfigError(f"{flag} {max_response_len}: no prompt fits with it in the context of {context} "
                          f"({source}); lower it, or let --rollout-max-context-len {context} cap each response")
    return TokenLimit(context, max_response_len, source)


def check_reasoning_gym_rows(where: object, dataset: PromptDataset) -> None:
    """--rm-type reasoning_gym: every row names a reasoning-gym task and has a label, checked now
    rather than as reward failures in the middle of step 0."""
    from slime_rl.rewards.reasoning_gym import ReasoningGymLabelError, check_labels

    try:
        check_labels([r.metadata for r in dataset.rows], [r.label for r in dataset.rows])
    except ReasoningGymLabelError as exc:
        raise DataError(f"{where} (--rm-type reasoning_gym): {exc}") from exc


def check_model_features(cfg: Config) -> None:
    """Flags that need (or do not work with) a vision-language checkpoint, from its config.json."""
    from slime_rl.trainer.convert import FAMILIES, read_hf_config

    try:
        model_type = read_hf_config(cfg.model.hf_checkpoint).get("model_type", "")
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"--hf-checkpoint: {exc}") from exc
    vision = model_type in FAMILIES and FAMILIES[model_type].vision
    if cfg.model.freeze_vision_tower and not vision:
        raise ConfigError(f"--freeze-vision-tower needs a vision-language checkpoint; --hf-checkpoint "
                          f"{cfg.model.hf_checkpoint} is model_type {model_type!r}")
    if vision and cfg.parallel.context_parallel_size > 1:
        raise ConfigError(f"--context-parallel-size {cfg.parallel.context_parallel_size}: context parallelism "
                          f"is not supported for vision-language models ({model_type})")
    check_moe_features(cfg, model_type)
    if vision and cfg.critic is not None:
        raise ConfigError(f"--advantage-estimator {cfg.algo.advantage_estimator}: a critic for vision-language "
                          f"models ({model_type}) is not supported yet; use grpo, dapo, gspo, rloo or reinforce++")


def check_moe_features(cfg: Config, model_type: str) -> None:
    """The mixture-of-experts flags against the checkpoint: expert parallelism needs experts, and as
    many of them per layer as a multiple of --expert-model-parallel-size."""
    from slime_rl.trainer.convert import FAMILIES, load_arch

    moe = model_type in FAMILIES and FAMILIES[model_type].moe
    ep, etp = cfg.parallel.expert_model_parallel_size, cfg.parallel.expert_tensor_parallel_size
    if not moe:
        if ep > 1 or (etp is not None and etp != cfg.parallel.tensor_model_parallel_size):
            raise ConfigError(f"--expert-model-parallel-size {ep} / --expert-tensor-parallel-size {etp}: "
                              f"--hf-checkpoint {cfg.model.hf_checkpoint} is a dense model ({model_type!r}), "
                              "without experts")
        return
    if cfg.trainer.moe_grouped_gemm:
        raise ConfigError("--moe-grouped-gemm needs TransformerEngine's grouped GEMM (TEGroupedMLP); the trainer "
                          "builds megatron's local spec (SequentialMLP): drop the flag")
    try:
        experts = load_arch(cfg.model.hf_checkpoint).num_experts
    except ValueError as exc:
        raise ConfigError(f"--hf-checkpoint: {exc}") from exc
    if experts % ep != 0:
        raise ConfigError(f"--expert-model-parallel-size {ep}: {cfg.model.hf_checkpoint} has {experts} experts "
                          "per layer, not a multiple of it")
    if cfg.parallel.tensor_model_parallel_size > 1 and not cfg.trainer.sequence_parallel:
        raise ConfigError(f"--tensor-model-parallel-size {cfg.parallel.tensor_model_parallel_size} with a "
                          f"mixture-of-experts model ({model_type}) needs --sequence-parallel (megatron's MoE layer "
                          "refuses to train with TP and without it)")
    if cfg.trainer.moe_token_dispatcher_type == "allgather" and cfg.parallel.pipeline_model_parallel_size > 1:
        raise ConfigError("--moe-token-dispatcher-type allgather: megatron's allgather dispatcher does not take "
                          "the variable sequence lengths pipeline stages exchange; use alltoall with "
                          "--pipeline-model-parallel-size > 1")


def reward_fn(reward: RewardConfig):
    """The reward function the flags name (checked now: errors name the flag)."""
    return reward_fn_from_config(reward)


def dry_run(cfg: Config, plan: PlacementPlan) -> None:
    from slime_rl.orchestration.engines import engine_command, engine_env

    print(plan.describe())
    for slot in plan.engines:
        cmd = engine_command(cfg, slot, host="<node-ip>", port=30000 + 10 * slot.engine_id, api_key="<run-secret>",
                             use_gpu=plan.use_gpu)
        env = "".join(f"{k}={v} " for k, v in engine_env(cfg, "<run-secret>").items())
        print(f"engine {slot.engine_id}: {env}{' '.join(cmd)}")
    if cfg.engine.use_router:
        from slime_rl.orchestration.router import router_launch_command

        urls = [f"http://<node-ip>:{30000 + 10 * slot.engine_id}" for slot in plan.engines]
        cmd = router_launch_command(cfg, "<head-ip>", cfg.engine.router_port or 30999, urls, "<run-secret>")
        print(f"router: {' '.join(cmd)}")


def train(cfg: Config, plan: PlacementPlan) -> list[dict]:
    """Run the loop; returns the metrics rows (also in <run_dir>/metrics.jsonl).

    Sync mode: generate(k) -> train(k) -> sync. Async mode (`--async`, one step off-policy):
    generate(k+1) runs while train(k) runs; the weights are broadcast only after generate(k+1) has
    finished, so they never change in the middle of a generate call, and rollout k+1 is one
    version behind the policy it trains (the trainer's old log-probs are recomputed, so the PPO
    ratio is exact; the engine/trainer gap shows in train/rollout_logprob_abs_diff).
    """
    from slime_rl.orchestration.cluster import Cluster
    from slime_rl.orchestration.failures import describe
    from slime_rl.orchestration.trainer_group import TrainerRankError

    steps_per_rollout = cfg.optimizer_steps_per_rollout
    n_steps, interval = cfg.rollout.num_rollout, cfg.weight_sync.update_weights_interval
    logger = MetricsLogger(cfg.logging, cfg.to_dict())
    timer = Timer()
    rows = []
    cluster = Cluster(cfg, plan, api_key=secrets.token_hex(16))
    failed = False
    phase, step = "start", None  # where a failure happened, for the message
    try:
        cluster.start(train_iters=n_steps * steps_per_rollout)
        phase = "resume from --load"
        first = cluster.resume()
        logger.start(first)
        if cfg.eval.enabled and not cfg.eval.skip_before_train and first == 0:
            phase = "eval before training"
            with timer("eval"):
                row = logger.log(-1, cluster.evaluate() | timer.pop())  # step -1: before any update
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
            if cfg.engine.colocate:  # the engines' memory goes to the trainer until the weight sync
                with timer("release"):
                    cluster.release_engines()
            phase = "train"
            with timer("train"):
                metrics |= cluster.train(step)
            if pending is not None:
                with timer("rollout_overlap_wait"):
                    cluster.wait_done(pending)
            phase = "engine restart"
            restarted = cluster.heal_engines() if cfg.fault.use_fault_tolerance else 0
            if restarted:
                metrics["fault/engines_restarted"] = float(restarted)
            if restarted or (step + 1) % interval == 0 or step + 1 == n_steps:  # a restarted engine needs weights
                phase = "weight sync"
                with timer("weight_sync"):
                    metrics |= cluster.sync_weights(version=str(step + 1))
            if cfg.eval.enabled and (step + 1) % cfg.eval.interval == 0:
                if pending is not None:  # eval must see the new weights: let the overlapped rollout finish first
                    cluster.wait_done(pending)
                phase = "eval"
                with timer("eval"):
                    metrics |= cluster.evaluate()
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
            rows.append(row)
            print(summary_line(row), flush=True)
    except Exception as exc:  # every failure reads as one sentence: what, where, what to run next
        failed = isinstance(exc, TrainerRankError)
        text, known = describe(exc, phase=phase, step=step, save=cfg.checkpoint.save,
                               fault_tolerance=cfg.fault.use_fault_tolerance)
        raise RunFailed(text, known=known) from exc
    finally:
        cluster.shutdown(failed=failed)
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
    if not os.environ.get("RAY_ADDRESS"):  # this driver starts Ray: what it starts goes with it, kill -9 included
        from slime_rl.orchestration.reaper import start_reaper

        start_reaper()
    # SIGTERM (kill, a scheduler's cancel) unwinds like Ctrl-C: the engines and trainers are stopped
    signal.signal(signal.SIGTERM, _exit_on_signal)
    try:
        train(cfg, plan)
    except RunFailed as exc:
        if not exc.known and exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"slime-rl train: error: {exc}", file=sys.stderr)
        return 1
    return 0


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())
