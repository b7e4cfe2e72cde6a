"""EasyR1's nested config (`data` / `algorithm` / `worker.actor|rollout|ref|critic|reward` /
`trainer`, verl/trainer/config.py and verl/workers/*/config.py) as our flags.

`--config FILE` whose top level holds those sections is read here: every key becomes our flag(s)
(`map_easyr1`), or is listed as not applicable with the reason (FSDP, offload, vLLM internals), or
is an error naming it when it would change training in a way this project cannot do (LoRA rank > 0,
an adaptive KL controller, EasyR1's remax estimator, ...). Keys EasyR1 gives a default and the file
leaves out are mapped with EasyR1's default when the default changes training (`EASYR1_DEFAULTS`),
so the run does what the same file does in EasyR1. The mapping is printed (`describe`), one line per
key. The command line still wins over the file.

Counting differences: EasyR1's `worker.actor.global_batch_size` counts prompts, ours samples (x
`worker.rollout.n`); its `lr_warmup_steps` count rollout steps, our `--lr-warmup-iters` optimizer
steps (x rollout_batch_size / global_batch_size). EasyR1 places actor and rollout on the same GPUs
(hybrid engine); here the engines get `nnodes x n_gpus_per_node` devices of their own.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from slime_rl.config.estimators import estimator_spec

SECTIONS = ("data", "algorithm", "worker", "trainer")
# dict-valued keys: a value, not a section to walk into
DICT_KEYS = ("worker.actor.model.override_config", "worker.critic.model.override_config",
             "worker.rollout.val_override_config", "worker.reward.reward_function_kwargs")

# EasyR1's defaults that change training, for keys a file leaves out (verl/trainer/config.py,
# verl/workers/actor/config.py, verl/workers/rollout/config.py of EasyR1)
EASYR1_DEFAULTS: dict[str, Any] = {
    "data.prompt_key": "prompt", "data.answer_key": "answer", "data.image_key": "images",
    "data.max_prompt_length": 512, "data.max_response_length": 512, "data.rollout_batch_size": 512,
    "data.shuffle": True, "data.seed": 1, "data.min_pixels": 262144, "data.max_pixels": 4194304,
    "algorithm.gamma": 1.0, "algorithm.lam": 1.0, "algorithm.adv_estimator": "grpo", "algorithm.disable_kl": False,
    "algorithm.use_kl_loss": False, "algorithm.kl_penalty": "kl", "algorithm.kl_coef": 1e-3,
    "worker.actor.global_batch_size": 256, "worker.actor.micro_batch_size_per_device_for_update": 4,
    "worker.actor.max_grad_norm": 1.0, "worker.actor.clip_ratio_low": 0.2, "worker.actor.clip_ratio_high": 0.3,
    "worker.actor.clip_ratio_dual": 3.0, "worker.actor.loss_avg_mode": "token",
    "worker.actor.optim.lr": 1e-6, "worker.actor.optim.betas": [0.9, 0.999], "worker.actor.optim.weight_decay": 1e-2,
    "worker.rollout.n": 1, "worker.rollout.temperature": 1.0, "worker.rollout.top_p": 1.0,
    "worker.rollout.top_k": -1, "trainer.total_epochs": 15,
}

_FSDP = "FSDP sharding; training runs in Megatron-core (--tensor-model-parallel-size, --pipeline-model-parallel-size)"
_OFFLOAD = "FSDP CPU offload of parameters / optimizer state"
_VLLM = "a vLLM engine setting; the engines here are SGLang or the built-in one"
_ESTIMATORS = {"grpo": "grpo", "gae": "ppo", "reinforce_plus_plus": "reinforce_plus_plus", "rloo": "rloo"}
_KL_TYPES = {"kl": "k1", "mse": "k2", "low_var_kl": "low_var_kl"}  # EasyR1's kl_penalty -> --kl-loss-type
_LOGGERS = {"wandb": "use_wandb", "swanlab": "use_swanlab", "tensorboard": "use_tensorboard"}


@dataclass
class Mapping:
    """The result: flag keys (YAML spelling) -> values, and one report line per EasyR1 key."""

    flags: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)  # flag key -> the EasyR1 key it came from
    lines: list[str] = field(default_factory=list)

    def set(self, key: str, flag: str, value: Any, note: str = "") -> None:
        self.flags[flag] = value
        self.origin[flag] = key
        shown = json.dumps(value) if isinstance(value, (dict, list)) else value
        self.lines.append(f"  {key} -> --{flag.replace('_', '-')} {shown}{f'  ({note})' if note else ''}")

    def na(self, key: str, reason: str) -> None:
        self.lines.append(f"  {key}: not applicable ({reason})")


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"worker": {"actor": {"optim": {"lr": 1}}}} -> {"worker.actor.optim.lr": 1} (DICT_KEYS stay whole)."""
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and key not in DICT_KEYS:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def is_easyr1(data: dict[str, Any]) -> bool:
    """Whether a --config mapping is EasyR1's nested layout (a section holding a mapping)."""
    return any(isinstance(data.get(s), dict) for s in SECTIONS)


def map_easyr1(data: dict[str, Any], where: str, error: type[Exception], backend: str | None = None) -> Mapping:
    """EasyR1's nested config -> our flags (see the module docstring). `where`: how errors name the
    file; `backend`: --rollout-backend from the command line (default: sglang, EasyR1's vLLM's
    counterpart)."""
    unknown_top = sorted(str(k) for k in data if k not in SECTIONS)
    if unknown_top:
        raise error(f"{where}: EasyR1 layout, unknown section(s) {unknown_top} (expected {', '.join(SECTIONS)})")
    given = flatten(data)
    cfg = {**EASYR1_DEFAULTS, **given}
    m = Mapping()

    def fail(key: str, why: str) -> None:
        raise error(f"{where}: {key}: {why}")

    def get(key: str, default: Any = None) -> Any:
        value = cfg.get(key, default)
        return default if value is None else value

    n = int(get("worker.rollout.n"))
    estimator = str(get("algorithm.adv_estimator"))
    critic = estimator == "gae"
    backend = backend or "sglang"
    save_freq = int(get("trainer.save_freq", -1))
    save_path = get("trainer.save_checkpoint_path") or f"checkpoints/{get('trainer.project_name', 'easy_r1')}/" \
                                                       f"{get('trainer.experiment_name', 'demo')}"
    handled: set[str] = set()

    def rule(key: str, fn: Callable[[Any], None]) -> None:
        handled.add(key)
        if key in cfg:
            fn(cfg[key])

    def to(key: str, flag: str, convert: Callable[[Any], Any] = lambda v: v, na_if_none: bool = True) -> None:
        def apply(v: Any) -> None:
            if v is None and na_if_none:
                m.na(key, "unset")
            else:
                m.set(key, flag, convert(v), "EasyR1's default" if key not in given else "")
        rule(key, apply)

    def na(key: str, reason: str) -> None:
        def apply(_: Any) -> None:
            if key in given:
                m.na(key, reason)
        rule(key, apply)

    def only(key: str, ok: Callable[[Any], bool], reason: str, why_not: str) -> None:
        """Not applicable when `ok(value)`, else an error."""
        def apply(v: Any) -> None:
            if not ok(v):
                fail(key, why_not)
            if key in given:
                m.na(key, reason)
        rule(key, apply)

    # ---- data
    def train_files(v: Any) -> None:
        text = str(v)
        if "@" in text and not text.split("@", 1)[1].startswith("["):
            fail("data.train_files", f"{text!r} names a Hub dataset split (<name>@<split>); give a local jsonl / json "
                 "/ parquet file")
        m.set("data.train_files", "prompt_data", text)
    rule("data.train_files", train_files)

    def val_files(v: Any) -> None:
        if not v:
            m.na("data.val_files", "unset")
        elif int(get("trainer.val_freq", -1)) <= 0:
            m.na("data.val_files", "trainer.val_freq is -1: no validation")
        else:
            text = str(v)
            if "@" in text and not text.split("@", 1)[1].startswith("["):
                fail("data.val_files", f"{text!r} names a Hub dataset split; give a local file")
            m.set("data.val_files", "eval_prompt_data", ["val", text])
    rule("data.val_files", val_files)
    m.set("data (EasyR1 always applies the chat template)", "apply_chat_template", True)
    to("data.prompt_key", "input_key")
    to("data.answer_key", "label_key")
    to("data.image_key", "image_key")
    na("data.video_key", "videos are not supported: only --image-key is read from a row")
    na("data.video_fps", "videos are not supported")
    only("data.image_dir", lambda v: v is None, "unset", "no counterpart: image paths are read relative to the data "
         "file's folder (or absolute); make the paths in the rows so")
    to("data.max_prompt_length", "rollout_max_prompt_len")
    to("data.max_response_length", "rollout_max_response_len")
    to("data.rollout_batch_size", "rollout_batch_size")
    to("data.mini_rollout_batch_size", "over_sampling_batch_size")
    na("data.val_batch_size", "eval requests are batched by the engines (--sglang-server-concurrency)")
    to("data.format_prompt", "format_prompt")
    only("data.override_chat_template", lambda v: v is None, "unset", "no counterpart: the checkpoint's chat template "
         "is used (edit chat_template in its tokenizer_config.json)")
    to("data.shuffle", "rollout_shuffle", bool)
    to("data.seed", "rollout_seed", int)
    to("data.min_pixels", "min_pixels", int)
    to("data.max_pixels", "max_pixels", int)
    na("data.filter_overlong_prompts", "prompts longer than --rollout-max-prompt-len are always dropped")
    na("data.filter_overlong_prompts_workers", "data loading parallelism")

    # ---- algorithm
    def adv(v: Any) -> None:
        loss_type = str(get("worker.actor.loss_type", "default"))
        if v not in _ESTIMATORS:
            fail("algorithm.adv_estimator", f"{v!r} has no counterpart (--advantage-estimator: "
                 f"{', '.join(sorted(_ESTIMATORS))} of EasyR1's)")
        ours = _ESTIMATORS[v]
        if loss_type == "gspo":
            if v != "grpo":
                fail("worker.actor.loss_type", f"gspo with adv_estimator {v}: GSPO is available with grpo only")
            ours = "gspo"
        elif loss_type != "default":
            fail("worker.actor.loss_type", f"{loss_type!r} has no counterpart (default and gspo do)")
        m.set("algorithm.adv_estimator", "advantage_estimator", ours,
              "with worker.actor.loss_type gspo" if ours == "gspo" else "EasyR1's default" if
              "algorithm.adv_estimator" not in given else "")
    rule("algorithm.adv_estimator", adv)
    handled.add("worker.actor.loss_type")
    to("algorithm.gamma", "gamma", float)
    to("algorithm.lam", "lambd", float)

    def kl(_: Any) -> None:
        coef, penalty = float(get("algorithm.kl_coef")), str(get("algorithm.kl_penalty"))
        if get("algorithm.disable_kl"):
            m.na("algorithm.kl_coef", "algorithm.disable_kl: no reference model, no KL")
            return
        if "algorithm.disable_kl" in given:
            m.na("algorithm.disable_kl", "false: the KL below applies")
        if get("algorithm.kl_type", "fixed") != "fixed":
            fail("algorithm.kl_type", f"{get('algorithm.kl_type')!r}: only a fixed KL coefficient is supported")
        if get("algorithm.use_kl_loss"):
            if penalty not in _KL_TYPES:
                fail("algorithm.kl_penalty", f"{penalty!r} has no counterpart (--kl-loss-type: "
                     f"{', '.join(f'{k} -> {v}' for k, v in _KL_TYPES.items())})")
            m.set("algorithm.use_kl_loss", "use_kl_loss", True)
            m.set("algorithm.kl_coef", "kl_loss_coef", coef)
            m.set("algorithm.kl_penalty", "kl_loss_type", _KL_TYPES[penalty])
            return
        ours = "gspo" if get("worker.actor.loss_type", "default") == "gspo" else _ESTIMATORS.get(estimator, estimator)
        if not estimator_spec(ours).kl_in_rewards:
            fail("algorithm.use_kl_loss", f"false puts the KL (algorithm.kl_coef {coef}) in the rewards, which "
                 f"--advantage-estimator {ours} does not do here; set use_kl_loss: true or disable_kl: true")
        m.set("algorithm.kl_coef", "kl_coef", coef, "KL in the rewards (algorithm.use_kl_loss false)")
        if penalty != "kl":
            m.na("algorithm.kl_penalty", "the KL in the rewards is log-ratio (EasyR1's kl)")
    rule("algorithm.kl_coef", kl)
    handled.update({"algorithm.disable_kl", "algorithm.use_kl_loss", "algorithm.kl_penalty"})
    only("algorithm.kl_type", lambda v: v == "fixed", "fixed coefficient", "only 'fixed' is supported")
    na("algorithm.kl_horizon", "adaptive KL controller only")
    na("algorithm.kl_target", "adaptive KL controller only")

    def online(v: Any) -> None:
        if not v:
            for k in ("algorithm.online_filtering", "algorithm.filter_key", "algorithm.filter_low",
                      "algorithm.filter_high"):
                if k in given:
                    m.na(k, "online filtering is off")
            return
        key = str(get("algorithm.filter_key", "overall"))
        kwargs = {"key": None if key == "overall" else key, "low": float(get("algorithm.filter_low", 0.01)),
                  "high": float(get("algorithm.filter_high", 0.99))}
        m.set("algorithm.online_filtering", "dynamic_sampling_filter_path",
              "slime_rl.rollout.filters.reward_mean_in_range")
        m.set("algorithm.filter_key/low/high", "dynamic_sampling_filter_kwargs", json.dumps(kwargs))
    rule("algorithm.online_filtering", online)
    handled.update({"algorithm.filter_key", "algorithm.filter_low", "algorithm.filter_high"})
    na("trainer.max_try_make_batch", "a rollout that has drawn every prompt 3 times without filling its batch stops "
       "the run (rollout_manager.MAX_EPOCHS_PER_ROLLOUT)")

    # ---- worker.actor
    na("worker.hybrid_engine", "placement: the engines get devices of their own (--rollout-num-gpus); --colocate "
       "shares the trainer's, one device per engine")
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
    to("worker.actor.clip_ratio_dual", "eps_clip_c", float)

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

    def lora_rank(v: Any) -> None:
        if int(v or 0) > 0:
            fail("worker.actor.model.lora.rank", f"{v}: LoRA is not supported (full-parameter training only)")
        m.na("worker.actor.model.lora.rank", "0: LoRA off")
    rule("worker.actor.model.lora.rank", lora_rank)
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
    if "worker.actor.optim.lr_warmup_ratio" not in cfg:
        rule("worker.actor.optim.lr_warmup_steps", warmup)
    handled.add("worker.actor.optim.lr_warmup_steps")

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
    for k in [k for k in given if k.startswith("worker.ref.") and k not in handled]:
        na(k, "the reference model is the initial policy in the trainer's own layout")

    # ---- worker.critic (PPO's critic: adv_estimator gae)
    for k in [k for k in given if k.startswith("worker.critic.") and k not in handled]:
        if not critic:
            na(k, f"no critic for adv_estimator {estimator}")
        elif k == "worker.critic.optim.lr":
            to(k, "critic_lr", float)
        elif k == "worker.critic.cliprange_value":
            to(k, "value_clip", float)
        elif k == "worker.critic.model.model_path":
            only(k, lambda v: v is None or str(v) == str(get("worker.actor.model.model_path")), "the actor's",
                 "a critic from another checkpoint is not supported: the critic starts from --hf-checkpoint")
        else:
            na(k, "the critic uses the policy's layout and batches")

    # ---- worker.rollout
    def engine_name(v: Any) -> None:
        if backend == "sglang":
            m.set("worker.rollout.name", "rollout_backend", "sglang", f"for EasyR1's {v}")
        else:
            m.na("worker.rollout.name", f"{v}: --rollout-backend {backend} from the command line")
    rule("worker.rollout.name", engine_name)
    if "worker.rollout.name" not in given and backend == "sglang":
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

    # ---- worker.reward
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

    # ---- trainer
    def epochs(v: Any) -> None:
        if get("trainer.max_steps") is not None:
            m.na("trainer.total_epochs", "trainer.max_steps wins")
        else:
            m.set("trainer.total_epochs", "num_epoch", int(v), "" if "trainer.total_epochs" in given
                  else "EasyR1's default")
    rule("trainer.total_epochs", epochs)
    to("trainer.max_steps", "num_rollout", int)

    def project(v: Any) -> None:
        m.set("trainer.project_name", "wandb_project", str(v))
        m.set("trainer.project_name", "swanlab_project", str(v))
    rule("trainer.project_name", project)
    to("trainer.experiment_name", "wandb_group", str)

    def loggers(v: Any) -> None:
        for name in [v] if isinstance(v, str) else list(v or []):
            if name in _LOGGERS:
                m.set("trainer.logger", _LOGGERS[name], True, name)
            else:
                m.na(f"trainer.logger {name}", "metrics always go to <run-dir>/metrics.jsonl" if name in
                     ("console", "file") else "not supported; metrics.jsonl is still written")
    rule("trainer.logger", loggers)

    def nodes(_: Any) -> None:
        nn, per = int(get("trainer.nnodes", 1)), int(get("trainer.n_gpus_per_node", 8))
        m.set("trainer.nnodes", "actor_num_nodes", nn)
        m.set("trainer.n_gpus_per_node", "actor_num_gpus_per_node", per)
        m.set("trainer.nnodes x n_gpus_per_node", "rollout_num_gpus", nn * per,
              "EasyR1's engines use every GPU; here they get their own")
    rule("trainer.nnodes", nodes)
    if "trainer.nnodes" not in cfg:
        rule("trainer.n_gpus_per_node", nodes)
    handled.add("trainer.n_gpus_per_node")

    def critic_warmup(v: Any) -> None:
        if critic:
            m.set("trainer.critic_warmup", "num_critic_only_steps", int(v))
        else:
            m.na("trainer.critic_warmup", f"no critic for adv_estimator {estimator}")
    rule("trainer.critic_warmup", critic_warmup)

    def val_freq(v: Any) -> None:
        if int(v) <= 0:
            m.na("trainer.val_freq", "-1: no validation")
        elif not get("data.val_files"):
            m.na("trainer.val_freq", "no data.val_files")
        else:
            m.set("trainer.val_freq", "eval_interval", int(v))
    rule("trainer.val_freq", val_freq)

    def val_before(v: Any) -> None:
        if v:
            m.na("trainer.val_before_train", "true, the default")
        else:
            m.set("trainer.val_before_train", "skip_eval_before_train", True)
    rule("trainer.val_before_train", val_before)
    only("trainer.val_only", lambda v: not v, "false", "validation-only runs are not supported")

    def generations(v: Any) -> None:
        if int(v) > 0:
            m.set("trainer.val_generations_to_log", "log_eval_generations", int(v),
                  "N eval samples per eval to <run-dir>/eval_generations.jsonl (and wandb's table)")
        else:
            m.na("trainer.val_generations_to_log", "0")
    rule("trainer.val_generations_to_log", generations)

    def save(v: Any) -> None:
        if int(v) <= 0:
            m.na("trainer.save_freq", "-1: no checkpoints")
            return
        m.set("trainer.save_freq", "save_interval", int(v))
        m.set("trainer.save_checkpoint_path", "save", str(save_path),
              "" if get("trainer.save_checkpoint_path") else "EasyR1's default checkpoints/<project>/<experiment>")
    rule("trainer.save_freq", save)
    handled.add("trainer.save_checkpoint_path")

    def save_limit(v: Any) -> None:
        if int(v) <= 0 or save_freq <= 0:
            m.na("trainer.save_limit", "no limit" if int(v) <= 0 else "no checkpoints")
        else:
            m.set("trainer.save_limit", "keep_last", int(v))
    rule("trainer.save_limit", save_limit)
    na("trainer.save_model_only", "checkpoints keep the optimizer state (a run resumes from them); --save-hf adds "
       "HF weights")
    to("trainer.load_checkpoint_path", "load", str)

    def find_last(v: Any) -> None:
        if v and get("trainer.load_checkpoint_path") is None and save_freq > 0:
            m.set("trainer.find_last_checkpoint", "load", str(save_path), "auto-resume from --save")
        else:
            m.na("trainer.find_last_checkpoint", "off" if not v else "no checkpoints to resume from")
    rule("trainer.find_last_checkpoint", find_last)
    na("trainer.ray_timeline", "Ray timeline dumps")

    unknown = sorted(k for k in given if k not in handled)
    if unknown:
        raise error(f"{where}: EasyR1 key(s) with no mapping: {', '.join(unknown)}")
    return m


def describe(mapping: Mapping, where: str) -> str:
    """The printed mapping: one line per EasyR1 key."""
    return "\n".join([f"[slime_rl] {where}: EasyR1 config, mapped to flags (the command line still wins):",
                      *mapping.lines])
