"""A reward file in EasyR1's API with REWARD_TYPE "sequential": `compute_score(reward_input)` takes one
dict and returns one dict with "overall" (EasyR1's examples/reward_function/r1v.py shape)."""

from typing import Any

REWARD_NAME = "r1v_test"
REWARD_TYPE = "sequential"


def compute_score(reward_input: dict[str, Any], format_weight: float = 0.5) -> dict[str, float]:
    response = reward_input["response"]
    fmt = 1.0 if "<answer>" in response and "</answer>" in response else 0.0
    accuracy = 1.0 if str(reward_input["ground_truth"]) in response else 0.0
    return {"overall": (1 - format_weight) * accuracy + format_weight * fmt, "format": fmt, "accuracy": accuracy,
            "length": float(reward_input["response_length"])}


def plain(reward_input: dict[str, Any]) -> float:
    """A float instead of a dict (the issue: "returning floats or dicts with overall")."""
    return float(str(reward_input["ground_truth"]) in reward_input["response"])
