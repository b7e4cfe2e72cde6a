"""Reading back a rollout that --save-debug-rollout-data wrote, for --load-debug-rollout-data (slime's
train-only replay: the same training input, other training flags).

The file is `{"rollout_id", "samples": [...]}` (orchestration.rollout_manager.debug_rollout_data): one
dict per sample in batch order, every `Sample` field plus `tokens` and `response_length`, the samples
of one group (one `group_index`) contiguous. `read_debug_rollout` rebuilds the groups of `Sample`s in
file order and checks what the trainer relies on, so that a wrong file fails naming the file, the
sample and the field (or the flag it disagrees with) instead of deep in a training step.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from pathlib import Path
from typing import Any

import torch

from slime_rl.data.readers import DataError
from slime_rl.data.sample import Sample

FLAG = "--load-debug-rollout-data"
SAMPLE_FIELDS = tuple(f.name for f in dataclasses.fields(Sample))
# what the writer adds to the Sample fields: both derived, checked against the fields they derive from
DERIVED_FIELDS = ("tokens", "response_length")
# the fields without a default, and those the trainer's batch needs (rewards come from the file)
REQUIRED_FIELDS = ("index", "group_index", "prompt", "prompt_ids", "response_ids", "rollout_logprobs",
                   "loss_mask", "reward")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int_list(value: Any) -> str | None:
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        return f"expected a list of ints, got {_describe(value)}"
    return None


def _describe(value: Any) -> str:
    if isinstance(value, list):
        odd = next((x for x in value if not _is_int(x)), None)
        return f"a list holding {type(odd).__name__} {odd!r:.40}" if odd is not None else "a list"
    return f"{type(value).__name__} {value!r:.60}"


def _check_sample(raw: Any) -> tuple[str, str] | None:
    """(field, what is wrong) for the first bad field of one sample dict, None when it is sound."""
    if not isinstance(raw, dict):
        return "", f"expected a dict of Sample fields, got {type(raw).__name__}"
    unknown = [k for k in raw if k not in SAMPLE_FIELDS + DERIVED_FIELDS]
    if unknown:
        return str(unknown[0]), ("not a field of slime_rl's Sample (was the file written by this project's "
                                 "--save-debug-rollout-data?)")
    missing = [k for k in REQUIRED_FIELDS if k not in raw]
    if missing:
        return missing[0], "missing"
    for name in ("index", "group_index"):
        if not _is_int(raw[name]):
            return name, f"expected an int, got {_describe(raw[name])}"
    for name in ("prompt", "response", "finish_reason"):
        if name in raw and not isinstance(raw[name], str):
            return name, f"expected a string, got {_describe(raw[name])}"
    for name in ("prompt_ids", "response_ids"):
        bad = _int_list(raw[name])
        if bad:
            return name, bad
        if not raw[name]:  # the trainer's batch needs a prompt token and a response token per sample
            return name, "empty (the trainer needs at least one token)"
    n = len(raw["response_ids"])
    logprobs = raw["rollout_logprobs"]
    if not isinstance(logprobs, list) or not all(_is_number(x) for x in logprobs):
        return "rollout_logprobs", "expected a list of numbers (the engine's log-prob of each response token)"
    if len(logprobs) != n:
        return "rollout_logprobs", f"{len(logprobs)} values for {n} response tokens (response_ids)"
    mask = raw["loss_mask"]
    if not isinstance(mask, list) or not all(x in (0, 1) and not isinstance(x, float) for x in mask):
        return "loss_mask", "expected a list of 0 and 1 (int or bool)"
    if len(mask) != n:
        return "loss_mask", f"{len(mask)} values for {n} response tokens (response_ids)"
    if not _is_number(raw["reward"]):
        return "reward", f"expected a number, got {_describe(raw['reward'])}"
    for name in ("metadata", "reward_metrics"):
        if name in raw and not isinstance(raw[name], dict):
            return name, f"expected a dict, got {_describe(raw[name])}"
    for name in ("images", "image_grid_thw"):
        if name in raw and not isinstance(raw[name], list):
            return name, f"expected a list, got {_describe(raw[name])}"
    if raw.get("weight_version") is not None and not isinstance(raw["weight_version"], str):
        return "weight_version", f"expected a string or None, got {_describe(raw['weight_version'])}"
    if "tokens" in raw and raw["tokens"] != raw["prompt_ids"] + raw["response_ids"]:
        return "tokens", "not prompt_ids + response_ids"
    if "response_length" in raw and raw["response_length"] != n:
        return "response_length", f"{raw['response_length']!r}, but response_ids holds {n} tokens"
    return None


def samples_from_debug_data(payload: Any, where: str) -> list[Sample]:
    """The `Sample`s of a --save-debug-rollout-data payload, in file order; `where` names the file in
    errors (DataError naming the sample index in the file and the field)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("samples"), list):
        got = sorted(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
        raise DataError(f"{where}: expected {{'rollout_id', 'samples': [...]}} as --save-debug-rollout-data "
                        f"writes, got {got}")
    samples = []
    for i, raw in enumerate(payload["samples"]):
        bad = _check_sample(raw)
        if bad is not None:
            field, what = bad
            raise DataError(f"{where}: sample {i}" + (f", field {field!r}" if field else "") + f": {what}")
        samples.append(Sample(**{k: v for k, v in raw.items() if k in SAMPLE_FIELDS}))
    return samples


def group_samples(samples: list[Sample], where: str) -> list[list[Sample]]:
    """Consecutive samples of one group_index -> one group, in file order. A group whose samples are
    not contiguous is refused (the writer keeps them so; the trainer's batch order is the file's)."""
    groups: list[list[Sample]] = []
    first_at: dict[int, int] = {}
    for i, s in enumerate(samples):
        if groups and groups[-1][0].group_index == s.group_index:
            groups[-1].append(s)
            continue
        if s.group_index in first_at:
            raise DataError(f"{where}: sample {i}, field 'group_index': group {s.group_index} again after other "
                            f"groups (it began at sample {first_at[s.group_index]}); a group's samples are "
                            "contiguous in the files --save-debug-rollout-data writes")
        first_at[s.group_index] = i
        groups.append([s])
    return groups


def read_debug_rollout(path: str | os.PathLike, rollout_id: int, rollout_batch_size: int,
                       n_samples_per_prompt: int, routed_experts: bool = False) -> list[list[Sample]]:
    """Step `rollout_id`'s groups from `path` (--load-debug-rollout-data's template, formatted), checked
    against the run's --rollout-batch-size and --n-samples-per-prompt, and, with `routed_experts`
    (--use-rollout-routing-replay), that every sample holds the engines' routing. Raises DataError
    naming the file (and the step, the sample, the field or the flag)."""
    file = Path(path)
    if not file.is_file():
        raise DataError(f"{FLAG}: no file {file} for step {rollout_id} (the template formatted with "
                        f"rollout_id={rollout_id})")
    try:
        payload = torch.load(file, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:
        raise DataError(f"{FLAG} {file} (step {rollout_id}): not a file torch.load(weights_only=True) reads "
                        f"({type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''})"
                        ) from exc
    where = f"{FLAG} {file} (step {rollout_id})"
    samples = samples_from_debug_data(payload, where)
    if routed_experts:  # without it the trainer would silently route on its own
        lacking = next((i for i, s in enumerate(samples) if s.rollout_routed_experts is None), None)
        if lacking is not None:
            raise DataError(f"{where}: sample {lacking}, field 'rollout_routed_experts': missing, and "
                            "--use-rollout-routing-replay replays it (saved by a run without that flag?)")
    groups = group_samples(samples, where)
    if len(groups) != rollout_batch_size:
        raise DataError(f"{where}: {len(groups)} groups, but --rollout-batch-size is {rollout_batch_size} (replay "
                        "with the flags of the run that saved it)")
    for g in groups:
        if len(g) != n_samples_per_prompt:
            raise DataError(f"{where}: group {g[0].group_index} has {len(g)} samples, but --n-samples-per-prompt "
                            f"is {n_samples_per_prompt} (replay with the flags of the run that saved it)")
    return groups
