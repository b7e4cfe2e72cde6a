"""`--rm-type gpqa`: a multiple-choice answer (GPQA-style) scored by its letter, by slime's rules
(slime/rollout/rm_hub/gpqa.py, written here from its behaviour).

The option letters are the row's `metadata["valid_letters"]`, else A, B, ... for each of its
`metadata["choices"]`, else A-J. The correct letter is `metadata["correct_letter"]`, else the label when it
is one of the letters, else the label as an option index, else the option whose text equals the label's
(compared as lowercase words). The chosen letter is read from the answer (the text after the last `</think>`):
"answer/option/choice (is|:) X", then "X is (the) correct", then "final answer/option (is|:) X" (any case), else
the last standalone capital letter that is an option. Chosen and correct letters known: 1 when they are equal,
else 0. Otherwise 1 when the answer's words contain the correct option's text, `metadata["correct_answer"]`,
`metadata["answer_text"]` or the label's; else, with a chosen letter and no correct one, 1 when it equals the
label; else 0.
"""

from __future__ import annotations

import re
import string
from collections.abc import Sequence
from typing import Any

from slime_rl.data import Sample

DEFAULT_LETTERS = tuple(string.ascii_uppercase[:10])
_PATTERNS = (re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE),
             re.compile(r"([A-Z])\s*(?:is\s*(?:the)?\s*correct)", re.IGNORECASE),
             re.compile(r"final\s*(?:answer|option)\s*(?:is|:)?\s*([A-Z])", re.IGNORECASE))
_STANDALONE = re.compile(r"\b([A-Z])\b")


def _words(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _after_thinking(text: str) -> str:
    return text.rsplit("</think>", 1)[-1] if "</think>" in text else text


def chosen_letter(response: str, letters: Sequence[str]) -> str | None:
    """The option the response picks (module docstring), or None."""
    text = _after_thinking(response or "")
    valid = {x.upper() for x in letters}
    for pattern in _PATTERNS:
        match = pattern.search(text)
        if match and match.group(1).upper() in valid:
            return match.group(1).upper()
    for letter in reversed(_STANDALONE.findall(text)):
        if letter in valid:
            return letter
    return None


def _options(metadata: dict[str, Any]) -> tuple[list[str] | None, tuple[str, ...]]:
    choices = metadata.get("choices")
    if isinstance(choices, dict):
        choices = list(choices.values())
    elif choices is not None:
        choices = list(choices)
    if metadata.get("valid_letters"):
        return choices, tuple(str(x).upper() for x in metadata["valid_letters"])
    if choices:
        return choices, tuple(string.ascii_uppercase[:len(choices)])
    return choices, DEFAULT_LETTERS


def gpqa_reward(sample: Sample) -> float:
    """1.0 when the response picks the correct option (module docstring), else 0.0."""
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    choices, letters = _options(metadata)
    label = sample.label
    correct = metadata.get("correct_letter")
    correct = correct.strip().upper() if isinstance(correct, str) else None
    label_text = label.strip() if isinstance(label, str) else None
    if label_text is not None and len(label_text) == 1 and label_text.upper() in letters and correct is None:
        correct = label_text.upper()
    elif isinstance(label, (int, float)) and not isinstance(label, bool) and 0 <= int(label) < len(letters):
        correct = letters[int(label)]
    correct_text = None
    if correct is None and choices and label_text:
        for k, choice in enumerate(choices):
            if _words(str(choice)) == _words(label_text) and k < len(letters):
                correct, correct_text = letters[k], str(choice)
                break
    picked = chosen_letter(sample.response, letters)
    if picked and correct:
        return 1.0 if picked == correct else 0.0
    targets = []
    if correct and choices and correct in letters and letters.index(correct) < len(choices):
        targets.append(str(choices[letters.index(correct)]))
    targets += [str(metadata[k]) for k in ("correct_answer", "answer_text") if metadata.get(k)]
    targets += [t for t in (correct_text, label_text) if t]
    answer = _words(_after_thinking(sample.response or ""))
    if any(_words(t) and _words(t) in answer for t in targets):
        return 1.0
    if picked and correct is None and label_text:
        return 1.0 if picked == label_text.upper() else 0.0
    return 0.0
