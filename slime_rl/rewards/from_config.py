"""The run's reward function from its `RolloutConfig`: one place, so the preflight check in
`train.py` and the RolloutManager that scores samples build exactly the same function."""

from __future__ import annotations

from slime_rl.config import RolloutConfig
from slime_rl.rewards.loader import GroupReward, RewardFn, make_reward_fn


def reward_fn_from_config(rollout: RolloutConfig, failure_value: float | None = None) -> RewardFn | GroupReward:
    """`--rm-type` / `--custom-rm-path` / `--group-rm` / `--rm-url` ... as one callable (errors name the
    flag); `failure_value` is `--reward-failure-value` (None: a raising reward ends the run)."""
    return make_reward_fn(rollout.rm_type, rollout.custom_rm_path, rollout.rm_url, rollout.reward_key,
                          group_rm=rollout.group_rm, rm_timeout_s=rollout.rm_timeout_s,
                          rm_max_retries=rollout.rm_max_retries, rm_backoff_s=rollout.rm_backoff_s,
                          failure_value=failure_value)
