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


def reward_mean_in_range(group: list[Sample], key: str | None = None, low: float = 0.01,
                         high: float = 0.99) -> bool:
    """EasyR1's online filtering (algorithm.online_filtering, filter_key / filter_low / filter_high):
    keep a group whose mean score lies strictly between `low` and `high`. `key`: a number the reward
    function returned besides the score (`sample.reward_metrics[key]`, e.g. "accuracy"); None: the
    reward itself (EasyR1's "overall"). Arguments by --dynamic-sampling-filter-kwargs."""
    if key is None:
        scores = [s.reward for s in group]
    else:
        missing = [s.index for s in group if key not in s.reward_metrics]
        if missing:
            raise ValueError(f"reward_mean_in_range: samples {missing} have no reward metric {key!r} "
                             f"(--dynamic-sampling-filter-kwargs key; the reward function returned "
                             f"{sorted(group[0].reward_metrics)})")
        scores = [s.reward_metrics[key] for s in group]
    if any(x is None for x in scores):
        raise ValueError(f"reward_mean_in_range: group {group[0].group_index} has unscored samples")
    mean = sum(scores) / len(scores)
    return low < mean < high
