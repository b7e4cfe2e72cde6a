"""EasyR1's `worker` sections (`actor` with `ref`, `critic`, `rollout`, `reward`) as our flags, one
function per section over an `EasyR1Context` (config/easyr1_context.py); the order they run in is
config/easyr1.py's SECTION_MAPPERS."""

from __future__ import annotations

import json
from typing import Any

from slime_rl.config.easyr1_context import EasyR1Context

_FSDP = "FSDP sharding; training runs in Megatron-core (--tensor-model-parallel-size, --pipeline-model-parallel-size)"
_OFFLOAD = "FSDP CPU offload of parameters / optimizer state"
_VLLM = "a vLLM engine setting; the engines here are SGLang or the built-in one"


def map_actor(ctx: EasyR1Context) -> None:
    """`worker.actor.*` (and `worker.hybrid_engine`, the strategies and FSDP / offload keys of actor, ref
    and critic, the rest of `worker.ref`): batch sizes, clipping, loss, model and optimizer."""
    m, get, fail, rule, to, na, only = ctx.m, ctx.get, ctx.fail, ctx.rule, ctx.to, ctx.na, ctx.only
    given, n = ctx.given, ctx.n
    for section in ("worker.actor", "worker.ref", "worker.critic"):
        na(f"{section}.strategy", "training runs in Megatron-core")
    gbs_prompts = int(get("worker.actor.global_batch_size"))
    to("worker.actor.global_batch_size", "global_batch_size", lambda v: int(v) * n)
    m_gbs = "global_batch_size"
    if m_gbs in m.flags:
        m.lines[-1] += f"  (EasyR1 counts prompts: {gbs_prompts} x worker.rollout.n {n})"
    to("worker.actor.micro_batch_size_per_device_for_update", "micro_batch_size", int)
    na("worker.actor.micro_batch_size_per_device_for_experience", "forward-only log-prob passes use "
       "--micro-batch-size (or --max-tokens-per-gpu)")
    to("worker.actor.max_grad_norm", "clip_grad", float)
    to("worker.actor.clip_ratio_low", "eps_clip", float)
    to("worker.actor.clip_ratio_high", "eps_clip_high", float)
    loss_type = str(ctx.get("worker.actor.loss_type", "default"))
    if loss_type in ("default", "gspo", "gspo_token"):  # EasyR1 caps these three losses with the dual clip
        to("worker.actor.clip_ratio_dual", "eps_clip_c", float)
    else:  # cispo and sapo take no PPO minimum for it to cap
        na("worker.actor.clip_ratio_dual", f"the dual clip caps PPO's minimum; loss_type {loss_type} has none")
    if loss_type == "sapo":
        to("worker.actor.tau_positive", "sapo_tau_pos", float)
        to("worker.actor.tau_negative", "sapo_tau_neg", float)
    else:
        na("worker.actor.tau_positive", "SAPO's gate temperature (loss_type sapo only)")
        na("worker.actor.tau_negative", "SAPO's gate temperature (loss_type sapo only)")

    def loss_avg(v: Any) -> None:
        modes = {"token": "token-mean", "seq": "seq-mean-token-mean"}
        if v not in modes:
            fail("worker.actor.loss_avg_mode", f"{v!r}: expected token or seq")
        m.set("worker.actor.loss_avg_mode", "loss_agg_mode", modes[v],
              "" if "worker.actor.loss_avg_mode" in given else "EasyR1's default")
    rule("worker.actor.loss_avg_mode", loss_avg)
    only("worker.actor.ppo_epochs", lambda v: int(v) == 1, "one pass per rollout", "more than one pass over a "
         "rollout's samples is not supported")

    def padding_free(v: Any) -> None:
        if v:
            m.na("worker.actor.padding_free", "packed (THD) sequences, the default")
        else:
            m.set("worker.actor.padding_free", "pack_sequences", False)
    rule("worker.actor.padding_free", padding_free)
    na("worker.actor.dynamic_batching", "micro-batch sizing, performance only (--use-dynamic-batch-size "
       "--max-tokens-per-gpu)")
    na("worker.actor.ulysses_size", "FSDP's Ulysses sequence parallelism; Megatron's is --context-parallel-size")
    na("worker.actor.use_torch_compile", "torch.compile of FSDP modules")
    na("worker.actor.tau_positive", "SAPO's temperature (loss_type sapo, not supported)")
    na("worker.actor.tau_negative", "SAPO's temperature (loss_type sapo, not supported)")
    to("worker.actor.model.model_path", "hf_checkpoint", str)
    only("worker.actor.model.tokenizer_path",
         lambda v: v is None or str(v) == str(get("worker.actor.model.model_path")), "the model's own",
         "a tokenizer other than the checkpoint's is not supported (--hf-checkpoint holds both)")
    only("worker.actor.model.override_config", lambda v: not v, "empty", "overriding the model config is not "
         "supported; edit the checkpoint's config.json")
    na("worker.actor.model.enable_gradient_checkpointing", "memory only (Megatron's --recompute-granularity)")
    na("worker.actor.model.trust_remote_code", "models are built from known architectures")
    to("worker.actor.model.freeze_vision_tower", "freeze_vision_tower", bool)

    lora_on = int(get("worker.actor.model.lora.rank") or 0) > 0

    def lora_rank(v: Any) -> None:
        if int(v or 0) > 0:
            m.set("worker.actor.model.lora.rank", "lora_rank", int(v), "")
        else:
            m.na("worker.actor.model.lora.rank", "0: LoRA off")
    rule("worker.actor.model.lora.rank", lora_rank)
    if lora_on:  # EasyR1's LoraConfig: alpha 16, target_modules "all-linear" or a comma-separated list
        if get("worker.actor.model.lora.alpha") is None:
            m.set("worker.actor.model.lora.alpha", "lora_alpha", 16.0, "EasyR1's default")
        to("worker.actor.model.lora.alpha", "lora_alpha", float)
        to("worker.actor.model.lora.target_modules", "lora_target_modules",
           lambda v: [v] if isinstance(v, str) else list(v))
        only("worker.actor.model.lora.exclude_modules", _excludes_no_decoder_linear,
             "a pattern of vision-tower modules (the adapters are on the decoder's linears only)",
             "it would exclude decoder linears, which PEFT's exclude_modules is not taken for here: name the "
             "linears to adapt in target_modules")
    else:
        for k in ("alpha", "target_modules", "exclude_modules"):
            na(f"worker.actor.model.lora.{k}", "LoRA is off (rank 0)")
    to("worker.actor.optim.lr", "lr", float)

    def betas(v: Any) -> None:
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            fail("worker.actor.optim.betas", f"{v!r}: expected [beta1, beta2]")
        note = "" if "worker.actor.optim.betas" in given else "EasyR1's default"
        m.set("worker.actor.optim.betas", "adam_beta1", float(v[0]), note)
        m.set("worker.actor.optim.betas", "adam_beta2", float(v[1]), note)
    rule("worker.actor.optim.betas", betas)
    to("worker.actor.optim.weight_decay", "weight_decay", float)

    def strategy(v: Any) -> None:
        if v not in ("adamw", "adamw_bf16"):
            fail("worker.actor.optim.strategy", f"{v!r}: expected adamw or adamw_bf16")
        m.set("worker.actor.optim.strategy", "optimizer", "adam",
              "Megatron's Adam is AdamW (decoupled weight decay)" + ("; fp32 states, not bf16" if v != "adamw" else ""))
    rule("worker.actor.optim.strategy", strategy)
    steps_per_rollout = max(1, int(get("data.rollout_batch_size")) // max(1, gbs_prompts))

    def warmup(_: Any) -> None:
        steps, ratio = get("worker.actor.optim.lr_warmup_steps"), get("worker.actor.optim.lr_warmup_ratio")
        if steps is not None:
            m.set("worker.actor.optim.lr_warmup_steps", "lr_warmup_iters", int(steps) * steps_per_rollout,
                  f"{steps} rollout steps x {steps_per_rollout} optimizer steps each")
            if "worker.actor.optim.lr_warmup_ratio" in given:
                m.na("worker.actor.optim.lr_warmup_ratio", "lr_warmup_steps wins")
        elif ratio is not None and float(ratio) == 0:
            m.na("worker.actor.optim.lr_warmup_ratio", "0: no warm-up")
        elif ratio is not None:
            m.set("worker.actor.optim.lr_warmup_ratio", "lr_warmup_fraction", float(ratio),
                  "of all optimizer steps")
    rule("worker.actor.optim.lr_warmup_ratio", warmup)
    if "worker.actor.optim.lr_warmup_ratio" not in ctx.cfg:
        rule("worker.actor.optim.lr_warmup_steps", warmup)
    ctx.handled.add("worker.actor.optim.lr_warmup_steps")

    def min_lr(v: Any) -> None:
        if v is None:
            m.na("worker.actor.optim.min_lr_ratio", "unset")
        else:
            m.set("worker.actor.optim.min_lr_ratio", "min_lr", float(v) * float(get("worker.actor.optim.lr")),
                  f"{v} x lr")
    rule("worker.actor.optim.min_lr_ratio", min_lr)

    def scheduler(v: Any) -> None:
        if v not in ("constant", "cosine"):
            fail("worker.actor.optim.lr_scheduler_type", f"{v!r}: expected constant or cosine")
        m.set("worker.actor.optim.lr_scheduler_type", "lr_decay_style", v)
    rule("worker.actor.optim.lr_scheduler_type", scheduler)
    na("worker.actor.optim.training_steps", "computed")
    for section in ("worker.actor", "worker.ref", "worker.critic"):
        for k in [k for k in given if k.startswith(f"{section}.fsdp.")]:
            na(k, _FSDP)
        for k in [k for k in given if k.startswith(f"{section}.offload.")]:
            na(k, _OFFLOAD)
    for k in [k for k in given if k.startswith("worker.ref.") and k not in ctx.handled]:
        na(k, "the reference model is the initial policy in the trainer's own layout")


def map_critic(ctx: EasyR1Context) -> None:
    """`worker.critic.*`: PPO's critic (adv_estimator gae); not applicable with any other estimator."""
    get, to, na, only = ctx.get, ctx.to, ctx.na, ctx.only
    for k in [k for k in ctx.given if k.startswith("worker.critic.") and k not in ctx.handled]:
        if not ctx.critic:
            na(k, f"no critic for adv_estimator {ctx.estimator}")
        elif k == "worker.critic.optim.lr":
            to(k, "critic_lr", float)
        elif k == "worker.critic.cliprange_value":
            to(k, "value_clip", float)
        elif k == "worker.critic.model.model_path":
            only(k, lambda v: v is None or str(v) == str(get("worker.actor.model.model_path")), "the actor's",
                 "a critic from another checkpoint is not supported: the critic starts from --hf-checkpoint")
        else:
            na(k, "the critic uses the policy's layout and batches")


def map_rollout(ctx: EasyR1Context) -> None:
    """`worker.rollout.*`: the engine, sampling, engine sizes and the validation sampling overrides."""
    m, fail, rule, to, na, only = ctx.m, ctx.fail, ctx.rule, ctx.to, ctx.na, ctx.only
    backend = ctx.backend

    def engine_name(v: Any) -> None:
        if backend == "sglang":
            m.set("worker.rollout.name", "rollout_backend", "sglang", f"for EasyR1's {v}")
        else:
            m.na("worker.rollout.name", f"{v}: --rollout-backend {backend} from the command line")
    rule("worker.rollout.name", engine_name)
    if "worker.rollout.name" not in ctx.given and backend == "sglang":
        m.set("worker.rollout.name", "rollout_backend", "sglang", "for EasyR1's vLLM")
    to("worker.rollout.n", "n_samples_per_prompt", int)
    to("worker.rollout.temperature", "rollout_temperature", float)
    to("worker.rollout.top_p", "rollout_top_p", float)
    to("worker.rollout.top_k", "rollout_top_k", int)
    na("worker.rollout.seed", "vLLM's engine seed; per-request seeds: --deterministic-rollout with --rollout-seed")
    na("worker.rollout.limit_images", "vLLM's limit_mm_per_prompt")
    na("worker.rollout.dtype", "the engines run the checkpoint's dtype")

    def memory(v: Any) -> None:
        if backend == "sglang":
            m.set("worker.rollout.gpu_memory_utilization", "sglang_mem_fraction_static", float(v))
        else:
            m.na("worker.rollout.gpu_memory_utilization", f"--rollout-backend {backend} has no memory pool setting")
    rule("worker.rollout.gpu_memory_utilization", memory)
    only("worker.rollout.ignore_eos", lambda v: not v, "false", "true is not supported (responses stop at EOS)")
    na("worker.rollout.enforce_eager", _VLLM + " (CUDA graphs; SGLang's is --sglang-disable-cuda-graph)")
    na("worker.rollout.enable_chunked_prefill", _VLLM)
    na("worker.rollout.max_num_batched_tokens", _VLLM)
    na("worker.rollout.disable_log_stats", _VLLM)
    na("worker.rollout.disable_tqdm", "progress bars")
    to("worker.rollout.tensor_parallel_size", "rollout_num_gpus_per_engine", int)
    to("worker.rollout.max_model_len", "rollout_max_context_len", int)

    def val_override(v: Any) -> None:
        known = {"temperature": ("eval_temperature", float), "top_p": ("eval_top_p", float),
                 "n": ("n_samples_per_eval_prompt", int), "max_tokens": ("eval_max_response_len", int)}
        for k, value in (v or {}).items():
            if k not in known:
                fail(f"worker.rollout.val_override_config.{k}", f"no counterpart (supported: {', '.join(known)})")
            flag, convert = known[k]
            m.set(f"worker.rollout.val_override_config.{k}", flag, convert(value))
        if not v:
            m.na("worker.rollout.val_override_config", "empty")
    rule("worker.rollout.val_override_config", val_override)


def map_reward(ctx: EasyR1Context) -> None:
    """`worker.reward.*`: the reward function file and its keyword arguments."""
    m, rule, na, only = ctx.m, ctx.rule, ctx.na, ctx.only

    def reward_function(v: Any) -> None:
        text = str(v)
        path = text if ":" in text else f"{text}:main"  # EasyR1: a file without ':' names `main`
        m.set("worker.reward.reward_function", "custom_rm_path", path)
    rule("worker.reward.reward_function", reward_function)

    def reward_kwargs(v: Any) -> None:
        if v:
            m.set("worker.reward.reward_function_kwargs", "custom_rm_kwargs", json.dumps(v))
        else:
            m.na("worker.reward.reward_function_kwargs", "empty")
    rule("worker.reward.reward_function_kwargs", reward_kwargs)
    only("worker.reward.skip_special_tokens", bool, "responses are decoded without special tokens",
         "false is not supported: responses are decoded without special tokens")
    na("worker.reward.num_cpus", "rewards run in the rollout's thread pool")


# decoder linears' module names as PEFT sees them (text and vision-language layouts)
_DECODER_LINEARS = tuple(f"{p}layers.0.{m}" for p in ("model.", "model.language_model.")
                         for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"))


def _excludes_no_decoder_linear(v: Any) -> bool:
    """EasyR1's exclude_modules (PEFT's: one regex matched whole, or a list of name suffixes) leaves every decoder
    linear adapted (e.g. geo3k's `.*visual.*`): the adapters here never go on the vision tower anyway."""
    import re

    if not v:
        return True
    if isinstance(v, str):
        return not any(re.fullmatch(v, name) for name in _DECODER_LINEARS)
    return not any(name == x or name.endswith(f".{x}") for x in v for name in _DECODER_LINEARS)
