"""Rollout knobs beyond `RolloutConfig`, and the SGLang sampling_params they make.

`RolloutOptions` holds, under slime's flag names, everything the rollout functions read. It is
built from a `RolloutConfig` plus keyword overrides; fields that `RolloutConfig` does not have yet
take their defaults here, so once the config grows a field (same name) it flows through unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from slime_rl.config import RolloutConfig


@dataclass(frozen=True)
class RolloutOptions:
    rollout_batch_size: int = 1               # groups delivered per step (kept groups with a filter)
    n_samples_per_prompt: int = 1
    max_response_len: int = 1024              # --rollout-max-response-len: response budget over all turns
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    concurrency_per_engine: int = 64
    rollout_stop: tuple[str, ...] = ()        # --rollout-stop: stop strings
    rollout_stop_token_ids: tuple[int, ...] = ()  # --rollout-stop-token-ids
    rollout_max_context_len: int | None = None    # prompt + response cap; caps max_new_tokens per request
    over_sampling_batch_size: int | None = None   # prompts drawn per batch (None: rollout_batch_size)
    dynamic_sampling_filter_path: str | None = None
    partial_rollout: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    custom_generate_function_path: str | None = None
    rollout_deadline_s: float | None = None   # cut the rollout after this long (partial rollout keeps the cut)
    sample_seed: int | None = None            # --deterministic-rollout: per-request sampling_seed from this
    extra_sampling_params: dict[str, Any] = field(default_factory=dict)  # passed through as given

    def __post_init__(self) -> None:
        if self.rollout_batch_size < 1:
            raise ValueError(f"--rollout-batch-size {self.rollout_batch_size}: must be >= 1")
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"--n-samples-per-prompt {self.n_samples_per_prompt}: must be >= 1")
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < 1:
            raise ValueError(f"--over-sampling-batch-size {self.over_sampling_batch_size}: must be >= 1")
        if self.rollout_max_context_len is not None and self.rollout_max_context_len < 2:
            raise ValueError(f"--rollout-max-context-len {self.rollout_max_context_len}: must be >= 2")
        if self.mask_offpolicy_in_partial_rollout and not self.partial_rollout:
            raise ValueError("--mask-offpolicy-in-partial-rollout needs --partial-rollout")

    @property
    def draw_size(self) -> int:
        return self.over_sampling_batch_size or self.rollout_batch_size

    @classmethod
    def from_config(cls, cfg: RolloutConfig, **overrides: Any) -> RolloutOptions:
        """Fields from `cfg` where it has them, then `overrides` (None overrides are ignored)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"RolloutOptions has no field {unknown[0]!r}")
        values = {n: getattr(cfg, n) for n in names if hasattr(cfg, n)}
        values.update({k: v for k, v in overrides.items() if v is not None})
        for key in ("rollout_stop", "rollout_stop_token_ids"):
            if key in values:
                values[key] = _as_tuple(values[key])
        return cls(**values)


def _as_tuple(value: str | Sequence | None) -> tuple:
    if value is None:
        return ()
    return (value,) if isinstance(value, (str, int)) else tuple(value)


def sampling_params(opts: RolloutOptions) -> dict[str, Any]:
    """SGLang sampling_params for one request of a full response; `max_new_tokens` is the whole
    response budget, which a generate function narrows per request (`ClientPool.budget`)."""
    params: dict[str, Any] = {
        "temperature": opts.temperature,
        "top_p": opts.top_p,
        "top_k": opts.top_k,
        "max_new_tokens": opts.max_response_len,
    }
    if opts.rollout_stop:
        params["stop"] = list(opts.rollout_stop)
    if opts.rollout_stop_token_ids:
        params["stop_token_ids"] = list(opts.rollout_stop_token_ids)
    params.update(opts.extra_sampling_params)
    return params
