"""Typed config groups built from the flat flags. Functions take the group they need."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    actor_num_nodes: int = 1
    actor_num_gpus_per_node: int = 1
    context_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                                   * self.context_parallel_size)


@dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: int = 1
    global_batch_size: int = 1


@dataclass(frozen=True)
class TrainerConfig:
    """How the trainer lays out work: packing, token budgets, sequence parallel, recompute, loss
    aggregation. Passed to TrainerWorker as keyword arguments of the same names."""

    pack_sequences: bool = True
    use_dynamic_batch_size: bool = False
    max_tokens_per_gpu: int | None = None
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    loss_agg_mode: str = "token-mean"
    # seq-mean-token-sum-norm (Dr.GRPO) divides by a constant horizon: the response budget
    loss_agg_max_len: int | None = None


@dataclass(frozen=True)
class OptimizerConfig:
    optimizer: str = "adam"
    lr: float = 1e-6
    min_lr: float = 0.0
    lr_decay_style: str = "constant"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8


@dataclass(frozen=True)
class ModelConfig:
    hf_checkpoint: str = ""
    bf16: bool = False
    seed: int = 1234
    freeze_vision_tower: bool = False  # vision-language models: the vision tower does not train
    # --sglang-enable-fp32-lm-head: logits in fp32 on the engines (SGLang's flag, the built-in engine's
    # too) and in the trainer alike, so both sides round the logits the same way
    fp32_lm_head: bool = False


@dataclass(frozen=True)
class AlgoConfig:
    advantage_estimator: str = "grpo"
    eps_clip: float = 0.2
    eps_clip_high: float = 0.2
    kl_loss_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    # log-probs are taken of logits / temperature on both sides (engine and trainer)
    temperature: float = 1.0
    normalize_group_std: bool = True
    overlong_buffer_len: int = 0
    overlong_penalty_factor: float = 1.0
    eps_clip_c: float | None = None
    use_kl_loss: bool = False
    kl_coef: float = 0.0  # reward-shaping KL (REINFORCE++), not a loss term
    gamma: float = 1.0
    lambd: float = 1.0  # GAE (ppo)
    value_clip: float = 0.2  # clipped value loss (ppo)
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    ref_update_interval: int | None = None  # rollouts between reference refreshes; None: frozen

    @property
    def token_level_advantages(self) -> bool:
        """Estimators whose advantages the trainer computes per token (they need log-probs or
        whitening over the whole batch); the others arrive as one scalar per sample."""
        return self.advantage_estimator in ("reinforce_plus_plus", "reinforce_plus_plus_baseline", "ppo")

    @property
    def use_critic(self) -> bool:
        return self.advantage_estimator == "ppo"

    @property
    def use_reference(self) -> bool:
        return self.use_kl_loss or self.kl_loss_coef > 0 or self.kl_coef > 0


@dataclass(frozen=True)
class CriticConfig:
    """PPO's value model: its own ranks (same TP/PP as the policy), LR and checkpoints."""

    num_nodes: int = 1
    num_gpus_per_node: int = 1
    lr: float = 1e-6
    lr_warmup_iters: int = 0
    load: str | None = None
    save: str | None = None
    num_critic_only_steps: int = 0

    @property
    def world_size(self) -> int:
        return self.num_nodes * self.num_gpus_per_node

    def parallel(self, policy: ParallelConfig) -> ParallelConfig:
        """The critic's layout: the policy's TP/PP over the critic's own ranks."""
        return dataclasses.replace(policy, actor_num_nodes=self.num_nodes,
                                   actor_num_gpus_per_node=self.num_gpus_per_node)

    def optimizer(self, policy: OptimizerConfig) -> OptimizerConfig:
        """The policy's optimizer settings with the critic's LR and warm-up; min_lr keeps its ratio
        to the LR (a decay to a tenth stays a decay to a tenth)."""
        return dataclasses.replace(policy, lr=self.lr, min_lr=policy.min_lr * self.lr / policy.lr,
                                   lr_warmup_iters=self.lr_warmup_iters)


@dataclass(frozen=True)
class DataConfig:
    prompt_data: str = ""
    input_key: str = "input"
    label_key: str = "label"
    apply_chat_template: bool = False
    rollout_shuffle: bool = False
    rollout_max_prompt_len: int | None = None
    seed: int = 42
    metadata_key: str | None = None
    tool_key: str | None = None
    chat_template_kwargs: str | None = None  # JSON object, e.g. '{"enable_thinking": false}'
    num_epoch: int | None = None
    image_key: str | None = "images"  # EasyR1's column name; absent in text-only data
    min_pixels: int | None = None  # None: the checkpoint's image processor decides
    max_pixels: int | None = None
    format_prompt: str | None = None  # jinja2 file: each prompt is rendered from `content` first


@dataclass(frozen=True)
class RolloutConfig:
    rollout_batch_size: int = 1
    n_samples_per_prompt: int = 1
    max_response_len: int = 1024
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int = 42
    num_rollout: int = 1
    rm_type: str | None = None
    custom_rm_path: str | None = None
    concurrency_per_engine: int = 64
    rm_url: str | None = None
    reward_key: str = "score"
    rm_timeout_s: float = 30.0
    rm_max_retries: int = 3
    rm_backoff_s: float = 0.5
    async_mode: bool = False
    update_weights_interval: int = 1
    # names shared with slime_rl.rollout.options.RolloutOptions, which copies them by name
    rollout_stop: tuple[str, ...] = ()
    rollout_stop_token_ids: tuple[int, ...] = ()
    rollout_max_context_len: int | None = None
    over_sampling_batch_size: int | None = None
    dynamic_sampling_filter_path: str | None = None
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    rollout_deadline_s: float | None = None
    custom_generate_function_path: str | None = None
    sample_seed: int | None = None  # set from --rollout-seed by --deterministic-rollout
    group_rm: bool = False  # --custom-rm-path scores whole groups


@dataclass(frozen=True)
class EvalConfig:
    interval: int | None = None
    datasets: tuple[tuple[str, str], ...] = ()  # (name, path)
    n_samples_per_prompt: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    max_response_len: int = 1024
    skip_before_train: bool = False

    @property
    def enabled(self) -> bool:
        return self.interval is not None and bool(self.datasets)


@dataclass(frozen=True)
class EngineConfig:
    backend: str = "embedded"
    num_gpus: int = 1
    num_gpus_per_engine: int = 1
    # --sglang-<name> VALUE, keyed by SGLang's ServerArgs field name (dashes -> underscores)
    sglang_args: dict[str, Any] = field(default_factory=dict)
    use_router: bool = False  # --use-sglang-router
    router_port: int | None = None  # --sglang-router-port
    # --router-<name> VALUE, keyed by sglang-router's option name (dashes -> underscores)
    router_args: dict[str, Any] = field(default_factory=dict)
    colocate: bool = False  # --colocate: engines on the trainer's devices (placement, weight sync, memory)

    @property
    def num_engines(self) -> int:
        return self.num_gpus // self.num_gpus_per_engine


@dataclass(frozen=True)
class WeightSyncConfig:
    update_weight_buffer_size: int = 512 * 1024**2


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    keep_last: int | None = None
    save_hf: str | None = None  # HF folder path template, may contain {rollout_id}

    def hf_path(self, rollout_id: int) -> str:
        """Where --save-hf writes after rollout `rollout_id` (slime's save_hf.format(rollout_id=...))."""
        assert self.save_hf is not None
        return self.save_hf.format(rollout_id=rollout_id)

    def saves_at(self, step: int, n_steps: int) -> bool:
        """Whether a checkpoint (and/or an HF folder) is written after `step`: every --save-interval
        steps and after the last one."""
        if not (self.save or self.save_hf):
            return False
        return bool(self.save_interval and (step + 1) % self.save_interval == 0) or step + 1 == n_steps


@dataclass(frozen=True)
class LoggingConfig:
    run_dir: str = "runs/default"
    use_wandb: bool = False
    wandb_project: str = "slime_rl"
    wandb_group: str | None = None
    wandb_mode: str = "online"
    use_tensorboard: bool = False
    dump_rollouts: bool = False
    use_swanlab: bool = False
    swanlab_project: str = "slime_rl"
    swanlab_mode: str = "online"


@dataclass(frozen=True)
class FaultConfig:
    """What the run does when a part of it fails: rollout engines (--use-fault-tolerance) and reward
    functions (a sample whose reward raised scores `reward_failure_value`)."""

    use_fault_tolerance: bool = False
    health_check_interval_s: float = 10.0
    health_check_timeout_s: float = 5.0
    reward_failure_value: float = 0.0


@dataclass(frozen=True)
class Config:
    parallel: ParallelConfig
    batch: BatchConfig
    trainer: TrainerConfig
    optimizer: OptimizerConfig
    model: ModelConfig
    algo: AlgoConfig
    data: DataConfig
    rollout: RolloutConfig
    engine: EngineConfig
    weight_sync: WeightSyncConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    eval: EvalConfig = field(default_factory=EvalConfig)
    dry_run: bool = False
    fault: FaultConfig = field(default_factory=FaultConfig)
    critic: CriticConfig | None = None  # set iff --advantage-estimator ppo

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
