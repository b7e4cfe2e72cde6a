"""The config groups the rollout side reads: the prompt data, generation, rewards, eval, the engines,
weight sync and what the run does when an engine fails.

Frozen dataclasses like the rest of `groups.py` (which re-exports them and holds `Config` and the
`GROUPS` registry): field defaults come from the flag table (`flags.default_of`), and
`groups._check_table` checks at import that each field a flag names exists with the flag's default.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from slime_rl.config.flags import default_of
from slime_rl.config.seeds import run_seed
from slime_rl.config.server_groups import ServerGroup, engine_roles


@dataclass(frozen=True)
class DataConfig:
    prompt_data: str = ""
    input_key: str = default_of("--input-key")
    label_key: str = default_of("--label-key")
    apply_chat_template: bool = default_of("--apply-chat-template")
    rollout_shuffle: bool = default_of("--rollout-shuffle")
    rollout_max_prompt_len: int | None = default_of("--rollout-max-prompt-len")
    seed: int = run_seed(default_of("--seed"), default_of("--rollout-seed"))  # the run seed: the prompt order's
    metadata_key: str | None = default_of("--metadata-key")
    tool_key: str | None = default_of("--tool-key")
    # JSON object, e.g. '{"enable_thinking": false}'
    chat_template_kwargs: str | None = default_of("--apply-chat-template-kwargs")
    num_epoch: int | None = default_of("--num-epoch")
    image_key: str | None = default_of("--image-key")  # EasyR1's column name; absent in text-only data
    min_pixels: int | None = default_of("--min-pixels")  # None: the checkpoint's image processor decides
    max_pixels: int | None = default_of("--max-pixels")
    # jinja2 file: each prompt is rendered from `content` first
    format_prompt: str | None = default_of("--format-prompt")


@dataclass(frozen=True)
class RolloutConfig:
    rollout_batch_size: int = 1
    n_samples_per_prompt: int = default_of("--n-samples-per-prompt")
    max_response_len: int = default_of("--rollout-max-response-len")
    temperature: float = default_of("--rollout-temperature")
    top_p: float = default_of("--rollout-top-p")
    top_k: int = default_of("--rollout-top-k")
    seed: int = default_of("--rollout-seed")
    num_rollout: int = 1  # --num-rollout, or from --num-epoch once the data is read
    concurrency_per_engine: int = default_of("--sglang-server-concurrency")
    async_mode: bool = default_of("--async")
    fully_async: bool = default_of("--fully-async")  # rollout/stream.py
    max_staleness: int | None = default_of("--max-staleness")
    rollout_stop: tuple[str, ...] = default_of("--rollout-stop")
    rollout_stop_token_ids: tuple[int, ...] = default_of("--rollout-stop-token-ids")
    rollout_max_context_len: int | None = default_of("--rollout-max-context-len")
    over_sampling_batch_size: int | None = default_of("--over-sampling-batch-size")
    dynamic_sampling_filter_path: str | None = default_of("--dynamic-sampling-filter-path")
    partial_rollout: bool = default_of("--partial-rollout")
    mask_offpolicy_in_partial_rollout: bool = default_of("--mask-offpolicy-in-partial-rollout")
    rollout_deadline_s: float | None = default_of("--rollout-deadline-s")
    custom_generate_function_path: str | None = default_of("--custom-generate-function-path")
    agent_env: str | None = default_of("--agent-env")
    agent_max_turns: int = default_of("--agent-max-turns")
    agent_turn_max_tokens: int | None = default_of("--agent-turn-max-tokens")
    agent_timeout_s: float | None = default_of("--agent-timeout-s")
    agent_host: str = default_of("--agent-host")  # the agents' endpoint: its listening address
    dynamic_sampling_filter_kwargs: str | None = default_of("--dynamic-sampling-filter-kwargs")  # JSON object
    sample_seed: int | None = None  # --deterministic-rollout: the run seed of --seed and --rollout-seed

    @property
    def generate_sets_reward(self) -> bool:
        """A custom generate function or an agent may score each sample itself (no reward flag needed)."""
        return self.custom_generate_function_path is not None or self.agent_env is not None

    @property
    def samples_per_rollout(self) -> int:
        """Samples a step trains on: --rollout-batch-size x --n-samples-per-prompt."""
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def draw_size(self) -> int:
        """Prompts drawn at a time while filling the step's groups."""
        return self.over_sampling_batch_size or self.rollout_batch_size


@dataclass(frozen=True)
class RewardConfig:
    """How samples are scored: the built-in or custom reward function, the remote reward model, and
    what a raising reward scores."""

    rm_type: str | None = default_of("--rm-type")
    custom_rm_path: str | None = default_of("--custom-rm-path")
    custom_rm_kwargs: str | None = default_of("--custom-rm-kwargs")  # JSON object
    rm_url: str | None = default_of("--rm-url")
    reward_key: str = default_of("--reward-key")
    rm_timeout_s: float = default_of("--rm-timeout")
    rm_max_retries: int = default_of("--rm-max-retries")
    rm_backoff_s: float = default_of("--rm-backoff")
    group_rm: bool = default_of("--group-rm")  # --custom-rm-path scores whole groups
    # a sample whose reward raised scores this (counted in rollout/reward_failures)
    reward_failure_value: float = default_of("--reward-failure-value")
    reward_timeout_s: float = default_of("--reward-timeout-s")  # per reward call


@dataclass(frozen=True)
class EvalConfig:
    interval: int | None = default_of("--eval-interval")
    datasets: tuple[tuple[str, str], ...] = ()  # (name, path)
    n_samples_per_prompt: int = default_of("--n-samples-per-eval-prompt")
    temperature: float = default_of("--rollout-temperature")  # --eval-temperature, else the rollout's
    top_p: float = default_of("--rollout-top-p")
    top_k: int = default_of("--rollout-top-k")
    max_response_len: int = default_of("--rollout-max-response-len")
    skip_before_train: bool = default_of("--skip-eval-before-train")
    log_generations: int = default_of("--log-eval-generations")  # eval samples written per eval
    # --eval-config (config/eval_config.py): each set's own settings (its `defaults` merged in), by name
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.interval is not None and bool(self.datasets)

    def of(self, name: str, key: str, flag_value: Any) -> Any:
        """Set `name`'s --eval-config value of `key`, else the flags' (`flag_value`)."""
        return self.settings.get(name, {}).get(key, flag_value)


@dataclass(frozen=True)
class EngineConfig:
    backend: str = default_of("--rollout-backend")
    num_gpus: int = 1  # --rollout-num-gpus, else 1 (with --colocate: the trainer's devices)
    num_gpus_per_engine: int = default_of("--rollout-num-gpus-per-engine")
    # --sglang-<name> VALUE, keyed by SGLang's ServerArgs field name (dashes -> underscores)
    sglang_args: dict[str, Any] = field(default_factory=dict)
    use_router: bool = default_of("--use-sglang-router")
    router_port: int | None = default_of("--sglang-router-port")
    # --router-<name> VALUE, keyed by sglang-router's option name (dashes -> underscores)
    router_args: dict[str, Any] = field(default_factory=dict)
    # engines on the trainer's devices (placement, weight sync, memory)
    colocate: bool = default_of("--colocate")
    # slime's prefill/decode split (config/server_groups.py): the flags as given, and the engines' groups in engine
    # order (empty: every engine regular)
    prefill_num_servers: int | None = default_of("--prefill-num-servers")
    sglang_config: str | None = default_of("--sglang-config")
    server_groups: tuple[ServerGroup, ...] = ()

    @property
    def num_engines(self) -> int:
        return self.num_gpus // self.num_gpus_per_engine

    @property
    def disaggregated(self) -> bool:
        """Prefill/decode disaggregation: some engines prefill, the others decode (SGLang's PD, the router's PD
        mode in front of them)."""
        return any(g.worker_type != "regular" for g in self.server_groups)

    def role(self, engine_id: int) -> tuple[str, dict[str, Any]]:
        """(regular | prefill | decode, the SGLang overrides of its server group) of engine `engine_id`."""
        return engine_roles(self.server_groups, self.num_engines)[engine_id]


@dataclass(frozen=True)
class WeightSyncConfig:
    update_weight_buffer_size: int = default_of("--update-weight-buffer-size")
    update_weights_interval: int = default_of("--update-weights-interval")  # steps between weight syncs
    update_weight_transport: str = default_of("--update-weight-transport")  # nccl (broadcast / IPC) or disk
    update_weight_mode: str = default_of("--update-weight-mode")
    update_weight_disk_dir: str | None = default_of("--update-weight-disk-dir")
    update_weight_local_checkpoint_dir: str | None = default_of("--update-weight-local-checkpoint-dir")
    update_weight_delta_encoding: str = default_of("--update-weight-delta-encoding")
    update_weight_delta_checksum: str = default_of("--update-weight-delta-checksum")
    update_weight_disk_keep_files: bool = default_of("--update-weight-disk-keep-files")


@dataclass(frozen=True)
class FaultConfig:
    """What the run does when a rollout engine fails (--use-fault-tolerance); a failing reward
    function is RewardConfig's (--reward-failure-value)."""

    use_fault_tolerance: bool = default_of("--use-fault-tolerance")
    health_check_interval_s: float = default_of("--rollout-health-check-interval")
    health_check_timeout_s: float = default_of("--rollout-health-check-timeout")
