"""A reward file in EasyR1's API graded with mathruler, as EasyR1's examples/reward_function/math.py grades
(`mathruler.grader.extract_boxed_content` and `grade_answer`; mathruler needs pylatexenc): REWARD_TYPE "batch",
dicts with "overall" = 0.9 accuracy + 0.1 format. Written for the tests, not EasyR1's file."""

import re
from typing import Any

from mathruler.grader import extract_boxed_content, grade_answer

REWARD_TYPE = "batch"


def compute_score(reward_inputs: list[dict[str, Any]], format_weight: float = 0.1) -> list[dict[str, float]]:
    scores = []
    for reward_input in reward_inputs:
        response = reward_input["response"]
        fmt = 1.0 if re.fullmatch(r"(?s)<think>.*</think>.*\\boxed\{.*\}.*", response) else 0.0
        acc = 1.0 if grade_answer(extract_boxed_content(response), str(reward_input["ground_truth"])) else 0.0
        scores.append({"overall": (1 - format_weight) * acc + format_weight * fmt, "format": fmt, "accuracy": acc})
    return scores
