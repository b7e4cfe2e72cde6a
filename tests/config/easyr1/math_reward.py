"""A reward file in EasyR1's API (verl/workers/reward/function.py): REWARD_TYPE "batch",
`compute_score(reward_inputs)` over dicts with response / response_length / ground_truth, returning
dicts with "overall". Like EasyR1's examples/reward_function/math.py, without mathruler: the last
\\boxed{...} (else the last digit) against the ground truth."""

import re
from typing import Any

REWARD_NAME = "math_test"
REWARD_TYPE = "batch"


def _answer(response: str) -> str:
    boxed = re.findall(r"\\boxed\{([^}]*)\}", response)
    if boxed:
        return boxed[-1].strip()
    digits = re.findall(r"\d", response)
    return digits[-1] if digits else ""


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    scores = []
    for reward_input in reward_inputs:
        response = reward_input["response"]
        format_score = 1.0 if re.fullmatch(r"(?s)<think>.*</think>.*\\boxed\{.*\}.*", response) else 0.0
        accuracy = 1.0 if _answer(response) == str(reward_input["ground_truth"]).strip() else 0.0
        scores.append({"overall": (1 - format_weight) * accuracy + format_weight * format_score,
                       "format": format_score, "accuracy": accuracy})
    return scores
