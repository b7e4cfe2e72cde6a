"""What a row's label must be for each built-in `--rm-type`, checked when the data is loaded.

A label of the wrong type does not raise in the reward: `math` scores a `null` label 0 for every
response, `digit` compares `str(label)` with one digit (so `12`, `[1]` or `null` never match), so
such rows would train on a reward that is always 0. Each reward's `RewardSpec` (`rewards.builtin`)
names its check; `label_problem(rm_type)` returns it (label -> what is wrong, or None) for
`PromptDataset(label_check=...)` to run on every row; None for rewards that read no label (`format`) or
whose labels are free-form (`remote_rm`, `--custom-rm-path`; `reasoning_gym` checks all rows at once,
its spec's `rows_check`).

| rm type                       | label                                                        |
|-------------------------------|--------------------------------------------------------------|
| `digit`                       | one digit: 0-9 as a number, or a string holding one digit    |
| `math`, `dapo`, `math_format` | a non-empty string or a finite number (not a boolean)        |
| `f1`                          | a non-empty string or number, or a non-empty list of them    |
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

LabelCheck = Callable[[Any], "str | None"]


def _kind(label: Any) -> str:
    return "null" if label is None else type(label).__name__


def _scalar_problem(label: Any) -> str | None:
    if isinstance(label, bool) or label is None or not isinstance(label, (str, int, float)):
        return f"is {_kind(label)}; expected a string or a number"
    if isinstance(label, str) and not label.strip():
        return "is an empty string"
    if isinstance(label, float) and not math.isfinite(label):
        return f"is {label}; expected a finite number"
    return None


def digit_label_problem(label: Any) -> str | None:
    if isinstance(label, bool) or not isinstance(label, (str, int)):
        return f"is {_kind(label)}; --rm-type digit needs one digit (0-9)"
    text = str(label).strip()
    if len(text) != 1 or not text.isdigit():
        return f"is {label!r}; --rm-type digit needs one digit (0-9)"
    return None


def math_label_problem(label: Any) -> str | None:
    problem = _scalar_problem(label)
    return None if problem is None else (f"{problem} (the final answer --rm-type math/dapo/math_format/deepscaler "
                                         "compares with)")


def f1_label_problem(label: Any) -> str | None:
    if isinstance(label, list):
        if not label:
            return "is an empty list; --rm-type f1 needs a reference answer"
        for i, item in enumerate(label):
            problem = _scalar_problem(item)
            if problem is not None:
                return f"item {i} {problem} (--rm-type f1)"
        return None
    problem = _scalar_problem(label)
    return None if problem is None else f"{problem}, or a list of them (--rm-type f1)"


def label_problem(rm_type: str | None, custom_rm_path: str | None = None) -> LabelCheck | None:
    """The label check of a built-in reward (`rewards.builtin.REWARDS`); None when a custom reward decides
    (`--custom-rm-path`) or the reward reads no label / checks its own."""
    from slime_rl.rewards.builtin import REWARDS  # builtin imports this module's checks

    if custom_rm_path is not None or rm_type is None or rm_type not in REWARDS:
        return None
    return REWARDS[rm_type].label_check
