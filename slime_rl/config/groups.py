"""Typed config groups built from the flat flags. Functions take the group they need.

Field defaults come from the flag table (`flags.default_of`): a value has one default, written once.
`load.py` fills the groups by keyword from the same table, and `_check_table` (run at import) makes
a field that a flag names but the group lacks -- a rename -- fail loudly here, not silently later.

The trainer's groups, checkpoints, logging, debug dumps, the dry-run plan and `Config` itself are
written here; the rollout side's (data, rollout, reward, eval, engine, weight sync, fault) in
`groups_rollout.py`, re-exported from here. `GROUPS` names them all.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from slime_rl.config.estimators import EstimatorSpec, estimator_spec
from slime_rl.config.flag_spec import ClusterShape
from slime_rl.config.flags import FLAGS, default_of
from slime_rl.config.groups_rollout import (
    DataConfig,
    EngineConfig,
    EvalConfig,
    FaultConfig,
    RewardConfig,
    RolloutConfig,
    WeightSyncConfig,
)


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = default_of("--tensor-model-parallel-size")
    pipeline_model_parallel_size: int = default_of("--pipeline-model-parallel-size")
    actor_num_nodes: int = default_of("--actor-num-nodes")
    actor_num_gpus_per_node: int = default_of("--actor-num-gpus-per-node")
    context_parallel_size: int = default_of("--context-parallel-size")
    expert_model_parallel_size: int = default_of("--expert-model-parallel-size")
    expert_tensor_parallel_size: int | None = default_of("--expert-tensor-parallel-size")
    # Megatron-LM's uneven pipeline split (config/pipeline.py): the first / last stage's layer count
    decoder_first_pipeline_num_layers: int | None = default_of("--decoder-first-pipeline-num-layers")
    decoder_last_pipeline_num_layers: int | None = default_of("--decoder-last-pipeline-num-layers")

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        """Layers of each pipeline stage (config/pipeline.py); ValueError when the flags do not split them."""
        from slime_rl.config.pipeline import stage_layer_counts

        return stage_layer_counts(num_layers, self.pipeline_model_parallel_size,
                                  self.decoder_first_pipeline_num_layers, self.decoder_last_pipeline_num_layers)

    @property
    def world_size(self) -> int:
        return self.actor_num_nodes * self.actor_num_gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        return self.world_size // (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                                   * self.context_parallel_size)


@dataclass(frozen=True)
class BatchConfig:
    micro_batch_size: int = default_of("--micro-batch-size")
    global_batch_size: int = 1
    # --balance-data: DP shards with balanced token counts (orchestration.placement.balanced_dp_shard)
    balance_data: bool = default_of("--balance-data")


@dataclass(frozen=True)
class TrainerConfig:
    """How the trainer lays out work: packing, token budgets, sequence parallel, recompute, loss
    aggregation. Each trainer rank gets it whole (trainer.rank.MegatronRank's `trainer`)."""

    pack_sequences: bool = default_of("--no-pack-sequences")
    use_dynamic_batch_size: bool = default_of("--use-dynamic-batch-size")
    max_tokens_per_gpu: int | None = default_of("--max-tokens-per-gpu")
    sequence_parallel: bool = default_of("--sequence-parallel")
    recompute_granularity: str | None = default_of("--recompute-granularity")
    recompute_method: str | None = default_of("--recompute-method")
    recompute_num_layers: int | None = default_of("--recompute-num-layers")
    deterministic_mode: bool = default_of("--deterministic-mode")  # torch's and megatron's deterministic paths
    loss_agg_mode: str = default_of("--loss-agg-mode")
    # seq-mean-token-sum-norm (Dr.GRPO) divides by a constant horizon: the response budget
    loss_agg_max_len: int | None = default_of("--rollout-max-response-len")
    moe_aux_loss_coeff: float = default_of("--moe-aux-loss-coeff")
    moe_router_load_balancing_type: str = default_of("--moe-router-load-balancing-type")
    moe_token_dispatcher_type: str = default_of("--moe-token-dispatcher-type")
    moe_grouped_gemm: bool = default_of("--moe-grouped-gemm")  # trainer/experts.py GroupedExperts
    use_rollout_routing_replay: bool = default_of("--use-rollout-routing-replay")
    use_routing_replay: bool = default_of("--use-routing-replay")
    # multi-token prediction: the MTP layers built (trainer/model.py), trained under enable_mtp_training with
    # their loss times mtp_loss_scaling_factor
    mtp_num_layers: int | None = default_of("--mtp-num-layers")
    enable_mtp_training: bool = default_of("--enable-mtp-training")
    mtp_loss_scaling_factor: float = default_of("--mtp-loss-scaling-factor")


@dataclass(frozen=True)
class OptimizerConfig:
    optimizer: str = default_of("--optimizer")
    lr: float = default_of("--lr")
    min_lr: float = default_of("--min-lr")
    lr_decay_style: str = default_of("--lr-decay-style")
    lr_warmup_iters: int = default_of("--lr-warmup-iters")
    lr_decay_iters: int | None = default_of("--lr-decay-iters")
    lr_warmup_fraction: float | None = default_of("--lr-warmup-fraction")  # excludes lr_warmup_iters > 0
    weight_decay: float = default_of("--weight-decay")
    clip_grad: float = default_of("--clip-grad")
    adam_beta1: float = default_of("--adam-beta1")
    adam_beta2: float = default_of("--adam-beta2")
    adam_eps: float = default_of("--adam-eps")
    # --optimizer-cpu-offload: fp32 main params, grads and Adam states of the rank's shard live in host
    # memory and Adam steps on the CPU (megatron-core's HybridDeviceOptimizer); GPU ranks only
    cpu_offload: bool = default_of("--optimizer-cpu-offload")
    offload_fraction: float = default_of("--optimizer-offload-fraction")
    overlap_cpu_d2h_h2d: bool = default_of("--overlap-cpu-optimizer-d2h-h2d")
    precision_aware: bool = default_of("--use-precision-aware-optimizer")

    def warmup_steps(self, decay_steps: int) -> float:
        """LR warm-up steps: --lr-warmup-iters, or Megatron's --lr-warmup-fraction x the decay steps
        (a float, as Megatron-LM passes it to OptimizerParamScheduler)."""
        if self.lr_warmup_fraction is not None:
            return self.lr_warmup_fraction * decay_steps
        return self.lr_warmup_iters


@dataclass(frozen=True)
class ModelConfig:
    hf_checkpoint: str = ""
    bf16: bool = default_of("--bf16")
    seed: int = default_of("--seed")
    # vision-language models: the vision tower does not train
    freeze_vision_tower: bool = default_of("--freeze-vision-tower")
    # --ref-load: the KL reference's weights (Megatron checkpoint or HF folder); None: the initial policy
    ref_load: str | None = default_of("--ref-load")
    opd_teacher_load: str | None = default_of("--opd-teacher-load")  # --use-opd's teacher
    # LoRA (trainer/lora.py): rank 0 = off; alpha None = 2 x rank; the HF linears to adapt (PEFT's names)
    lora_rank: int = default_of("--lora-rank")
    lora_alpha: float | None = default_of("--lora-alpha")
    lora_dropout: float = default_of("--lora-dropout")
    lora_target_modules: tuple[str, ...] = default_of("--lora-target-modules")
    lora_load: str | None = default_of("--lora-load")
    lora_sync: str = default_of("--lora-sync")  # merged | adapter: what a weight sync sends
    # --sglang-enable-fp32-lm-head: logits in fp32 on the engines (SGLang's flag, the built-in engine's
    # too) and in the trainer alike, so both sides round the logits the same way
    fp32_lm_head: bool = False
    # slime's MODEL_ARGS as given (config/flags_model.py), flag name -> value: the model is built from
    # config.json; preflight compares these with it (trainer/convert/model_args.py)
    megatron_model_args: dict[str, Any] = field(default_factory=dict)

    @property
    def adapter_sync(self) -> bool:
        """A LoRA run whose weight syncs send the adapters alone (--lora-sync adapter)."""
        return self.lora_sync == "adapter" and bool(self.lora_rank or self.lora_load)


@dataclass(frozen=True)
class AlgoConfig:
    advantage_estimator: str = default_of("--advantage-estimator")
    eps_clip: float = default_of("--eps-clip")
    eps_clip_high: float = default_of("--eps-clip")  # --eps-clip-high, else --eps-clip
    kl_loss_coef: float = default_of("--kl-loss-coef")
    kl_loss_type: str = default_of("--kl-loss-type")
    # log-probs are taken of logits / temperature on both sides (engine and trainer)
    temperature: float = default_of("--rollout-temperature")
    normalize_group_std: bool = default_of("--disable-grpo-std-normalization")
    overlong_buffer_len: int = default_of("--overlong-buffer-len")
    overlong_penalty_factor: float = default_of("--overlong-penalty-factor")
    eps_clip_c: float | None = default_of("--eps-clip-c")
    use_kl_loss: bool = default_of("--use-kl-loss")
    kl_coef: float = default_of("--kl-coef")  # reward-shaping KL (REINFORCE++), not a loss term
    gamma: float = default_of("--gamma")
    lambd: float = default_of("--lambd")  # GAE (ppo)
    value_clip: float = default_of("--value-clip")  # clipped value loss (ppo)
    entropy_coef: float = default_of("--entropy-coef")
    use_tis: bool = default_of("--use-tis")
    sapo_tau_pos: float = default_of("--sapo-tau-pos")  # --advantage-estimator sapo's gate temperatures
    sapo_tau_neg: float = default_of("--sapo-tau-neg")
    tis_clip: float = default_of("--tis-clip")
    tis_clip_low: float = default_of("--tis-clip-low")
    tis_level: str = default_of("--tis-level")
    tis_mode: str = default_of("--tis-mode")
    rollout_rs: str | None = default_of("--rollout-rs")  # verl's rejection options (algo.offpolicy)
    rollout_rs_threshold: str | None = default_of("--rollout-rs-threshold")
    rollout_rs_veto_threshold: float | None = default_of("--rollout-rs-veto-threshold")
    tis_batch_normalize: bool = default_of("--tis-batch-normalize")
    get_mismatch_metrics: bool = default_of("--get-mismatch-metrics")
    # rollouts between reference refreshes; None: frozen
    ref_update_interval: int | None = default_of("--ref-update-interval")
    # the old log-probs from their own forward pass even when the step is on-policy (worker.train_step)
    separate_old_logprobs: bool = default_of("--separate-old-logprobs")
    # slime's: the engine's log-probs are the old log-probs (the PPO ratio's denominator, the advantages'
    # log-probs); the trainer's own forward still runs, for the entropy and mismatch metrics
    use_rollout_logprobs: bool = default_of("--use-rollout-logprobs")
    # slime's on-policy distillation: advantages less opd_kl_coef x (old log-prob - teacher log-prob)
    use_opd: bool = default_of("--use-opd")
    opd_type: str | None = default_of("--opd-type")
    opd_kl_coef: float = default_of("--opd-kl-coef")

    @property
    def estimator(self) -> EstimatorSpec:
        """What --advantage-estimator needs and implies (config/estimators.py; its math: algo.estimator_for)."""
        return estimator_spec(self.advantage_estimator)

    @property
    def token_level_advantages(self) -> bool:
        """Estimators whose advantages the trainer computes per token (they need log-probs or
        whitening over the whole batch); the others arrive as one scalar per sample."""
        return self.estimator.token_level_advantages

    @property
    def use_critic(self) -> bool:
        return self.estimator.critic

    @property
    def use_reference(self) -> bool:
        return self.use_kl_loss or self.kl_loss_coef > 0 or self.kl_coef > 0


@dataclass(frozen=True)
class CriticConfig:
    """PPO's value model: its own ranks (same TP/PP as the policy), LR and checkpoints."""

    num_nodes: int = default_of("--actor-num-nodes")  # --critic-num-nodes, else the policy's
    num_gpus_per_node: int = default_of("--actor-num-gpus-per-node")
    lr: float = default_of("--lr")  # --critic-lr, else --lr
    lr_warmup_iters: int = default_of("--critic-lr-warmup-iters")
    load: str | None = default_of("--critic-load")
    save: str | None = default_of("--critic-save")
    num_critic_only_steps: int = default_of("--num-critic-only-steps")

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
                                   lr_warmup_iters=self.lr_warmup_iters,
                                   lr_warmup_fraction=None if self.lr_warmup_iters else policy.lr_warmup_fraction)


@dataclass(frozen=True)
class CheckpointConfig:
    save: str | None = default_of("--save")
    load: str | None = default_of("--load")
    ckpt_step: int | None = default_of("--ckpt-step")  # with --load of a save folder: that iteration
    save_interval: int | None = default_of("--save-interval")
    keep_last: int | None = default_of("--keep-last")
    save_hf: str | None = default_of("--save-hf")  # HF folder path template, may contain {rollout_id}
    exit_signal_handler: bool = default_of("--exit-signal-handler")  # SIGTERM: finish the step, save, stop

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
    use_wandb: bool = default_of("--use-wandb")
    wandb_project: str = default_of("--wandb-project")
    wandb_group: str | None = default_of("--wandb-group")
    wandb_mode: str = default_of("--wandb-mode")
    wandb_team: str | None = default_of("--wandb-team")
    wandb_host: str | None = default_of("--wandb-host")
    # slime's --wandb-key: the API key wandb logs in with; never printed, never in the run's config
    wandb_key: str | None = field(default=None, repr=False)
    use_tensorboard: bool = default_of("--use-tensorboard")
    dump_rollouts: bool = default_of("--dump-rollouts")
    use_swanlab: bool = default_of("--use-swanlab")
    swanlab_project: str = default_of("--swanlab-project")
    swanlab_mode: str = default_of("--swanlab-mode")


@dataclass(frozen=True)
class DebugConfig:
    """slime's debug dumps: --save-debug-rollout-data (the rollout manager writes each rollout's
    samples) and --save-debug-train-data (each data-parallel rank writes what it trained on), and
    their replay: --load-debug-rollout-data (each step's rollout read back from such a file instead
    of generated). Path templates; load.py admits only the placeholders `rollout_data_path` /
    `train_data_path` / `load_rollout_path` fill. `train_only`: no engine is started (set by
    --load-debug-rollout-data, which --debug-train-only needs)."""

    save_rollout_data: str | None = default_of("--save-debug-rollout-data")
    save_train_data: str | None = default_of("--save-debug-train-data")
    load_rollout_data: str | None = default_of("--load-debug-rollout-data")
    train_only: bool = False

    def rollout_data_path(self, rollout_id: int) -> str:
        """Where rollout `rollout_id`'s samples go (slime's save_debug_rollout_data.format(rollout_id=...))."""
        assert self.save_rollout_data is not None
        return self.save_rollout_data.format(rollout_id=rollout_id)

    def load_rollout_path(self, rollout_id: int) -> str:
        """The file step `rollout_id`'s rollout is read from (slime's load_debug_rollout_data.format(rollout_id=N))."""
        assert self.load_rollout_data is not None
        return self.load_rollout_data.format(rollout_id=rollout_id)

    def train_data_path(self, rollout_id: int, rank: int) -> str:
        """Where data-parallel rank `rank` writes step `rollout_id`'s train data."""
        assert self.save_train_data is not None
        return self.save_train_data.format(rollout_id=rollout_id, rank=rank)


@dataclass(frozen=True)
class PlanConfig:
    """What `--dry-run` plans for: another cluster than this machine (--cluster), and the link speeds
    its weight-sync estimate assumes."""

    cluster: ClusterShape | None = default_of("--cluster")  # nodes, GPUs per node, the GPU (or None)
    intra_node_gbps: float = default_of("--plan-intra-node-gbps")
    inter_node_gbps: float = default_of("--plan-inter-node-gbps")


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
    dry_run: bool = default_of("--dry-run")
    fault: FaultConfig = field(default_factory=FaultConfig)
    critic: CriticConfig | None = None  # set iff the estimator needs a critic (--advantage-estimator ppo)
    reward: RewardConfig = field(default_factory=RewardConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    @property
    def optimizer_steps_per_rollout(self) -> int:
        """Optimizer steps a rollout's samples make: samples_per_rollout / --global-batch-size."""
        return self.rollout.samples_per_rollout // self.batch.global_batch_size

    def to_dict(self) -> dict[str, Any]:
        """Every group's fields (what wandb / swanlab record as the run's config), secrets left out."""
        out = dataclasses.asdict(self)
        out["logging"].pop("wandb_key", None)
        return out


# the group each "group.field" of the flag table names ("" is Config itself)
GROUPS: dict[str, type] = {
    "": Config, "parallel": ParallelConfig, "batch": BatchConfig, "trainer": TrainerConfig,
    "optimizer": OptimizerConfig, "model": ModelConfig, "algo": AlgoConfig, "critic": CriticConfig,
    "data": DataConfig, "rollout": RolloutConfig, "reward": RewardConfig, "eval": EvalConfig,
    "engine": EngineConfig, "weight_sync": WeightSyncConfig, "checkpoint": CheckpointConfig,
    "logging": LoggingConfig, "fault": FaultConfig,
    "plan": PlanConfig, "debug": DebugConfig,
}


def _check_table() -> None:
    """Every field a flag names exists in its group, and a field the flag fills as given has the
    flag's default (a required flag's field default is a placeholder). Raises at import."""
    for f in FLAGS:
        for group, name in f.targets + f.derived_targets:
            cls = GROUPS.get(group)
            if cls is None:
                raise TypeError(f"flag table: {f.name} names group {group!r}, which is not in config.groups.GROUPS")
            fields = {x.name: x for x in dataclasses.fields(cls)}
            if name not in fields:
                raise TypeError(f"flag table: {f.name} lands in {cls.__name__}.{name}, which does not exist "
                                f"(renamed? fields: {', '.join(fields)})")
            if (group, name) in f.targets and not f.required and fields[name].default != f.field_default:
                raise TypeError(f"flag table: {cls.__name__}.{name} defaults to {fields[name].default!r}, "
                                f"{f.name} to {f.field_default!r}")


_check_table()
