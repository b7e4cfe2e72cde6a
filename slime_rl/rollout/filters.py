"""Group filters for dynamic sampling (`--dynamic-sampling-filter-path`): `def f(group) -> bool`,
True keeps the group. They see finished, scored groups only."""

from __future__ import annotations

from slime_rl.data import Sample


def check_reward_nonzero_std(group: list[Sample]) -> bool:
    """DAPO's dynamic sampling: keep a group only if its rewards differ. A group whose samples all
    score the same has zero advantage under group normalisation, so it adds no gradient, only noise
    to the token-mean denominator."""
    rewards = [s.reward for s in group]
    if any(r is None for r in rewards):
        raise ValueError(f"check_reward_nonzero_std: group {group[0].group_index} has unscored samples")
    # exact comparison on purpose: any spread at all gives non-zero advantages
    return len(group) > 1 and max(rewards) > min(rewards)
