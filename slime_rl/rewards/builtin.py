"""Rule-based rewards (`--rm-type NAME`). Each takes a finished `Sample` and returns a float or a
dict whose "score" is the reward (its other numeric keys are logged as metrics).

| name     | reward                                                                      |
|----------|-----------------------------------------------------------------------------|
| `digit`  | 1 when the first digit of the response equals the label (the quickstart)    |
| `math`   | 1 when the final answer equals the label as a number/expression, else 0      |
| `dapo`   | +1 when correct, -1 otherwise (DAPO); also logs `acc` (1/0)                   |
| `format` | 1 when the response is `<think>reasoning</think>` then an answer (see below)  |
| `f1`     | token F1 of the answer against the label (best over a list of labels)        |
| `math_format` | 0.9 x `math` + 0.1 x format with a `\boxed{}` answer (EasyR1's score) |
| `reasoning_gym` | reasoning-gym's own `score_answer` for the row's task (see `rewards.reasoning_gym`); logs `acc` |
| `deepscaler` | slime's `deepscaler` rule: 1 when the `\boxed{}` answer after `</think>` equals the label, else 0 |
| `gpqa` | slime's multiple-choice rule: 1 when the answer picks the correct option (`rewards.multiple_choice`) |
| `ifbench` | IFBench's strict check: 1 when the response follows every instruction of its row (`rewards.ifbench`) |

Each is one `RewardSpec` in `REWARDS` (its function and what it needs of a row's label); adding one
touches this file and `config.flags.REWARD_TYPES` (the flag's help).

`remote_rm` (an HTTP reward model at `--rm-url`) is not here: it needs a URL, so
`make_reward_fn` builds it (see `slime_rl.rewards.remote`).
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from slime_rl.config.flags import REWARD_TYPES
from slime_rl.data import Sample
from slime_rl.rewards.ifbench import check_rows as check_ifbench_rows
from slime_rl.rewards.ifbench import ifbench_reward
from slime_rl.rewards.ifbench import require as require_ifbench
from slime_rl.rewards.labels import LabelCheck, digit_label_problem, f1_label_problem, math_label_problem
from slime_rl.rewards.math_grader import answer_region, is_equivalent, last_boxed
from slime_rl.rewards.multiple_choice import gpqa_reward
from slime_rl.rewards.reasoning_gym import check_labels as check_reasoning_gym_labels
from slime_rl.rewards.reasoning_gym import reasoning_gym_reward

_DIGIT = re.compile(r"\d")


def digit_reward(sample: Sample) -> float:
    """1.0 when the first digit in the response equals the label (the quickstart task), else 0."""
    match = _DIGIT.search(sample.response)
    return 1.0 if match is not None and match.group(0) == str(sample.label).strip() else 0.0


def math_reward(sample: Sample) -> float:
    """1.0 when the response's final answer (last `\\boxed{}`, after any `</think>`) equals the label
    as math (`1/2`, `0.5`, `\\frac{1}{2}` are equal), else 0.0. See `math_grader` for the backends."""
    if sample.label is None:
        return 0.0
    return 1.0 if is_equivalent(sample.response, sample.label) else 0.0


def dapo_reward(sample: Sample) -> dict[str, float]:
    """DAPO's rule reward: +1 for a correct final answer, -1 for a wrong or missing one.

    A wrong answer is penalised rather than scored 0 so that, with the overlong penalty added,
    a truncated response is never better than a wrong one. `acc` is logged as a metric.
    """
    correct = math_reward(sample) == 1.0
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0}


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def deepscaler_reward(sample: Sample) -> float:
    """slime's `--rm-type deepscaler` (its rm_hub/deepscaler.py), rule for rule: the solution is the
    text after the last `</think>` (else after the first `###Response`; neither: 0); its last
    `\\boxed{}` is the answer (none: 0); an empty label scores 0, a label holding `\\boxed{}` is
    compared by its boxed content; 1 when equal as math, else 0. The equality test is this
    project's (`math_grader.is_equivalent`; slime's is mathd's normaliser or sympy)."""
    text, label = sample.response, sample.label
    if THINK_CLOSE in text:
        solution = text.rsplit(THINK_CLOSE, 1)[-1]
    elif "###Response" in text:
        solution = text.split("###Response")[1]
    else:
        return 0.0
    answer = last_boxed(solution)
    if answer is None or label is None or str(label) == "":
        return 0.0
    gold = str(label)
    if "\\boxed" in gold:
        gold = last_boxed(gold)
        if gold is None:
            return 0.0
    return 1.0 if is_equivalent("\\boxed{" + answer + "}", gold) else 0.0


def check_format(response: str, prompt: str = "") -> bool:
    """The `format` rule, exactly:

    1. When the prompt ends with `<think>` (templates that open the thinking block for the model,
       e.g. Qwen3 with enable_thinking), the response is read as if it started with `<think>`.
    2. After leading whitespace the response starts with `<think>`.
    3. It holds exactly one `<think>` and one `</think>`, in that order.
    4. The reasoning between them is not blank.
    5. The answer after `</think>` is not blank.
    """
    text = response
    if prompt.rstrip().endswith(THINK_OPEN) and not response.lstrip().startswith(THINK_OPEN):
        text = THINK_OPEN + response
    text = text.strip()
    if not text.startswith(THINK_OPEN) or text.count(THINK_OPEN) != 1 or text.count(THINK_CLOSE) != 1:
        return False
    reasoning, _, answer = text[len(THINK_OPEN):].partition(THINK_CLOSE)
    return bool(reasoning.strip()) and bool(answer.strip())


def format_reward(sample: Sample) -> float:
    """1.0 when the response follows `check_format`'s rule (think block, then an answer), else 0.0."""
    return 1.0 if check_format(sample.response, sample.prompt) else 0.0


def _f1_tokens(text: str) -> list[str]:
    # SQuAD normalisation: lower case, no punctuation, no articles, whitespace tokens
    text = text.lower().translate(str.maketrans("", "", string.punctuation))
    return [t for t in text.split() if t not in ("a", "an", "the")]


def token_f1(prediction: str, reference: str) -> float:
    """Token-overlap F1 (SQuAD style) of two strings; 1.0 when both are empty after normalising."""
    pred, ref = _f1_tokens(prediction), _f1_tokens(reference)
    if not pred or not ref:
        return float(pred == ref)
    common = sum((Counter(pred) & Counter(ref)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


def f1_reward(sample: Sample) -> float:
    """Token F1 of the answer (the text after the last `</think>`) against the label; a list of
    labels scores the best match."""
    refs = sample.label if isinstance(sample.label, list) else [sample.label]
    answer = answer_region(sample.response)
    return max((token_f1(answer, str(r)) for r in refs if r is not None), default=0.0)


def math_format_reward(sample: Sample) -> dict[str, float]:
    """The weighting EasyR1's recipes use for math and geometry (Geometry3K, math12k): 0.9 for a
    correct final answer plus 0.1 for the format, which here is `check_format`'s think-then-answer
    rule with the answer holding a `\\boxed{}`. Both parts are logged (`acc`, `format`)."""
    acc = math_reward(sample)
    fmt = float(check_format(sample.response, sample.prompt) and last_boxed(answer_region(sample.response)) is not None)
    return {"score": 0.9 * acc + 0.1 * fmt, "acc": acc, "format": fmt}


@dataclass(frozen=True)
class RewardSpec:
    """One built-in `--rm-type`: its function, and what it needs of the data, checked when the data is
    loaded (before any actor starts) so that a row it cannot score is a data error, not a reward of 0.

    - `label_check`: one row's label -> what is wrong with it, or None (`rewards.labels`); None when the
      reward reads no label or checks its labels itself.
    - `rows_check`: every row at once, `(metadata_rows, labels)`, raising ValueError with the reason
      (reasoning_gym: each row names a task of the installed reasoning-gym, and has a label).
    - `needs`: raises (an ImportError naming what to install) when a library the reward calls is not
      importable; called when the run's reward is built, before any actor starts (ifbench).
    """

    fn: Callable[[Sample], float | dict[str, float]]
    label_check: LabelCheck | None = None
    rows_check: Callable[[list[dict[str, Any]], list[Any]], None] | None = None
    needs: Callable[[], None] | None = None


# in --rm-type's help order (config.flags.REWARD_TYPES names them, checked below)
REWARDS: dict[str, RewardSpec] = {
    "digit": RewardSpec(digit_reward, digit_label_problem),
    "math": RewardSpec(math_reward, math_label_problem),
    "format": RewardSpec(format_reward),
    "dapo": RewardSpec(dapo_reward, math_label_problem),
    "f1": RewardSpec(f1_reward, f1_label_problem),
    "math_format": RewardSpec(math_format_reward, math_label_problem),
    "reasoning_gym": RewardSpec(reasoning_gym_reward, rows_check=check_reasoning_gym_labels),
    "deepscaler": RewardSpec(deepscaler_reward, math_label_problem),
    "gpqa": RewardSpec(gpqa_reward),
    "ifbench": RewardSpec(ifbench_reward, rows_check=check_ifbench_rows, needs=require_ifbench),
}
if tuple(REWARDS) != REWARD_TYPES:  # the flag's help and its choices come from config's list
    raise ImportError(f"rewards.builtin.REWARDS {tuple(REWARDS)} and config.flags.REWARD_TYPES {REWARD_TYPES} "
                      "must name the same reward types in the same order")
BUILTIN: dict[str, Callable[[Sample], float | dict[str, float]]] = {name: s.fn for name, s in REWARDS.items()}
