"""This project's counterparts of slime's reward hub (slime/rollout/rm_hub/), for user functions
written for slime (config/slime_imports.py maps slime's paths to these names where slime is not
installed; docs/migration.md's table says what differs). slime's signatures, this project's grader:

- `grade_answer_verl(solution_str, ground_truth) -> bool`: the last `\\boxed{}` of the solution
  against the ground truth (its `\\boxed{}` content when it holds one), equal as math by
  `math_grader.is_equivalent` (slime: mathd's normaliser, then sympy);
- `extract_answer(passage)` (rm_hub's `extract_boxed_answer`): the last `\\boxed{}`'s content, None
  without `\\boxed`;
- `compute_score(solution_str, ground_truth, strict_box_verify=False)` (math_dapo_utils, rm_hub's
  `compute_score_dapo`): `{"score": 1.0 | -1.0, "acc": bool, "pred": str | None}`; the answer is the
  last "Answer: X" of the last 300 characters, compared as math (slime: normalised text against the
  integer ground truth), or with `strict_box_verify` the last `\\boxed{}` of the last 100 characters,
  equal as text (as slime);
- `get_deepscaler_rule_based_reward(response, label)`: `--rm-type deepscaler`'s rule;
- `async_rm(args, sample)`, `batched_async_rm(args, samples)`, `remote_rm(args, sample)`: slime's
  dispatch: the sample's or `args.custom_rm_path` (called slime's way), else the rule of
  `metadata["rm_type"]` or `args.rm_type` (a `boxed_` prefix scores the boxed answer), which is this
  project's `--rm-type` of that name (slime's `random`, `gpqa` and `ifbench` too).
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import re
from typing import Any

from slime_rl.config.dotted_path import load_by_path
from slime_rl.data import Sample
from slime_rl.rewards.builtin import BUILTIN, deepscaler_reward
from slime_rl.rewards.math_grader import is_equivalent, last_boxed
from slime_rl.rewards.remote import RemoteRewardModel

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")  # math_dapo_utils' "Answer: X" line
_remote: dict[str, RemoteRewardModel] = {}


def extract_answer(passage: str) -> str | None:
    """slime's math_utils.extract_answer: the content of the last `\\boxed{}`, None without one."""
    return last_boxed(passage) if "\\boxed" in passage else None


def grade_answer_verl(solution_str: str, ground_truth: Any) -> bool:
    """slime's math_utils.grade_answer_verl (see the module docstring)."""
    if not ground_truth:
        return False
    truth = str(ground_truth)
    if "\\boxed" in truth:
        truth = extract_answer(truth)
        if truth is None:
            return False
    given = extract_answer(solution_str)
    return given is not None and is_equivalent("\\boxed{" + given + "}", truth)


def compute_score(solution_str: str, ground_truth: Any, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict[str, Any]:
    """slime's math_dapo_utils.compute_score (see the module docstring)."""
    tail = solution_str[-300:]
    if strict_box_verify:
        pred = last_boxed(tail[pause_tokens_index[-1] - 100:] if pause_tokens_index else tail[-100:])
        correct = pred is not None and pred == str(ground_truth)
    else:
        found = _ANSWER_LINE.findall(tail)
        pred = found[-1].strip() if found else None
        correct = pred is not None and is_equivalent("\\boxed{" + pred + "}", ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}


def _ours(sample: Any, response: str | None = None) -> Sample:
    """A slime Sample as ours, for the rule rewards (prompt, response, label, metadata)."""
    tokens = list(getattr(sample, "tokens", None) or [])
    n = int(getattr(sample, "response_length", 0) or 0)
    prompt = sample.prompt if isinstance(sample.prompt, str) else json.dumps(sample.prompt)
    return Sample(index=sample.index or 0, group_index=sample.group_index or 0, prompt=prompt,
                  prompt_ids=tokens[:len(tokens) - n], label=sample.label, metadata=dict(sample.metadata or {}),
                  response=sample.response if response is None else response, response_ids=tokens[len(tokens) - n:])


def get_deepscaler_rule_based_reward(response: str, label: Any) -> float:
    """slime's rm_hub deepscaler rule, as `--rm-type deepscaler` scores it."""
    return deepscaler_reward(Sample(index=0, group_index=0, prompt="", prompt_ids=[], label=label, response=response))


async def remote_rm(args: Any, sample: Any, max_retries: int = 10) -> Any:
    """slime's rm_hub.remote_rm: POST the sample to `args.rm_url` (this project's client: its body also
    carries the metadata)."""
    model = _remote.get(args.rm_url)
    if model is None:
        model = _remote[args.rm_url] = RemoteRewardModel(args.rm_url, max_retries=max_retries)
    return await model(_ours(sample))


async def _call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    out = fn(*args, **kwargs)
    return await out if inspect.isawaitable(out) else out


async def async_rm(args: Any, sample: Any, **kwargs: Any) -> Any:
    """slime's rm_hub.async_rm (see the module docstring)."""
    path = getattr(sample, "custom_rm_path", None) or getattr(args, "custom_rm_path", None)
    if path:
        return await _call(load_by_path(path, "--custom-rm-path"), args, sample, **kwargs)
    metadata = sample.metadata if isinstance(sample.metadata, dict) else {}
    rm_type = (metadata.get("rm_type") or getattr(args, "rm_type", None) or "").strip()
    response = sample.response
    if rm_type.startswith("boxed_"):
        response, rm_type = extract_answer(response) or "", rm_type[len("boxed_"):]
    if rm_type == "remote_rm":
        return await remote_rm(args, sample)
    if rm_type == "random":
        return random.randint(0, 1)
    if rm_type in BUILTIN:
        return await asyncio.to_thread(BUILTIN[rm_type], _ours(sample, response))
    raise NotImplementedError(f"Rule-based RM for {rm_type} is not implemented." if rm_type
                              else "Rule-based RM type is not specified.")


async def batched_async_rm(args: Any, samples: list[Any], **kwargs: Any) -> list[Any]:
    """slime's rm_hub.batched_async_rm: `args.custom_rm_path` scores the whole list (slime's
    `rm(args, samples)`), else `async_rm` per sample."""
    if getattr(args, "custom_rm_path", None):
        return await _call(load_by_path(args.custom_rm_path, "--custom-rm-path"), args, samples, **kwargs)
    return list(await asyncio.gather(*(async_rm(args, s, **kwargs) for s in samples)))
