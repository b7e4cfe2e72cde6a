from slime_rl.rewards.builtin import BUILTIN, digit_reward
from slime_rl.rewards.loader import RewardError, RewardFn, call_reward, load_by_path, load_reward

__all__ = ["BUILTIN", "RewardError", "RewardFn", "call_reward", "digit_reward", "load_by_path", "load_reward"]
