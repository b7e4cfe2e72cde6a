"""Flags (+ YAML overlay) -> validated, typed `Config`.

Order of precedence: parser defaults < YAML file (`--config`) < command line. Every user error
raises `ConfigError` whose message names the flag (or the YAML file and key).

`parse.py` reads argv and the YAML file into the flat namespace (`parse_flags`); this module builds
the typed groups from it (`build_config`), computing the fields several flags decide together and
checking the combinations of flags where it computes them; `checks.py` holds the error type and the
checks of one flag or one feature. `ConfigError`, `parse_flags`, `split_router_args` and
`ROUTER_KEY` are re-exported from here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from slime_rl.config.builtin_engine import from_sglang_args, not_taken
from slime_rl.config.checks import (
    ConfigError,
    ConfigNote,
    _check,
    _check_colocate,
    _check_flags,
    _check_fully_async,
    _check_path_template,
    _check_weight_transport,
    _require,
    _same_path,
)
from slime_rl.config.estimators import ESTIMATOR_SPECS, estimator_spec
from slime_rl.config.flags import EMBEDDED_SGLANG_ARGS, FLAGS, default_of
from slime_rl.config.flags_from_slime import SLIME_FULLY_ASYNC_ROLLOUT, SLIME_OPD_REWARD, SLIME_TIS_FUNCTIONS
from slime_rl.config.flags_model import megatron_model_args
from slime_rl.config.groups import GROUPS, Config, CriticConfig, EngineConfig, EvalConfig, ParallelConfig
from slime_rl.config.parse import ROUTER_KEY, parse_flags, split_router_args
from slime_rl.config.rollout_corr import parse_rejection
from slime_rl.config.seeds import run_seed

__all__ = ["ROUTER_KEY", "ConfigError", "build_config", "parse_flags", "split_router_args"]


def _truthy(value: Any) -> bool:
    """A `--sglang-<switch>` value: given bare (True) or spelled true/false (YAML, the command line)."""
    return value is True or str(value).lower() in ("true", "1")


def _fields(a: argparse.Namespace, group: str) -> dict[str, Any]:
    """The fields of `group` that flags fill as given (flags.Flag.to), by keyword."""
    return {name: f.value(a) for f in FLAGS for g, name in f.targets if g == group}


def _group(a: argparse.Namespace, group: str, **derived: Any) -> Any:
    """GROUPS[group] by keyword: the fields its flags fill as given, plus the `derived` ones that
    load.py computed (from several flags, or from the --sglang-* pass-through)."""
    return GROUPS[group](**_fields(a, group), **derived)


def build_config(argv: Sequence[str], check_paths: bool = True) -> Config:
    """argv of `slime-rl train` -> a validated Config. Raises ConfigError naming the flag."""
    a, passthrough = parse_flags(argv)
    sglang, router = split_router_args(passthrough)
    for f in FLAGS:
        if f.required:
            _require(a, f.name)
    hf, prompt_data = a.hf_checkpoint, a.prompt_data
    _check(a.num_rollout is None or a.num_epoch is None, "--num-rollout and --num-epoch exclude each other")
    # with --num-epoch the step count is known once the dataset is read (train.preflight sets it)
    num_rollout = a.num_rollout if a.num_epoch is not None else _require(a, "--num-rollout")
    num_rollout = num_rollout or 1
    _check(a.cluster is None or a.dry_run, "--cluster plans for another cluster and needs --dry-run (a run uses "
           "the cluster Ray sees)")
    if check_paths:
        _check(Path(hf, "config.json").is_file(),
               f"--hf-checkpoint {hf}: no config.json there (an HF model folder is expected)")
        data_file = prompt_data.split("@[", 1)[0]  # path@[start:end] selects rows
        # --cluster plans from here for machines whose data paths may exist only there
        _check(a.cluster is not None or Path(data_file).is_file(), f"--prompt-data {data_file}: file not found")

    _check_flags(a)
    parallel: ParallelConfig = _group(a, "parallel")
    mp = parallel.tensor_model_parallel_size * parallel.pipeline_model_parallel_size * parallel.context_parallel_size
    _check(parallel.world_size % mp == 0,
           f"--tensor-model-parallel-size ({a.tensor_model_parallel_size}) x --context-parallel-size "
           f"({a.context_parallel_size}) x --pipeline-model-parallel-size "
           f"({a.pipeline_model_parallel_size}) must divide the trainer world size "
           f"--actor-num-nodes x --actor-num-gpus-per-node = {parallel.world_size}")
    etp = a.expert_tensor_parallel_size or a.tensor_model_parallel_size
    _check((parallel.world_size // parallel.pipeline_model_parallel_size) % (a.expert_model_parallel_size * etp) == 0,
           f"--expert-model-parallel-size ({a.expert_model_parallel_size}) x --expert-tensor-parallel-size ({etp}) "
           f"must divide the trainer world size {parallel.world_size} / --pipeline-model-parallel-size "
           f"({a.pipeline_model_parallel_size})")
    if a.sequence_parallel and a.tensor_model_parallel_size == 1:
        # as Megatron-LM's arguments.py does (slime's TP-1 scripts pass it): nothing to split the sequence over
        warnings.warn("--sequence-parallel with --tensor-model-parallel-size 1: off (Megatron-LM turns it off too)",
                      ConfigNote, stacklevel=2)
        a.sequence_parallel = False
    if a.moe_token_dispatcher_type == "flex":
        # slime's MoE scripts pass flex with --moe-enable-deepep: megatron-core's flex dispatcher moves tokens
        # with DeepEP / HybridEP GPU kernels, which are not built here; alltoall sends every token to the same
        # experts (the routing and the expert math do not depend on the dispatcher), through torch collectives
        warnings.warn("--moe-token-dispatcher-type flex: megatron-core's flex dispatcher needs DeepEP, which is not "
                      "used here; alltoall sends the same tokens to the same experts", ConfigNote, stacklevel=2)
        a.moe_token_dispatcher_type = "alltoall"
    _check(not a.sequence_parallel or a.pack_sequences, "--sequence-parallel needs packed sequences "
           "(drop --no-pack-sequences)")
    _check(not a.use_dynamic_batch_size or a.max_tokens_per_gpu is not None,
           "--use-dynamic-batch-size needs --max-tokens-per-gpu")
    if not (a.lora_rank or a.lora_load):
        given = [f for f, v in (("--lora-alpha", a.lora_alpha), ("--lora-dropout", a.lora_dropout or None),
                                ("--lora-target-modules", a.lora_target_modules != ["all-linear"]
                                 and a.lora_target_modules != ("all-linear",) or None)) if v is not None]
        _check(not given, f"{', '.join(given)} set LoRA's adapters, which are on only with --lora-rank N (or "
               "--lora-load ADAPTER_FOLDER)")

    seed = run_seed(a.seed, a.rollout_seed)  # config/seeds.py: both flags enter every rollout-side choice
    if a.rollout_function_path == SLIME_FULLY_ASYNC_ROLLOUT:  # slime's examples/fully_async
        a.fully_async = True
    _check_fully_async(a)
    _check_weight_transport(a)
    # slime asserts the same: the MTP loss trains layers that --mtp-num-layers builds
    _check(not a.enable_mtp_training or bool(a.mtp_num_layers),
           "--enable-mtp-training needs --mtp-num-layers N (the multi-token-prediction layers to build and train)")
    _check(not (a.mtp_num_layers and (a.lora_rank or a.lora_load)),
           "--mtp-num-layers with --lora-rank / --lora-load: LoRA adapts the decoder's linears and freezes the rest, "
           "the multi-token-prediction layers train whole; give one of the two")
    rollout = _group(a, "rollout", num_rollout=num_rollout, sample_seed=seed if a.deterministic_rollout else None)
    samples = rollout.samples_per_rollout
    gbs = a.global_batch_size or samples
    if a.num_steps_per_rollout is not None:  # slime's: gbs = samples per rollout / steps
        _check(samples % a.num_steps_per_rollout == 0,
               f"--num-steps-per-rollout ({a.num_steps_per_rollout}) must divide --rollout-batch-size x "
               f"--n-samples-per-prompt ({samples})")
        _check(a.global_batch_size is None or a.global_batch_size == samples // a.num_steps_per_rollout,
               f"--global-batch-size ({a.global_batch_size}) and --num-steps-per-rollout ({a.num_steps_per_rollout}) "
               f"disagree: {samples} samples per rollout / {a.num_steps_per_rollout} steps = "
               f"{samples // a.num_steps_per_rollout} (give one of them)")
        gbs = samples // a.num_steps_per_rollout
    dp = parallel.data_parallel_size
    _check(samples % gbs == 0,
           f"--global-batch-size ({gbs}) must divide --rollout-batch-size x --n-samples-per-prompt ({samples})")
    _check(gbs % (a.micro_batch_size * dp) == 0,
           f"--global-batch-size ({gbs}) must be a multiple of --micro-batch-size ({a.micro_batch_size}) "
           f"x data-parallel size ({dp})")
    eps_high = a.eps_clip if a.eps_clip_high is None else a.eps_clip_high
    _check(0 < eps_high < 10, f"--eps-clip-high must be in (0, 10), got {eps_high}")
    _check(a.overlong_buffer_len <= a.rollout_max_response_len,
           f"--overlong-buffer-len ({a.overlong_buffer_len}) must be <= --rollout-max-response-len "
           f"({a.rollout_max_response_len})")
    _check(a.tis_clip > 0 and 0 <= a.tis_clip_low <= a.tis_clip,
           f"--tis-clip-low ({a.tis_clip_low}) must be in [0, --tis-clip ({a.tis_clip})]")
    spec = estimator_spec(a.advantage_estimator)
    _check(a.kl_coef == 0 or spec.kl_in_rewards,
           f"--kl-coef (KL in the rewards) is used by --advantage-estimator "
           f"{' and '.join(s.name for s in ESTIMATOR_SPECS.values() if s.kl_in_rewards)}; "
           "use --use-kl-loss --kl-loss-coef for a KL loss")
    _check(0 <= a.min_lr <= a.lr, f"--min-lr must be in [0, --lr], got {a.min_lr}")
    _check(a.lr_warmup_fraction is None or a.lr_warmup_iters == 0,
           "--lr-warmup-fraction and --lr-warmup-iters exclude each other (Megatron's rule): give one")
    _check(not a.calculate_per_token_loss or a.loss_agg_mode == "token-mean",
           "--calculate-per-token-loss is --loss-agg-mode token-mean; it contradicts --loss-agg-mode "
           f"{a.loss_agg_mode}")
    if spec.loss_agg_mode is not None and a.loss_agg_mode != spec.loss_agg_mode:
        # a warning, not a changed default: a recipe that relies on the default keeps its numbers
        warnings.warn(f"--advantage-estimator {spec.name} with --loss-agg-mode {a.loss_agg_mode}: the method's "
                      f"paper (and verl) aggregate with {spec.loss_agg_mode}; pass --loss-agg-mode "
                      f"{spec.loss_agg_mode} to match it", ConfigNote, stacklevel=2)
    a.rollout_num_gpus = a.rollout_num_gpus or (parallel.world_size if a.colocate else 1)
    if a.colocate:
        _check_colocate(a, parallel)
    _check(a.rollout_num_gpus % a.rollout_num_gpus_per_engine == 0,
           f"--rollout-num-gpus-per-engine ({a.rollout_num_gpus_per_engine}) must divide "
           f"--rollout-num-gpus ({a.rollout_num_gpus})")
    _check(a.eps_clip_c is None or estimator_spec(a.advantage_estimator).dual_clip,
           f"--eps-clip-c (PPO's dual clip) has no effect with --advantage-estimator {a.advantage_estimator}, whose "
           "loss does not take the PPO minimum; drop it")
    _check(not (a.use_rollout_logprobs and a.use_tis), "--use-rollout-logprobs with --use-tis: the old log-probs "
           "would be the engine's, so every importance weight is 1 (slime refuses the pair too); drop one")
    for flag, on in (("--rollout-rs", a.rollout_rs), ("--rollout-rs-veto-threshold", a.rollout_rs_veto_threshold)):
        _check(not (a.use_rollout_logprobs and on), f"--use-rollout-logprobs with {flag}: the old log-probs would "
               "be the engine's, so no token could be rejected; drop one")
    if a.rollout_rs is not None or a.rollout_rs_threshold is not None:
        _check(a.rollout_rs is not None, "--rollout-rs-threshold without --rollout-rs: name the rejection options "
               "(e.g. --rollout-rs token_k1)")
        try:
            parse_rejection(a.rollout_rs, a.rollout_rs_threshold)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if a.custom_tis_function_path is not None:  # slime's built-in functions are modes here
        mode = SLIME_TIS_FUNCTIONS[a.custom_tis_function_path]
        if mode is None:  # its mismatch helper: the file's settings are the flags (parse.py, slime_mis.py)
            _check(a.custom_config_path is not None, f"--custom-tis-function-path {a.custom_tis_function_path} "
                   "reads its settings (use_tis, tis_mode, tis_upper_bound, use_rs, ...) from --custom-config-path: "
                   "give the file (slime's examples/train_infer_mismatch_helper/mis.yaml)")
        else:
            _check(a.tis_mode in ("truncate", mode), f"--custom-tis-function-path {a.custom_tis_function_path} is "
                   f"--tis-mode {mode}; it contradicts --tis-mode {a.tis_mode}: give one")
            a.tis_mode = mode
    _check(not a.tis_batch_normalize or a.use_tis, "--tis-batch-normalize normalizes --use-tis's weights, which "
           "are off: add --use-tis or drop it")
    _check(not a.tis_batch_normalize or a.tis_level != "geometric", "--tis-batch-normalize with --tis-level "
           "geometric: the weights are normalized at token or sequence level (as slime's helper and verl); drop one")
    for flag, value, default in (("--tis-level", a.tis_level, "token"), ("--tis-mode", a.tis_mode, "truncate")):
        _check(a.use_tis or value == default, f"{flag} {value} shapes --use-tis's weights, which are off: add "
               "--use-tis or drop it")
    # slime's agent examples score in their generate function (sample.reward), with no reward flag
    if a.agent_env is not None and a.agent_env.startswith("verifiers:"):  # a taskset file: the same for every process
        taskset, sep, rest = a.agent_env[len("verifiers:"):].partition(":")
        if taskset.endswith(".py"):
            a.agent_env = f"verifiers:{os.path.abspath(taskset)}{sep}{rest}"
    _check(a.agent_env is None or a.custom_generate_function_path is None,
           f"--agent-env {a.agent_env} and --custom-generate-function-path {a.custom_generate_function_path} both "
           "generate the samples: give one")
    _check(a.rm_type is not None or a.custom_rm_path is not None or a.custom_generate_function_path is not None
           or a.agent_env is not None,
           "--rm-type or --custom-rm-path is required (or a --custom-generate-function-path or --agent-env that sets "
           "each sample's reward)")
    _check(not a.group_rm or a.custom_rm_path is not None, "--group-rm needs --custom-rm-path (a function that "
           "scores a list of samples)")
    # the NCCL weight-update group counts N ranks per engine; the built-in engine would join with one.
    # Colocated, an engine of N devices gets one handle per device in one request: the built-in engine
    # takes it (reading the one of its first device, where it computes: engines/embedded/weights.py)
    _check(a.rollout_backend != "embedded" or a.rollout_num_gpus_per_engine == 1 or a.colocate,
           f"--rollout-num-gpus-per-engine {a.rollout_num_gpus_per_engine} needs --rollout-backend sglang "
           "(the built-in engine is one process on one device; with --colocate it spans the devices and computes "
           "on the first)")
    if a.rollout_backend == "embedded" and a.rollout_num_gpus_per_engine > 1:
        warnings.warn(f"--rollout-num-gpus-per-engine {a.rollout_num_gpus_per_engine} with --rollout-backend "
                      "embedded --colocate: each built-in engine spans that many trainer devices and computes on the "
                      "first of them (it has no tensor parallel); --rollout-backend sglang runs it as TP "
                      f"{a.rollout_num_gpus_per_engine}", ConfigNote, stacklevel=2)
    if a.rollout_backend == "embedded":
        other = not_taken(sglang)
        _check(not other, f"{', '.join(other)}: SGLang's server flags, "
               "but --rollout-backend is embedded (give --rollout-backend sglang; the built-in engine takes only "
               f"{', '.join('--sglang-' + n.replace('_', '-') for n in EMBEDDED_SGLANG_ARGS)})")
        try:  # each value converts to its engine setting's type and range (config/builtin_engine.py)
            from_sglang_args(sglang)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _check(a.use_sglang_router or not router, f"--router-* flags given ({', '.join(sorted(router))}) "
           "but not --use-sglang-router")
    _check(a.use_sglang_router or a.sglang_router_port is None, "--sglang-router-port needs --use-sglang-router")
    # our failover resends a dead engine's requests elsewhere; behind the router we cannot see which
    # engine a request went to (the router has its own retries and circuit breaker: --router-* flags)
    _check(not (a.use_fault_tolerance and a.use_sglang_router),
           "--use-fault-tolerance and --use-sglang-router exclude each other (configure the router's own "
           "retries with --router-* flags)")
    _check(a.ref_update_interval is None or a.use_kl_loss or a.kl_loss_coef > 0 or a.kl_coef > 0,
           "--ref-update-interval needs a reference model: --use-kl-loss, --kl-loss-coef or --kl-coef")
    if a.use_opd or a.opd_type is not None or a.opd_teacher_load is not None:
        _check(a.use_opd, "--opd-type / --opd-teacher-load need --use-opd (on-policy distillation)")
        _check(a.opd_type is not None, "--use-opd needs --opd-type: megatron (the teacher runs on the trainer ranks, "
               "from --opd-teacher-load) or sglang (the teacher's own server at --rm-url scores each sample's tokens)")
    if a.use_opd and a.opd_type == "megatron":
        _check(a.opd_teacher_load is not None, "--opd-type megatron needs --opd-teacher-load (the teacher: a Megatron "
               "checkpoint or an HF folder of the policy's architecture)")
        _check(os.path.isdir(a.opd_teacher_load) or a.cluster is not None,
               f"--opd-teacher-load {a.opd_teacher_load}: no such folder")
    if a.use_opd and a.opd_type == "sglang":
        _check(a.rm_url is not None, "--opd-type sglang needs --rm-url: the teacher server's /generate URL (slime's "
               "place for it), which returns the teacher's log-prob of each sample token")
        _check(a.opd_teacher_load is None, f"--opd-teacher-load {a.opd_teacher_load} is --opd-type megatron's teacher; "
               "--opd-type sglang asks the server at --rm-url: give one")
        _check(a.rm_type != "remote_rm", "--rm-type remote_rm with --opd-type sglang: --rm-url is the teacher's "
               "/generate URL here, not a reward model")
    _check(a.custom_reward_post_process_path is None or (a.use_opd and a.opd_type == "sglang"),
           f"--custom-reward-post-process-path {a.custom_reward_post_process_path} is slime's on-policy distillation "
           "through a teacher server: it needs --use-opd --opd-type sglang")
    _check(a.custom_rm_path != SLIME_OPD_REWARD or (a.use_opd and a.opd_type == "sglang"),
           f"--custom-rm-path {SLIME_OPD_REWARD} posts each sample to a teacher server: it is --use-opd --opd-type "
           "sglang here (with --rm-url the teacher's /generate URL)")
    if a.ref_load is not None:
        # with --cluster the folder may exist on that cluster only (the plan lists it as not checked here)
        _check(os.path.isdir(a.ref_load) or a.cluster is not None, f"--ref-load {a.ref_load}: no such folder")
        if not (a.use_kl_loss or a.kl_loss_coef > 0 or a.kl_coef > 0):
            # slime's scripts pass --ref-load always (there it is also the initial checkpoint); not an error
            warnings.warn(f"--ref-load {a.ref_load}: no KL term uses a reference model (--use-kl-loss, "
                          "--kl-loss-coef, --kl-coef), so it is not loaded; the policy starts from --hf-checkpoint",
                          ConfigNote, stacklevel=2)
    _check(a.save_interval is None or a.save is not None or a.save_hf is not None,
           "--save-interval needs --save or --save-hf")
    _check_path_template("--save-hf", a.save_hf, ("rollout_id",))
    _check_path_template("--save-debug-rollout-data", a.save_debug_rollout_data, ("rollout_id",))
    _check_path_template("--save-debug-train-data", a.save_debug_train_data, ("rollout_id", "rank"))
    _check_path_template("--load-debug-rollout-data", a.load_debug_rollout_data, ("rollout_id",))
    train_only = a.load_debug_rollout_data is not None
    _check(not a.debug_train_only or train_only,
           "--debug-train-only needs --load-debug-rollout-data (the saved rollouts to train on; it implies "
           "--debug-train-only): slime also trains SFT data with it, which this RL trainer has not, and without "
           "engines nothing else gives a step its data")
    if a.save_debug_train_data is not None and dp > 1 and "{rank}" not in a.save_debug_train_data:
        warnings.warn(f"--save-debug-train-data {a.save_debug_train_data!r} has no {{rank}}: the {dp} data-parallel "
                      "ranks write the same file, and only one rank's samples stay", ConfigNote, stacklevel=2)
    _check(not a.mask_offpolicy_in_partial_rollout or a.partial_rollout or a.fully_async,
           "--mask-offpolicy-in-partial-rollout needs --partial-rollout or --fully-async")
    _check(a.keep_last is None or a.save is not None, "--keep-last needs --save")
    _check(not a.exit_signal_handler or a.save is not None,
           "--exit-signal-handler saves a checkpoint when SIGTERM comes: it needs --save (the folder to save into)")
    # a mistyped --load must not train from scratch and exit 0; --load equal to --save is auto-resume,
    # whose folder does not exist before the first save
    _check(a.load is None or os.path.exists(a.load) or _same_path(a.load, a.save) or a.cluster is not None,
           f"--load {a.load}: no such folder (to start fresh and resume later, give --save the same path)")
    for flag, module in (("--use-wandb", "wandb"), ("--use-tensorboard", "tensorboard"), ("--use-swanlab", "swanlab")):
        if getattr(a, flag[2:].replace("-", "_")):
            _check(importlib.util.find_spec(module) is not None,
                   f"{flag}: the '{module}' package is not installed (pip install slime_rl[{module}])")

    a.image_key = _image_key(a)
    run_dir = a.run_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))
    return Config(
        parallel=parallel,
        batch=_group(a, "batch", global_batch_size=gbs),
        trainer=_group(a, "trainer"),
        optimizer=_group(a, "optimizer"),
        model=_group(a, "model", fp32_lm_head=_truthy(sglang.get("enable_fp32_lm_head")),
                     megatron_model_args=megatron_model_args(a)),
        algo=_group(a, "algo", eps_clip_high=eps_high),
        data=_group(a, "data", seed=seed),
        rollout=rollout,
        reward=_group(a, "reward"),
        engine=_engine_config(a, sglang, router, train_only),
        weight_sync=_group(a, "weight_sync"),
        checkpoint=_group(a, "checkpoint"),
        logging=_group(a, "logging", run_dir=run_dir),
        eval=_eval_config(a, check_paths and a.cluster is None, train_only),
        fault=_group(a, "fault"),
        critic=_critic_config(a, parallel, gbs, samples),
        plan=_group(a, "plan"),
        debug=_group(a, "debug", train_only=train_only),
        **_fields(a, ""),
    )


def _critic_config(a: argparse.Namespace, policy: ParallelConfig, gbs: int, samples: int) -> CriticConfig | None:
    """PPO's critic (None for the other estimators, whose critic flags must stay unset)."""
    if not estimator_spec(a.advantage_estimator).critic:
        given = [f.name for f in FLAGS if any(g == "critic" for g, _ in f.targets + f.derived_targets)
                 and getattr(a, f.key) != f.default]
        _check(not given, f"{', '.join(given)}: critic flags need --advantage-estimator "
               f"{' or '.join(s.name for s in ESTIMATOR_SPECS.values() if s.critic)}")
        return None
    critic: CriticConfig = _group(a, "critic", num_nodes=a.critic_num_nodes or policy.actor_num_nodes,
                                  num_gpus_per_node=a.critic_num_gpus_per_node or policy.actor_num_gpus_per_node,
                                  lr=a.lr if a.critic_lr is None else a.critic_lr)
    mp = policy.tensor_model_parallel_size * policy.pipeline_model_parallel_size
    _check(critic.world_size % mp == 0,
           f"--critic-num-nodes x --critic-num-gpus-per-node ({critic.world_size}) must be a multiple of "
           f"--tensor-model-parallel-size x --pipeline-model-parallel-size ({mp}): the critic uses the policy's TP/PP")
    dp = critic.world_size // mp
    _check(gbs % (a.micro_batch_size * dp) == 0,
           f"--global-batch-size ({gbs}) must be a multiple of --micro-batch-size ({a.micro_batch_size}) x the "
           f"critic's data-parallel size ({dp})")
    _check(critic.lr > 0, f"--critic-lr must be > 0, got {critic.lr}")
    _check(a.value_clip > 0, f"--value-clip must be > 0, got {a.value_clip}")
    _check(0 <= a.lambd <= 1, f"--lambd must be in [0, 1], got {a.lambd}")
    _check(critic.lr_warmup_iters == 0 or a.num_rollout is None or critic.lr_warmup_iters < a.num_rollout
           * (samples // gbs),
           "--critic-lr-warmup-iters must be below the number of optimizer steps")
    _check(critic.save is None or a.save is not None, "--critic-save needs --save (the critic is saved with it)")
    _check(critic.load is None or os.path.exists(critic.load) or _same_path(critic.load, critic.save),
           f"--critic-load {critic.load}: no such folder (to start fresh and resume later, give --critic-save "
           "the same path)")
    return critic


def _engine_config(a: argparse.Namespace, sglang: dict[str, Any], router: dict[str, Any],
                   train_only: bool) -> EngineConfig:
    """The engines of the run. Train-only (--load-debug-rollout-data): none (0 devices, nothing colocated),
    so the placement, --dry-run and the cluster plan and start no engine; the flags were checked all the same."""
    engine: EngineConfig = _group(a, "engine", num_gpus=a.rollout_num_gpus, sglang_args=sglang, router_args=router)
    if train_only:
        return dataclasses.replace(engine, num_gpus=0, colocate=False)
    groups = _server_groups(a, engine)
    if any(g.worker_type != "regular" for g in groups):  # PD: sglang-router's PD mode pairs the engines
        engine = dataclasses.replace(engine, use_router=True)
    return dataclasses.replace(engine, server_groups=groups)


def _modern_overrides(path: str | None, i: int, group: Any) -> Any:
    """A server group's overrides under the installed SGLang's names, as the --sglang-* flags are (slime's files
    name SGLang 0.5.15's: cuda_graph_max_bs, ...), each rename said once in a note naming the file and group."""
    from slime_rl.config.sglang_changes import modernize

    if not group.overrides:
        return group
    where = f"--sglang-config {path}: server group {i} ({group.worker_type}) overrides"
    try:
        overrides, notes = modernize(group.overrides)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    for note in notes:
        warnings.warn(f"{where}: {note}", ConfigNote, stacklevel=2)
    return dataclasses.replace(group, overrides=overrides)


def _server_groups(a: argparse.Namespace, engine: EngineConfig) -> tuple:
    """slime's --prefill-num-servers / --sglang-config as the engines' groups (config/server_groups.py), checked
    against the other flags; () when neither is given. (A --sglang-disaggregation-* flag or override of the modes
    these set is refused with the other flags the launcher sets: engines/launch.py SGLANG_OWNED.)"""
    from slime_rl.config.server_groups import ServerGroupError, from_prefill_num_servers, read_sglang_config

    if a.prefill_num_servers is None and a.sglang_config is None:
        return ()
    flag = "--prefill-num-servers" if a.sglang_config is None else "--sglang-config"
    _check(a.prefill_num_servers is None or a.sglang_config is None, "--prefill-num-servers and --sglang-config "
           "exclude each other (as in slime): give the prefill/decode split as server groups in the file")
    try:
        groups = (from_prefill_num_servers(a.prefill_num_servers, engine.num_engines) if flag == "--prefill-num-servers"
                  else read_sglang_config(a.sglang_config, a.hf_checkpoint, engine.num_gpus,
                                          engine.num_gpus_per_engine))
    except ServerGroupError as exc:
        raise ConfigError(str(exc)) from None
    groups = tuple(_modern_overrides(a.sglang_config, i, g) for i, g in enumerate(groups))
    if any(g.worker_type != "regular" for g in groups):
        _check(a.rollout_backend == "sglang", f"{flag}: prefill/decode disaggregation moves each request's KV cache "
               "from a prefill engine to a decode engine inside SGLang (--sglang-disaggregation-transfer-backend); "
               "the built-in engine has no such transfer: give --rollout-backend sglang")
        _check(not a.use_fault_tolerance, f"{flag} with --use-fault-tolerance: a restarted engine is not put back "
               "into the router's prefill/decode pairs (not built); drop --use-fault-tolerance")
    elif a.rollout_backend != "sglang":
        _check(not any(g.overrides for g in groups), f"{flag}: its groups' overrides are SGLang's server settings; "
               "give --rollout-backend sglang")
    return groups


def _image_key(a: argparse.Namespace) -> str:
    """--image-key, or the image column of slime's --multimodal-keys JSON map (media type -> column)."""
    if a.multimodal_keys is None:
        return a.image_key
    try:
        keys = json.loads(a.multimodal_keys)
    except ValueError as exc:
        raise ConfigError(f"--multimodal-keys {a.multimodal_keys!r}: not JSON ({exc})") from exc
    _check(isinstance(keys, dict) and all(isinstance(v, str) and v for v in keys.values()),
           f"--multimodal-keys {a.multimodal_keys!r}: must be a JSON object from media type to column, as "
           '\'{"image": "images"}\'')
    other = sorted(set(keys) - {"image"})
    _check(not other, f"--multimodal-keys {a.multimodal_keys}: {', '.join(other)} is not read here (images only, "
           "from one column)")
    _check(a.image_key in (keys.get("image"), default_of("--image-key")),
           f"--multimodal-keys gives the image column {keys.get('image')!r} and --image-key {a.image_key!r}: give one")
    return keys.get("image", a.image_key)


def _eval_config(a: argparse.Namespace, check_paths: bool, train_only: bool = False) -> EvalConfig:
    pairs = a.eval_prompt_data or []
    settings: dict[str, dict[str, Any]] = {}
    if a.eval_config is not None:  # slime's eval YAML (config/eval_config.py); it wins, as in slime
        from slime_rl.config.eval_config import EvalConfigError, read_eval_config

        try:
            named, settings = read_eval_config(a.eval_config)
        except EvalConfigError as exc:
            raise ConfigError(str(exc)) from exc
        if pairs:
            warnings.warn(f"--eval-config {a.eval_config} gives the eval sets; --eval-prompt-data is not used (as in "
                          "slime)", ConfigNote, stacklevel=2)
        pairs = [x for pair in named for x in pair]
    if len(pairs) == 1:  # slime's legacy form: one file, which it names aime
        warnings.warn(f"--eval-prompt-data {pairs[0]}: one file and no name: named 'aime' as slime names it "
                      "(give NAME PATH pairs to name it)", ConfigNote, stacklevel=2)
        pairs = ["aime", pairs[0]]
    _check(len(pairs) % 2 == 0, f"--eval-prompt-data takes NAME PATH pairs, got {len(pairs)} values")
    datasets = tuple((pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2))
    source = f"--eval-config {a.eval_config}: dataset" if a.eval_config is not None else "--eval-prompt-data"
    for name, path in datasets:
        _check(not check_paths or Path(path).is_file(), f"{source} {name}: file not found: {path}")
        # no reward check of its own: eval samples come from the run's generate function and are scored as the
        # run's (as in slime), whose reward the reward group checks, or by the set's own --eval-config reward
    if datasets and a.eval_interval is None:  # slime's scripts switch eval off by commenting the interval out
        warnings.warn("--eval-prompt-data without --eval-interval: no eval runs (as in slime); add --eval-interval "
                      "N to evaluate every N steps", ConfigNote, stacklevel=2)
    _check(not a.log_eval_generations or datasets, f"--log-eval-generations {a.log_eval_generations} needs "
           "--eval-prompt-data and --eval-interval (it logs samples of the evals)")
    eval_cfg: EvalConfig = _group(
        a, "eval", datasets=datasets, settings=settings,
        temperature=a.rollout_temperature if a.eval_temperature is None else a.eval_temperature,
        top_p=a.rollout_top_p if a.eval_top_p is None else a.eval_top_p,
        top_k=a.rollout_top_k if a.eval_top_k is None else a.eval_top_k,
        max_response_len=a.eval_max_response_len or a.rollout_max_response_len)
    if train_only and eval_cfg.enabled:
        # eval generates: without engines it cannot run; the user's script stays valid, the eval is left out
        warnings.warn(f"--eval-prompt-data {' '.join(name for name, _ in datasets)}: eval is skipped with "
                      "--load-debug-rollout-data (it generates, and a train-only run starts no engine)",
                      ConfigNote, stacklevel=3)
        eval_cfg = dataclasses.replace(eval_cfg, datasets=(), interval=None, log_generations=0)
    return eval_cfg
