"""Example user reward functions, loaded by dotted path in the contract test."""


def length_reward(sample) -> float:
    return float(len(sample.response))


async def async_label_reward(sample) -> float:
    return 1.0 if sample.label in sample.response else 0.0


def bad_reward(sample):
    return "high"


def index_reward(sample) -> float:
    """Differs between consecutive samples of a group, so every group has a learning signal."""
    return (sample.index * 7) % 10 / 10
