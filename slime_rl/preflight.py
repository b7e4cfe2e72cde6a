"""The driver's checks before anything starts: `preflight` reads the data, the checkpoint's config.json
and the files the flags name, and checks what the flags alone cannot (config/load.py checks those):
the model's features against the parallel layout (MoE, vision, routing replay), --ref-load, the rows
against the reward, the extension points. Errors are ConfigError / DataError / RewardError naming the
flag, file or row, before any actor starts."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
from collections.abc import Iterator
from typing import Any

import torch
from transformers import AutoTokenizer

from slime_rl.config import Config, ConfigError, RewardConfig
from slime_rl.config.dotted_path import absent_module
from slime_rl.config.slime_args import slime_args
from slime_rl.data import DataError, PromptDataset, TokenLimit, num_rollout_for_epochs
from slime_rl.data.debug_rollouts import read_debug_rollout
from slime_rl.engines.launch import check_engine_config
from slime_rl.orchestration.placement import PlacementPlan, assign_devices, plan_placement
from slime_rl.rewards import RewardError, eval_reward_fn, opd_teacher_url, reward_fn_from_config
from slime_rl.rewards.builtin import REWARDS
from slime_rl.rewards.labels import label_problem
from slime_rl.rollout.custom import load_filter, rollout_generate_function

# the files an HF folder's tokenizer is read from (any one of them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model", "vocab.txt")


def preflight(cfg: Config) -> tuple[Config, PlacementPlan]:
    """Check data, reward and placement before anything is started; returns the config (with
    --num-epoch turned into steps) and the plan."""
    # --sglang-* / --router-* against the programs' own flags: a typo fails here, not on a GPU node
    cfg = dataclasses.replace(cfg, engine=check_engine_config(cfg.engine))
    router_started = cfg.engine.use_router and not cfg.dry_run and not cfg.debug.train_only
    if router_started and importlib.util.find_spec("sglang_router") is None:
        raise ConfigError("--use-sglang-router: the 'sglang_router' package is not installed on the head node "
                          "(pip install slime_rl[router])")
    check_model_features(cfg)
    check_checkpoints(cfg)
    check_ref_load(cfg)  # with --cluster, a --ref-load / --opd-teacher-load that exists only there is not checked here
    labels = label_problem(cfg.reward.rm_type, cfg.reward.custom_rm_path)  # what the reward needs of a label
    not_here = missing_here(cfg)
    if not any(os.path.isfile(os.path.join(cfg.model.hf_checkpoint, f)) for f in TOKENIZER_FILES):
        # transformers 5 builds an empty tokenizer from config.json alone: every prompt would be 0 tokens
        if cfg.plan.cluster is None:
            raise ConfigError(f"--hf-checkpoint {cfg.model.hf_checkpoint}: no tokenizer files there (one of "
                              f"{', '.join(TOKENIZER_FILES)})")
        not_here.append(f"the tokenizer of --hf-checkpoint {cfg.model.hf_checkpoint} (no tokenizer files here)")
    if not not_here:
        tokenizer = AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint)
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
    else:
        dataset = None
        token_limit(cfg, cfg.rollout.max_response_len)  # what config.json alone can tell
    if cfg.debug.train_only and cfg.plan.cluster is None and not cfg.checkpoint.load:
        check_replay_files(cfg)  # after --num-epoch became a number of steps
    args = slime_args(cfg)  # what slime-style extension functions get first
    # extension points load here, so a bad dotted path fails before any actor starts (planned for another
    # cluster, a module that is not on this machine at all is named as not checked here, as its data files are)
    with _user_module(cfg, not_here):
        reward_fn_from_config(cfg.reward, args=args, generate_sets_reward=cfg.rollout.generate_sets_reward,
                              opd_teacher_url=opd_teacher_url(cfg))
    for name, _ in cfg.eval.datasets:  # --eval-config: a set's own reward loads now too
        if {"rm_type", "custom_rm_path"} & set(cfg.eval.settings.get(name, {})):
            with _user_module(cfg, not_here):
                try:
                    eval_reward_fn(cfg, name, args)
                except RewardError as exc:
                    raise RewardError(f"--eval-config dataset {name}: {exc}") from exc
    if dataset is not None and cfg.reward.custom_rm_path is None and cfg.reward.rm_type is not None:
        check_reward_rows(cfg.reward.rm_type, cfg.data.prompt_data, dataset)
    with _user_module(cfg, not_here):
        rollout_generate_function(cfg.rollout, args)
    with _user_module(cfg, not_here):
        load_filter(cfg.rollout.dynamic_sampling_filter_path, args, cfg.rollout.dynamic_sampling_filter_kwargs)
    critic_world = cfg.critic.world_size if cfg.critic else 0
    if cfg.plan.cluster is not None:  # --dry-run for another cluster: its GPUs, not this machine's
        nodes, gpus = cfg.plan.cluster.nodes, cfg.plan.cluster.gpus
        plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=nodes * gpus, critic_world=critic_world,
                              gpus_per_node=gpus)
    else:
        nodes, gpus = cluster_shape()
        plan = plan_placement(cfg.parallel, cfg.engine, cluster_gpus=nodes * gpus, cluster_cpus=os.cpu_count(),
                              critic_world=critic_world, gpus_per_node=gpus or None)
    if plan.use_gpu:
        assign_devices(plan, nodes, gpus)  # an engine that fits on no node fails here
    spanning = next((e for e in plan.engines if e.nodes > 1), None)
    if spanning is not None and cfg.fault.use_fault_tolerance:
        raise ConfigError(f"--use-fault-tolerance restarts a dead engine's one process; an engine over "
                          f"{spanning.nodes} nodes (--rollout-num-gpus-per-engine {spanning.num_gpus} on nodes of "
                          f"{spanning.gpus_per_node} GPUs) is not restarted (not built): drop --use-fault-tolerance, "
                          "or give engines of at most one node")
    if cfg.model.megatron_model_args:
        plan.notes.append(model_args_note(cfg))
    plan.notes.extend(f"not checked here (--cluster): {what}" for what in not_here)
    if cfg.plan.cluster is not None and not_here and cfg.data.num_epoch is not None:
        plan.notes.append(f"--num-epoch {cfg.data.num_epoch}: the number of steps is known once the data is read")
    return cfg, plan


def cluster_shape() -> tuple[int, int]:
    """(nodes, GPUs per node) a run here is planned for: the GPU nodes of the Ray cluster RAY_ADDRESS names
    (the launch scripts' `ray start`; joined now, before any actor starts), else this machine. (1, 0)
    without GPUs."""
    address = os.environ.get("RAY_ADDRESS")
    if not address:
        return 1, torch.cuda.device_count()
    from slime_rl.orchestration.nodes import alive_nodes, gpu_shape, join_cluster

    join_cluster(address)
    return gpu_shape(alive_nodes())


@contextlib.contextmanager
def _user_module(cfg: Config, not_here: list[str]) -> Iterator[None]:
    """Loading a user function: with --cluster, a module that is not on this machine's path at all (the
    user's own tree, there) is added to the plan's "not checked here" list instead of refusing the run; a
    module that is here but fails, or imports something missing, still refuses."""
    try:
        yield
    except Exception as exc:
        missing = absent_module(exc) if cfg.plan.cluster is not None else None
        if missing is None:
            raise
        not_here.append(f"{str(exc).split(': cannot import module', 1)[0]} (module {missing!r} is not importable "
                        "here; its functions load on the cluster)")


def model_args_note(cfg: Config) -> str:
    """The plan's line on slime's MODEL_ARGS (checked by check_model_args before)."""
    from slime_rl.config.flags_model import NO_EFFECT

    given = cfg.model.megatron_model_args
    unread = [f for f in given if f in NO_EFFECT]
    parts = [f"{len(given) - len(unread)} flags agree with {cfg.model.hf_checkpoint}'s config.json, from which the "
             "model is built"] if len(given) > len(unread) else []
    if unread:
        parts.append(f"{', '.join(unread)} accepted without effect here (docs/flags.md says why)")
    return "slime's MODEL_ARGS: " + "; ".join(parts)


def check_replay_files(cfg: Config) -> None:
    """--load-debug-rollout-data, before anything starts: step 0's file is read and checked against the
    flags (as each step's is when its rollout comes), and every step's file must exist. (With --load the
    first step is known once the checkpoint is read: each file is checked when its step comes.)"""
    debug, roll = cfg.debug, cfg.rollout
    read_debug_rollout(debug.load_rollout_path(0), 0, roll.rollout_batch_size, roll.n_samples_per_prompt,
                       cfg.trainer.use_rollout_routing_replay, cfg.reward.reward_key)
    missing = [k for k in range(roll.num_rollout) if not os.path.isfile(debug.load_rollout_path(k))]
    if missing:
        raise DataError(f"--load-debug-rollout-data {debug.load_rollout_data}: no file for step {missing[0]} "
                        f"({debug.load_rollout_path(missing[0])}); {len(missing)} of the {roll.num_rollout} steps' "
                        "files are missing (fewer --num-rollout?)")


def missing_here(cfg: Config) -> list[str]:
    """With --cluster, the prompt files that exist only on that cluster (not checked here, nor is a
    tokenizer missing from --hf-checkpoint: a folder holding only config.json plans too). Empty otherwise."""
    if cfg.plan.cluster is None:
        return []
    files = [("--prompt-data", cfg.data.prompt_data.split("@[", 1)[0])]
    files += [(f"--eval-prompt-data {name}", path) for name, path in cfg.eval.datasets]
    return [f"{flag} {path} (no such file here)" for flag, path in files if not os.path.isfile(path)]


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


def check_reward_rows(rm_type: str | None, where: object, dataset: PromptDataset) -> None:
    """What a built-in reward needs of all rows at once (its RewardSpec's `rows_check`; reasoning_gym:
    every row names a reasoning-gym task and has a label), checked now rather than as reward failures in
    the middle of step 0."""
    spec = REWARDS.get(rm_type) if rm_type is not None else None
    if spec is None or spec.rows_check is None:
        return
    try:
        spec.rows_check([r.metadata for r in dataset.rows], [r.label for r in dataset.rows])
    except ValueError as exc:
        raise DataError(f"{where} (--rm-type {rm_type}): {exc}") from exc


def check_model_features(cfg: Config) -> None:
    """The checkpoint's config.json against the flags: its model family first (one this trainer
    builds), then slime's MODEL_ARGS, then the flags that need (or do not work with) a
    vision-language or a mixture-of-experts checkpoint."""
    from slime_rl.config.families import NOT_BUILT
    from slime_rl.trainer.convert import FAMILIES, arch_from_hf_config, read_hf_config, with_mtp
    from slime_rl.trainer.convert.arch import check_dsa_stages

    try:
        hf = read_hf_config(cfg.model.hf_checkpoint)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"--hf-checkpoint: {exc}") from exc
    model_type = hf.get("model_type", "")
    if model_type not in FAMILIES:  # before any check that reads the model's features from its family
        named = f"model_type {model_type!r}" if model_type else "no model_type"
        raise ConfigError(f"--hf-checkpoint {cfg.model.hf_checkpoint}: its config.json names {named}, which is not "
                          f"a model family this trainer builds (supported: {', '.join(sorted(FAMILIES))})"
                          + (f": {NOT_BUILT[model_type]}" if model_type in NOT_BUILT else ""))
    if FAMILIES[model_type].dsa and cfg.engine.backend == "embedded":  # engines/embedded/server.py
        raise ConfigError(f"--rollout-backend embedded: --hf-checkpoint {cfg.model.hf_checkpoint} is model_type "
                          f"{model_type!r}, whose sparse attention (its indexer's key cache beside the key/value "
                          "cache) the built-in engine does not serve; use --rollout-backend sglang")
    if FAMILIES[model_type].gated_delta_net and cfg.engine.backend == "embedded":  # engines/embedded/server.py
        raise ConfigError(f"--rollout-backend embedded: --hf-checkpoint {cfg.model.hf_checkpoint} is model_type "
                          f"{model_type!r}, whose Gated DeltaNet (linear attention) layers the built-in engine does "
                          "not serve; use --rollout-backend sglang")
    try:  # every check a rank's model build makes of config.json, before any process starts
        arch = arch_from_hf_config(hf, where=f"{cfg.model.hf_checkpoint}/config.json")
    except ValueError as exc:
        raise ConfigError(f"--hf-checkpoint: {exc}") from exc
    try:
        cfg.parallel.stage_layers(arch.num_layers)
    except ValueError as exc:
        raise ConfigError(f"--pipeline-model-parallel-size {cfg.parallel.pipeline_model_parallel_size}: "
                          f"{cfg.model.hf_checkpoint}: {exc}") from exc
    if arch.dsa_indexer_layers:  # sparse attention (trainer/dsa.py): each pipeline stage starts on an indexer
        counts = cfg.parallel.stage_layers(arch.num_layers)
        try:
            check_dsa_stages(arch.dsa_indexer_layers, [sum(counts[:r]) for r in range(len(counts))])
        except ValueError as exc:
            raise ConfigError(f"--pipeline-model-parallel-size {cfg.parallel.pipeline_model_parallel_size}: "
                              f"{cfg.model.hf_checkpoint}: {exc}") from exc
        t = cfg.trainer
        if (not all(arch.dsa_indexer_layers) and cfg.parallel.pipeline_model_parallel_size > 1
                and t.recompute_granularity and not t.pack_sequences):
            # a shared layer's recomputed forward reads its source layer's choice from the micro-batch's
            # PackedSeqParams; padded micro-batches have none, and 1F1B runs a later micro-batch's forward between
            raise ConfigError(f"--no-pack-sequences with --recompute-granularity {t.recompute_granularity} and "
                              f"--pipeline-model-parallel-size {cfg.parallel.pipeline_model_parallel_size}: "
                              f"{model_type}'s layers that share an earlier layer's top-k keys (indexer_types "
                              "'shared') find it on the packed micro-batch only when recomputed under pipeline "
                              "parallelism; drop --no-pack-sequences (or the recompute)")
    check_model_args(cfg, hf, arch)
    try:  # --mtp-num-layers against the checkpoint's MTP layers (a sentence naming the flag and config.json's key)
        arch = with_mtp(arch, cfg.trainer.mtp_num_layers, where=f"{cfg.model.hf_checkpoint}/config.json")
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if arch.mtp_layers > (arch.mtp_built if cfg.trainer.enable_mtp_training else 0):
        import warnings

        from slime_rl.config.checks import ConfigNote

        key = "num_mtp_modules" if model_type == "minimax_m2" else "num_nextn_predict_layers"
        what = ("built and frozen (--mtp-num-layers without --enable-mtp-training): weight sync sends them as loaded"
                if arch.mtp_built else "not built (no --mtp-num-layers): weight sync leaves the engines' copy as "
                "loaded")
        warnings.warn(f"--hf-checkpoint {cfg.model.hf_checkpoint}: its {arch.mtp_layers} multi-token-prediction "
                      f"layer(s) ({key}; tensors model.layers.{arch.num_layers}.*) are not "
                      f"trained: {what} (an engine's MTP speculative decoding then drafts with the initial weights: "
                      "correct tokens, a lower acceptance rate as the policy moves)", ConfigNote, stacklevel=2)
    vision = arch.vision is not None  # a vision tower built (Qwen3.5: where config.json has a vision_config)
    if cfg.model.freeze_vision_tower and not vision:
        raise ConfigError(f"--freeze-vision-tower needs a vision-language checkpoint; --hf-checkpoint "
                          f"{cfg.model.hf_checkpoint} is model_type {model_type!r}")
    tp_cp = cfg.parallel.tensor_model_parallel_size * cfg.parallel.context_parallel_size
    if arch.linear_layers and arch.linear_num_key_heads % tp_cp:  # megatron's GatedDeltaNet splits key heads by both
        raise ConfigError(f"--tensor-model-parallel-size {cfg.parallel.tensor_model_parallel_size} x "
                          f"--context-parallel-size {cfg.parallel.context_parallel_size} = {tp_cp} must divide "
                          f"linear_num_key_heads {arch.linear_num_key_heads} of {cfg.model.hf_checkpoint}'s "
                          "config.json: each rank runs whole Gated DeltaNet key heads (their value heads with them)")
    if vision and cfg.parallel.context_parallel_size > 1:
        raise ConfigError(f"--context-parallel-size {cfg.parallel.context_parallel_size}: context parallelism "
                          f"is not supported for vision-language models ({model_type})")
    check_moe_features(cfg, model_type)
    check_lora(cfg, arch, model_type)
    if vision and cfg.critic is not None:
        raise ConfigError(f"--advantage-estimator {cfg.algo.advantage_estimator}: a critic for vision-language "
                          f"models ({model_type}) is not supported yet; use grpo, dapo, gspo, rloo or reinforce++")


def check_lora(cfg: Config, arch: Any, model_type: str) -> None:
    """--lora-*: a family the adapters cover, --lora-load a PEFT folder that agrees with the --lora-* flags
    given, targets that name linears of this model (trainer/convert/lora_targets.py)."""
    import warnings

    from slime_rl.config.checks import ConfigNote
    from slime_rl.trainer.convert import FAMILIES
    from slime_rl.trainer.convert import lora_targets as lt

    m = cfg.model
    if not (m.lora_rank or m.lora_load):
        if m.lora_sync != "merged":
            raise ConfigError(f"--lora-sync {m.lora_sync}: there are no adapters to send without --lora-rank or "
                              "--lora-load")
        return
    family = FAMILIES[model_type]
    if family.mla or family.vision or family.gated_delta_net:
        what = ("multi-latent attention" if family.mla else "vision-language models" if family.vision
                else "Gated DeltaNet (linear attention) models")
        raise ConfigError(f"--lora-rank: LoRA on {what} ({model_type}) is not built yet; train it whole "
                          "(drop the --lora-* flags)")
    targets = tuple(m.lora_target_modules)
    if m.lora_load:
        if not os.path.isdir(m.lora_load):
            if cfg.plan.cluster is not None and m.lora_sync == "merged":
                return  # a path on the cluster's nodes: checked when the ranks start
            raise ConfigError(f"--lora-load {m.lora_load}: no such folder")
        try:
            spec = lt.spec_of_folder(m.lora_load)
        except (ValueError, KeyError, OSError) as exc:
            raise ConfigError(str(exc) if str(exc).startswith("--lora-load") else f"--lora-load {m.lora_load}: "
                              f"{exc}") from exc
        for flag, given, saved in (("--lora-rank", m.lora_rank or None, spec.rank),
                                   ("--lora-alpha", m.lora_alpha, spec.alpha),
                                   ("--lora-dropout", m.lora_dropout or None, spec.dropout)):
            if given is not None and given != saved:
                raise ConfigError(f"{flag} {given} disagrees with --lora-load {m.lora_load} "
                                  f"({lt.PEFT_CONFIG}: {saved}); drop the flag or give the folder's value")
        if targets != (lt.ALL_LINEAR,) and set(targets) != set(spec.targets):
            raise ConfigError(f"--lora-target-modules {','.join(targets)} disagrees with --lora-load "
                              f"{m.lora_load}, whose tensors adapt {','.join(spec.targets)}")
        targets = spec.targets
    maps = [pm for i in range(arch.num_layers) for pm in arch.layer_maps(i)]
    try:
        chosen = lt.choose(maps, targets)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    if m.lora_sync == "adapter":
        adapted = {lt.short_name(h) for pm in maps if pm.mcore in chosen
                   for h, on in zip(pm.hf, chosen[pm.mcore], strict=True) if on}
        check_lora_adapter_sync(cfg, adapted, bool(arch.num_experts))
    if arch.num_experts and lt.ALL_LINEAR in targets:
        warnings.warn("--lora-target-modules all-linear on a mixture-of-experts model adapts the attention and any "
                      "shared or dense MLP; the routers and the routed experts train neither (LoRA on routed "
                      "experts is not built)", ConfigNote, stacklevel=2)


ATTENTION_LINEARS = frozenset({"q_proj", "k_proj", "v_proj", "o_proj"})


def check_lora_adapter_sync(cfg: Config, adapted: set[str], moe: bool) -> None:
    """--lora-sync adapter: what the engines can take as adapters. SGLang 0.5.23 stacks a layer's q/k/v
    adapters into its fused qkv_proj from q_proj's and v_proj's (k_proj may be missing: zeros), and gate/up
    into gate_up_proj from gate_proj's (srt/lora/lora.py normalize_qkv_proj, normalize_gate_up_proj); its
    LoRA on MoE models' shared experts is not checked here (tests/contract/test_sglang_lora_adapter.py covers
    dense layers and attention)."""
    flag = "--lora-sync adapter"
    if cfg.fault.use_fault_tolerance:
        raise ConfigError(f"{flag} with --use-fault-tolerance: a restarted engine would serve the base without "
                          "the adapters until the next sync; use --lora-sync merged (the default)")
    if cfg.engine.backend != "sglang":
        return  # the built-in engine merges any adapted linear into its weights
    qkv = adapted & {"q_proj", "k_proj", "v_proj"}
    if qkv and not {"q_proj", "v_proj"} <= adapted:
        raise ConfigError(f"{flag}: SGLang builds a layer's q/k/v adapter from q_proj's and v_proj's, and this run "
                          f"adapts {', '.join(sorted(qkv))} only; add q_proj and v_proj to --lora-target-modules, "
                          "or use --lora-sync merged")
    if "up_proj" in adapted and "gate_proj" not in adapted:
        raise ConfigError(f"{flag}: SGLang builds a layer's gate/up adapter from gate_proj's, and this run adapts "
                          "up_proj without it; add gate_proj to --lora-target-modules, or use --lora-sync merged")
    if moe and adapted - ATTENTION_LINEARS:
        raise ConfigError(f"{flag} on a mixture-of-experts model: SGLang's LoRA on its shared or dense MLPs "
                          f"({', '.join(sorted(adapted - ATTENTION_LINEARS))}) is not checked here; adapt the "
                          "attention only (--lora-target-modules q_proj,k_proj,v_proj,o_proj), or use --lora-sync "
                          "merged")


def check_model_args(cfg: Config, hf: dict, arch: Any) -> None:
    """slime's MODEL_ARGS (Megatron-LM's model flags, as given) against the model the trainer builds
    from config.json (`arch`): each flag that describes another model is named with both values and the
    config.json key (trainer/convert/model_args.py says what is compared)."""
    given = cfg.model.megatron_model_args
    if not given:
        return
    from slime_rl.trainer.convert.model_args import model_args_error

    error = model_args_error(given, hf, arch, cfg.model.hf_checkpoint)
    if error:
        raise ConfigError(error)


def check_checkpoints(cfg: Config) -> None:
    """--load / --ckpt-step name a checkpoint that is there and complete (or nothing yet: a fresh start),
    and --save holds no checkpoint this run would overwrite: another run's, or later ones than the one
    resumed (trainer/checkpoint_layout.py says how each is decided)."""
    from slime_rl.trainer.checkpoint_layout import (
        MARKER_FILE,
        CheckpointChoiceError,
        check_save_folder,
        choose_checkpoint,
        later_checkpoints,
        marker_step,
    )

    ckpt = cfg.checkpoint
    try:
        resume_from = choose_checkpoint(ckpt.load, ckpt.ckpt_step)
        if cfg.dry_run:  # a plan writes nothing
            return
        check_save_folder(ckpt.save, resume_from)
        critic_save = cfg.critic.save if cfg.critic is not None else None
        if critic_save:  # PPO's critic saves beside the policy, step for step: the same rule
            step = marker_step(resume_from) if resume_from and (resume_from / MARKER_FILE).is_file() else None
            later = later_checkpoints(critic_save, step)
            if later:
                after = "" if step is None else f" after step {step}"
                names = ", ".join(p.name for p in later)
                raise CheckpointChoiceError(
                    f"--critic-save {critic_save} already holds checkpoints{after} ({names}) that this run would "
                    "write over; give it another folder, or move them away yourself")
    except CheckpointChoiceError as exc:
        raise ConfigError(str(exc)) from None


def check_ref_load(cfg: Config) -> None:
    """--ref-load and --opd-teacher-load, before any rank starts: a Megatron checkpoint (its tensors are checked
    against the model when a rank loads it) or an HF folder whose config.json describes the --hf-checkpoint's
    model (same tensors; a different rope base or norm eps would make it another model)."""
    def here(path: str | None) -> bool:  # planned for another cluster, a folder that is only there is not checked
        return path is not None and (cfg.plan.cluster is None or os.path.exists(path))

    if here(cfg.model.ref_load) and cfg.algo.use_reference:
        check_same_model(cfg, cfg.model.ref_load, "--ref-load", "the reference")
    if here(cfg.model.opd_teacher_load) and cfg.algo.use_opd:
        check_same_model(cfg, cfg.model.opd_teacher_load, "--opd-teacher-load",
                         "the teacher (--use-opd --opd-type megatron)")


def check_same_model(cfg: Config, path: str, flag: str, what: str) -> None:
    """`path` holds weights of the --hf-checkpoint's architecture (a Megatron checkpoint, checked when loaded)."""
    from slime_rl.trainer.checkpoint_layout import is_megatron_checkpoint
    from slime_rl.trainer.convert import load_arch

    if is_megatron_checkpoint(path):
        return
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"{flag} {path}: neither a Megatron checkpoint (latest_checkpointed_iteration.txt, "
                          "iter_*/ or metadata.json) nor an HF folder (config.json + safetensors)")
    try:
        ref, policy = load_arch(path), load_arch(cfg.model.hf_checkpoint)
    except (ValueError, FileNotFoundError) as exc:
        raise ConfigError(f"{flag} {path}: {exc}") from exc
    differ = [f"{f.name} {getattr(ref, f.name)} vs {getattr(policy, f.name)}" for f in dataclasses.fields(ref)
              if f.name != "max_position_embeddings" and getattr(ref, f.name) != getattr(policy, f.name)]
    if differ:
        raise ConfigError(f"{flag} {path}: another model than --hf-checkpoint {cfg.model.hf_checkpoint} "
                          f"({'; '.join(differ)}); {what} must have the policy's architecture")


def check_moe_features(cfg: Config, model_type: str) -> None:
    """The mixture-of-experts flags against the checkpoint: expert parallelism needs experts, and as
    many of them per layer as a multiple of --expert-model-parallel-size."""
    from slime_rl.trainer.convert import FAMILIES, load_arch

    moe = model_type in FAMILIES and FAMILIES[model_type].moe
    ep = cfg.parallel.expert_model_parallel_size
    # R3 (the engines' routing) or R2 alone (the old-log-prob forward's routing; R3 implies R2)
    replay = cfg.trainer.use_rollout_routing_replay or cfg.trainer.use_routing_replay
    flag = "--use-rollout-routing-replay" if cfg.trainer.use_rollout_routing_replay else "--use-routing-replay"
    what = "the engines'" if cfg.trainer.use_rollout_routing_replay else "the recorded"
    if replay and not moe:
        raise ConfigError(f"{flag}: --hf-checkpoint {cfg.model.hf_checkpoint} is a dense "
                          f"model ({model_type!r}), without experts to route")
    if replay and cfg.parallel.context_parallel_size > 1:
        raise ConfigError(f"{flag} with --context-parallel-size "
                          f"{cfg.parallel.context_parallel_size}: {what} routing does not follow the CP split "
                          "of the sequence yet")
    if replay and cfg.trainer.recompute_granularity:
        raise ConfigError(f"{flag} with --recompute-granularity "
                          f"{cfg.trainer.recompute_granularity}: the recomputed forward would route on its own")
    if not moe:
        # --expert-tensor-parallel-size alone changes nothing without experts (Megatron ignores it too, and
        # slime's dense scripts pass --expert-tensor-parallel-size 1 with any TP)
        if ep > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep}: --hf-checkpoint {cfg.model.hf_checkpoint} is a "
                              f"dense model ({model_type!r}), without experts")
        return
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
    etp = cfg.parallel.expert_tensor_parallel_size or cfg.parallel.tensor_model_parallel_size
    if cfg.trainer.moe_token_dispatcher_type == "allgather" and ep * etp > 1:
        # its all-gather needs equal token counts over the EP x expert-TP ranks (trainer/equal_tokens.py)
        if cfg.parallel.context_parallel_size > 1:
            raise ConfigError(f"--moe-token-dispatcher-type allgather with --context-parallel-size "
                              f"{cfg.parallel.context_parallel_size}: not supported; use alltoall")
        if not cfg.trainer.pack_sequences:
            raise ConfigError("--moe-token-dispatcher-type allgather with --no-pack-sequences and expert (or tensor) "
                              "parallelism: right-padded micro-batches may hold different sample counts on the "
                              "ranks the dispatcher gathers over; pack the sequences or use alltoall")


def reward_fn(reward: RewardConfig):
    """The reward function the flags name (checked now: errors name the flag)."""
    return reward_fn_from_config(reward)
