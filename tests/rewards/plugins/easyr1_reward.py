"""An EasyR1-style reward file: `compute_score` returns {"overall", "format", "accuracy"}.

EasyR1's own files take (response, ground_truth); slime_rl's protocol hands over the `Sample`,
so the adapter is one line. Train with
`--custom-rm-path tests/rewards/plugins/easyr1_reward.py:compute_score --reward-key overall`,
or the batch form with `--group-rm --custom-rm-path ...:compute_score_batch`.
"""

import re

FORMAT_WEIGHT = 0.1
_PATTERN = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def _boxed(text: str) -> str | None:
    match = re.findall(r"\\boxed\{([^{}]*)\}", text)
    return match[-1].strip() if match else None


def score_one(response: str, ground_truth: str) -> dict[str, float]:
    fmt = 1.0 if _PATTERN.fullmatch(response.strip()) else 0.0
    acc = 1.0 if _boxed(response) == str(ground_truth).strip() else 0.0
    return {"overall": (1 - FORMAT_WEIGHT) * acc + FORMAT_WEIGHT * fmt, "format": fmt, "accuracy": acc}


def compute_score(sample) -> dict[str, float]:
    return score_one(sample.response, sample.label)


def compute_score_batch(samples) -> list[dict[str, float]]:
    return [score_one(s.response, s.label) for s in samples]
