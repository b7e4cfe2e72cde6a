"""The quickstart task: copy a digit.

A prompt names a digit; the reward is 1 when the first digit in the response is that digit. A
random-init tiny model with a small vocabulary (the quickstart's has 64 tokens, 10 of them digits)
emits a digit somewhere in its first 8 tokens about 3 times in 4 and the right one 1 time in 10,
so it starts near 0.07 and must learn, by RL alone, to attend to the prompt's digit.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# The digit ends the prompt: the policy still has to learn to copy it, but the signal it needs sits
# at the position the first response token is generated from.
TEMPLATES = (
    "Write the digit {d}",
    "Copy this digit: {d}",
    "The digit is {d}",
)

# Extra text for the tokenizer's training corpus, so that the chat template's words are tokens too.
CORPUS_EXTRA = (
    "user assistant system You are a helpful assistant. The answer is",
    "Think step by step. Repeat after me. Count to ten: 0 1 2 3 4 5 6 7 8 9.",
)


def make_rows(n: int, seed: int) -> list[dict]:
    """n rows {"input": prompt, "label": digit} with digits and templates drawn uniformly."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        d = rng.randrange(10)
        rows.append({"input": rng.choice(TEMPLATES).format(d=d), "label": str(d)})
    return rows


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    return path


def corpus_lines(seed: int, n: int = 2000) -> list[str]:
    """Text to train the tiny tokenizer on: the task's prompts and answers plus CORPUS_EXTRA."""
    lines = [r["input"] + " " + r["label"] for r in make_rows(n, seed)]
    return lines + list(CORPUS_EXTRA) * 20
