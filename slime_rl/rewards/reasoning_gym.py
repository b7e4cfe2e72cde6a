"""`--rm-type reasoning_gym`: score a response with reasoning-gym's own verifier (`score_answer`).

Rows come from `tools/make_reasoning_gym_data.py`: the label is the entry's answer and
`sample.metadata["reasoning_gym"]` is the entry's metadata, whose `source_dataset` names the task.
The verifier is the library's, so the reward is what reasoning-gym's own evaluations count
(including its partial credit, e.g. 0.5 for a number that holds the answer among other text).

Answer extraction: the reward is the verifier's best score over at most three candidates (never a
search over substrings), tried in this order:
1. the text inside the last `<answer>...</answer>` (reasoning-gym's convention; none when absent),
2. the whole response, stripped (what "Answer with the number only." asks for),
3. the last number in the response (a small model often writes "The answer is 42.").
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

from slime_rl.data import Sample

METADATA_KEY = "reasoning_gym"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


class ReasoningGymLabelError(ValueError):
    """A sample lacks what the verifier needs; the message names the field."""


@functools.cache
def _scorer(task: str) -> Callable[[str | None, dict[str, Any]], float]:
    try:
        import reasoning_gym
    except ImportError as exc:
        raise ImportError("--rm-type reasoning_gym needs the reasoning-gym package "
                          "(pip install 'slime-rl[real]')") from exc
    try:
        return reasoning_gym.get_score_answer_fn(task)
    except ValueError as exc:
        raise ReasoningGymLabelError(
            f"metadata['{METADATA_KEY}']['source_dataset'] = {task!r}: not a reasoning-gym task") from exc


def candidates(response: str) -> list[str]:
    """The answers read from a response, in the order the module docstring gives."""
    out = []
    tagged = _ANSWER_TAG.findall(response)
    if tagged:
        out.append(tagged[-1].strip())
    out.append(response.strip())
    numbers = _NUMBER.findall(response)
    if numbers:
        out.append(numbers[-1])
    return out


def entry_of(sample: Sample) -> tuple[str, dict[str, Any]]:
    """(task, entry) for the verifier, rebuilt from the sample; a missing field raises with its name."""
    meta = sample.metadata.get(METADATA_KEY) if isinstance(sample.metadata, dict) else None
    if not isinstance(meta, dict):
        raise ReasoningGymLabelError(
            f"sample {sample.index}: metadata['{METADATA_KEY}'] is missing or not a dict (rows from "
            "tools/make_reasoning_gym_data.py carry it as the row key 'reasoning_gym')")
    task = meta.get("source_dataset")
    if not isinstance(task, str):
        raise ReasoningGymLabelError(f"sample {sample.index}: metadata['{METADATA_KEY}'] has no 'source_dataset'")
    if sample.label is None:
        raise ReasoningGymLabelError(f"sample {sample.index}: the label (--label-key) is missing")
    return task, {"question": sample.prompt, "answer": str(sample.label), "metadata": meta}


def check_labels(metadata_rows: list[dict[str, Any]], labels: list[Any]) -> None:
    """Load-time check of a whole prompt file: every row has a task the library knows and a label."""
    for i, (meta, label) in enumerate(zip(metadata_rows, labels, strict=True)):
        try:
            task, _ = entry_of(Sample(index=i, group_index=i, prompt="", prompt_ids=[], label=label, metadata=meta))
            _scorer(task)
        except ReasoningGymLabelError as exc:
            raise ReasoningGymLabelError(f"row {i}: {str(exc).removeprefix(f'sample {i}: ')}") from exc


def reasoning_gym_reward(sample: Sample) -> dict[str, float]:
    """The best verifier score over `candidates(response)`; also logs `acc` (1 when that score is 1)."""
    task, entry = entry_of(sample)
    score_answer = _scorer(task)
    best = 0.0
    for answer in candidates(sample.response):
        best = max(best, float(score_answer(answer, entry)))
        if best >= 1.0:
            break
    return {"score": best, "acc": float(best >= 1.0)}
