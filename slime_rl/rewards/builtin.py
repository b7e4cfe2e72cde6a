"""Rule-based rewards. A reward function takes a finished `Sample` and returns a float."""

from __future__ import annotations

import re

from slime_rl.data import Sample

_DIGIT = re.compile(r"\d")


def digit_reward(sample: Sample) -> float:
    """1.0 when the first digit in the response equals the label (the quickstart task), else 0."""
    match = _DIGIT.search(sample.response)
    return 1.0 if match is not None and match.group(0) == str(sample.label).strip() else 0.0


BUILTIN = {"digit": digit_reward}
