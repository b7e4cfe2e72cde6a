"""The run's reward function from its `RewardConfig`: one place, so the preflight check in
`train.py` and the RolloutManager that scores samples build exactly the same function."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from slime_rl.config import Config, RewardConfig
from slime_rl.rewards.loader import GroupReward, RewardFn, make_reward_fn


def opd_teacher_url(cfg: Config) -> str | None:
    """--use-opd --opd-type sglang's teacher: the /generate URL at --rm-url, or None."""
    return cfg.reward.rm_url if cfg.algo.use_opd and cfg.algo.opd_type == "sglang" else None


def reward_fn_from_config(reward: RewardConfig, failure_value: float | None = None,
                          args: Any = None, generate_sets_reward: bool = False,
                          opd_teacher_url: str | None = None, opd_temperature: float = 1.0) -> RewardFn | GroupReward:
    """`--rm-type` / `--custom-rm-path` / `--group-rm` / `--rm-url` ... as one callable (errors name the
    flag); `failure_value` is `--reward-failure-value` (`reward.reward_failure_value`; None: a raising
    reward ends the run, as in the preflight check); `args`: what a slime-style reward function gets
    first (`config.slime_args.slime_args(cfg)`); `generate_sets_reward`: a --custom-generate-function-path
    scores the samples (no reward flag needed); `opd_teacher_url`: --opd-type sglang's teacher (its
    log-probs fetched for each sample before it is scored, at `opd_temperature`: the rollout's)."""
    return make_reward_fn(reward.rm_type, reward.custom_rm_path, reward.rm_url, reward.reward_key,
                          group_rm=reward.group_rm, rm_timeout_s=reward.rm_timeout_s,
                          rm_max_retries=reward.rm_max_retries, rm_backoff_s=reward.rm_backoff_s,
                          failure_value=failure_value, args=args, rm_kwargs=reward.custom_rm_kwargs,
                          timeout_s=reward.reward_timeout_s, generate_sets_reward=generate_sets_reward,
                          opd_teacher_url=opd_teacher_url, opd_temperature=opd_temperature)


def eval_reward_fn(cfg: Config, name: str, args: Any = None) -> RewardFn | GroupReward:
    """Eval set `name`'s reward function: its --eval-config rm_type / custom_rm_path (an rm_type alone drops the
    run's custom_rm_path, which would win over it), the other reward flags as the run's, failures scored with
    --reward-failure-value like the run's."""
    own = cfg.eval.settings[name]
    custom = own["custom_rm_path"] if "custom_rm_path" in own else None if "rm_type" in own \
        else cfg.reward.custom_rm_path
    reward = replace(cfg.reward, rm_type=own.get("rm_type", cfg.reward.rm_type), custom_rm_path=custom,
                     group_rm=False)
    return reward_fn_from_config(reward, failure_value=cfg.reward.reward_failure_value, args=args)
