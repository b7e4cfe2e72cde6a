"""A reward file in EasyR1's API with the shape of its examples/reward_function/dapo.py: REWARD_TYPE "batch",
`compute_score(reward_inputs, max_response_length, overlong_buffer_length, overlong_penalty_factor)` with the three
keyword arguments required (EasyR1 binds them from `worker.reward.reward_function_kwargs`). The score is DAPO's
(arXiv 2503.14476): accuracy +1 / -1 on the last `Answer:` line, plus the soft overlong punishment (0 up to
max_response_length - overlong_buffer_length, then falling linearly to -1 at max_response_length, -1 beyond) times
the factor."""

from typing import Any

REWARD_NAME = "dapo_test"
REWARD_TYPE = "batch"


def _overlong(length: int, max_response_length: int, overlong_buffer_length: int) -> float:
    expected = max_response_length - overlong_buffer_length
    if length <= expected:
        return 0.0
    if length <= max_response_length:
        return (expected - length) / overlong_buffer_length
    return -1.0


def compute_score(reward_inputs: list[dict[str, Any]], max_response_length: int, overlong_buffer_length: int,
                  overlong_penalty_factor: float) -> list[dict[str, float]]:
    scores = []
    for item in reward_inputs:
        last = item["response"].strip().splitlines()[-1:] or [""]
        answer = last[0].split("Answer:")[-1].strip()
        accuracy = 1.0 if answer == str(item["ground_truth"]).strip() else -1.0
        overlong = _overlong(item["response_length"], max_response_length, overlong_buffer_length)
        scores.append({"overall": accuracy + overlong * overlong_penalty_factor, "accuracy": accuracy,
                       "accuracy_normalized": 0.5 * (accuracy + 1.0), "overlong": overlong})
    return scores
