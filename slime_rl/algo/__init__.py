"""Pure tensor math for RL post-training: advantages, losses, KL, aggregation, and one estimator
object per --advantage-estimator (algo/estimators.py). CPU, no state."""

from slime_rl.algo.advantages import (
    baseline_token_advantages,
    discounted_returns,
    gae_advantages,
    group_mean_baseline,
    grpo_advantages,
    last_valid_index,
    outcome_token_rewards,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from slime_rl.algo.aggregate import AGG_MODES, aggregate, aggregate_denominator, check_mode, sample_coefficient
from slime_rl.algo.estimators import ESTIMATORS, Estimator, estimator_for
from slime_rl.algo.gspo import GSPO_LOG_RATIO_MAX, gspo_loss, gspo_seq_log_ratio, gspo_token_ratio
from slime_rl.algo.kl import KL_ESTIMATORS, kl_penalty
from slime_rl.algo.losses import (
    PPO_LOG_RATIO_CLAMP,
    ClipFractions,
    clip_fractions,
    entropy_from_logits,
    explained_variance,
    log_ratio,
    masked_mean,
    masked_sum,
    ppo_clip_loss,
    ppo_kl,
    value_loss,
    value_loss_terms,
)
from slime_rl.algo.shaping import overlong_penalty
from slime_rl.algo.whiten import masked_moments, masked_whiten

__all__ = [
    "AGG_MODES",
    "ESTIMATORS",
    "GSPO_LOG_RATIO_MAX",
    "KL_ESTIMATORS",
    "PPO_LOG_RATIO_CLAMP",
    "ClipFractions",
    "Estimator",
    "aggregate",
    "aggregate_denominator",
    "baseline_token_advantages",
    "check_mode",
    "clip_fractions",
    "discounted_returns",
    "entropy_from_logits",
    "estimator_for",
    "explained_variance",
    "gae_advantages",
    "group_mean_baseline",
    "grpo_advantages",
    "gspo_loss",
    "gspo_seq_log_ratio",
    "gspo_token_ratio",
    "kl_penalty",
    "last_valid_index",
    "log_ratio",
    "masked_mean",
    "masked_moments",
    "masked_sum",
    "masked_whiten",
    "outcome_token_rewards",
    "overlong_penalty",
    "ppo_clip_loss",
    "ppo_kl",
    "reinforce_plus_plus_advantages",
    "reinforce_plus_plus_baseline_advantages",
    "rloo_advantages",
    "sample_coefficient",
    "value_loss",
    "value_loss_terms",
]
