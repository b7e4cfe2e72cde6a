"""Pure tensor math for RL post-training: advantages, losses, KL, aggregation. CPU, no state."""

from slime_rl.algo.advantages import (
    discounted_returns,
    gae_advantages,
    grpo_advantages,
    last_valid_index,
    outcome_token_rewards,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    rloo_advantages,
)
from slime_rl.algo.aggregate import AGG_MODES, aggregate, aggregate_denominator
from slime_rl.algo.gspo import gspo_loss, gspo_seq_log_ratio, gspo_token_ratio
from slime_rl.algo.kl import KL_ESTIMATORS, kl_penalty
from slime_rl.algo.losses import (
    ClipFractions,
    clip_fractions,
    entropy_from_logits,
    explained_variance,
    masked_mean,
    masked_sum,
    ppo_clip_loss,
    ppo_kl,
    tis_weights,
    value_loss,
    value_loss_terms,
)
from slime_rl.algo.shaping import overlong_penalty
from slime_rl.algo.whiten import masked_moments, masked_whiten

__all__ = [
    "AGG_MODES",
    "KL_ESTIMATORS",
    "ClipFractions",
    "aggregate",
    "aggregate_denominator",
    "clip_fractions",
    "discounted_returns",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "gspo_seq_log_ratio",
    "gspo_token_ratio",
    "kl_penalty",
    "last_valid_index",
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
    "tis_weights",
    "value_loss",
    "value_loss_terms",
]
