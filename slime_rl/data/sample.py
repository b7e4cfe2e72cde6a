"""`Sample`: one response to one prompt, from generation through reward to training."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# keys of `Sample.metadata` that the rollout keeps per sample (slime_rl.rollout.partial): where the
# sample stands, and the engine weight version of each response token
ROLLOUT_STATUS_KEY = "rollout_status"
TOKEN_VERSIONS_KEY = "token_weight_versions"


@dataclass
class Sample:
    """A prompt, one response to it, and what the loop learns about that response.

    `group_index` ties the n samples of one prompt together (GRPO normalises within a group);
    `index` is unique over the run. `loss_mask` has one entry per response token (1 = trained).
    """

    index: int
    group_index: int
    prompt: str
    prompt_ids: list[int]
    label: Any = None
    metadata: dict[str, Any] = field(default_factory=dict)
    response: str = ""
    response_ids: list[int] = field(default_factory=list)
    rollout_logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    finish_reason: str = ""
    reward: float | None = None
    # extra numeric outputs of the reward function (a dict reward's other keys), logged as metrics
    reward_metrics: dict[str, float] = field(default_factory=dict)
    weight_version: str | None = None
    # vision-language prompts: PNG data URLs at their final size and one [t, h, w] grid per image
    # (the engine gets them as image_data, the trainer turns them into pixel_values)
    images: list[str] = field(default_factory=list)
    image_grid_thw: list[list[int]] = field(default_factory=list)
    # MoE engines asked for their routing (--use-rollout-routing-replay): SGLang's routed_experts of
    # the last request, int32 [rows, layers * top_k], one row per position of `tokens` fed to the
    # engine's model (rows <= len(tokens) - 1); None when not asked
    rollout_routed_experts: Any = None
    # --opd-type sglang: the teacher server's log-prob of each response token (rewards/teacher.py)
    teacher_logprobs: list[float] | None = None

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids
