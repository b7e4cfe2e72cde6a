"""What the rollout functions read, and the SGLang sampling_params they make.

`RolloutOptions` is `RolloutConfig` itself (same fields, same defaults: the flag table's) plus what
only code sets: extra sampling_params passed through as given. It is built from a `RolloutConfig`
plus keyword overrides; every field is inherited, so a rename in the config is a rename here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from slime_rl.config import RolloutConfig


@dataclass(frozen=True)
class RolloutOptions(RolloutConfig):
    extra_sampling_params: dict[str, Any] = field(default_factory=dict)  # passed through as given
    # ask the engines for SGLang's routed_experts (--use-rollout-routing-replay)
    return_routed_experts: bool = False

    def __post_init__(self) -> None:
        if self.rollout_batch_size < 1:
            raise ValueError(f"--rollout-batch-size {self.rollout_batch_size}: must be >= 1")
        if self.n_samples_per_prompt < 1:
            raise ValueError(f"--n-samples-per-prompt {self.n_samples_per_prompt}: must be >= 1")
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < 1:
            raise ValueError(f"--over-sampling-batch-size {self.over_sampling_batch_size}: must be >= 1")
        if self.rollout_max_context_len is not None and self.rollout_max_context_len < 2:
            raise ValueError(f"--rollout-max-context-len {self.rollout_max_context_len}: must be >= 2")
        if self.mask_offpolicy_in_partial_rollout and not (self.partial_rollout or self.fully_async):
            raise ValueError("--mask-offpolicy-in-partial-rollout needs --partial-rollout or --fully-async")

    @classmethod
    def from_config(cls, cfg: RolloutConfig, **overrides: Any) -> RolloutOptions:
        """Every field of `cfg`, then `overrides` (None overrides are ignored)."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise TypeError(f"RolloutOptions has no field {unknown[0]!r}")
        values = {f.name: getattr(cfg, f.name) for f in fields(RolloutConfig)}
        if isinstance(cfg, RolloutOptions):
            values["extra_sampling_params"] = cfg.extra_sampling_params
            values["return_routed_experts"] = cfg.return_routed_experts
        values.update({k: v for k, v in overrides.items() if v is not None})
        for key in ("rollout_stop", "rollout_stop_token_ids"):
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
