from slime_rl.algo.advantages import grpo_advantages
from slime_rl.algo.losses import kl_penalty, masked_mean, masked_sum, ppo_clip_loss

__all__ = ["grpo_advantages", "kl_penalty", "masked_mean", "masked_sum", "ppo_clip_loss"]
