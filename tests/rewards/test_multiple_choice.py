"""--rm-type gpqa (rewards/multiple_choice.py): slime's multiple-choice rule, cases worked out by hand from
the rule in the module docstring."""

from __future__ import annotations

import pytest

from slime_rl.data import Sample
from slime_rl.rewards.builtin import BUILTIN
from slime_rl.rewards.multiple_choice import chosen_letter


def score(response: str, label, metadata: dict | None = None) -> float:
    return BUILTIN["gpqa"](Sample(index=0, group_index=0, prompt="q", prompt_ids=[1], response=response, label=label,
                                  metadata=metadata or {}))


@pytest.mark.parametrize("response, label, metadata, want", [
    ("The answer is B.", "B", None, 1.0),
    ("The answer is C.", "B", None, 0.0),
    ("<think>the answer is A</think>Final answer: B", "B", None, 1.0),  # only after </think>
    ("C is correct", 2, None, 1.0),  # an integer label is the option's index
    ("Option: a", "A", None, 1.0),  # the patterns take any case
    ("It is London.", "London", {"choices": ["Paris", "London", "Rome"]}, 1.0),  # no letter: the option's text
    ("It is Paris.", "London", {"choices": ["Paris", "London", "Rome"]}, 0.0),
    ("answer: B", "London", {"choices": ["Paris", "London", "Rome"]}, 1.0),  # London is option B
    # D is no option of 3, so no letter is read; but the label's text "d" is among the answer's words
    ("answer: D", "D", {"choices": ["Paris", "London", "Rome"]}, 1.0),
    ("answer: D", "London", {"choices": ["Paris", "London", "Rome"]}, 0.0),
    ("I think A, no wait, D", "A", {"correct_letter": "d"}, 1.0),  # metadata wins; last standalone letter
    ("", "A", None, 0.0),
])
def test_cases_by_hand(response, label, metadata, want):
    assert score(response, label, metadata) == want


def test_letter_reading_order():
    letters = "ABCD"
    assert chosen_letter("B is correct but the answer is C", letters) == "C"  # the answer pattern comes first
    assert chosen_letter("Between A and D I take D", letters) == "D"  # no pattern: the last standalone letter
    assert chosen_letter("nothing here", letters) is None
