"""Reading back a rollout that --save-debug-rollout-data wrote, for --load-debug-rollout-data (slime's
train-only replay: the same training input, other training flags).

The file is `{"rollout_id", "samples": [...]}` (orchestration.rollout_manager.debug_rollout_data): one
dict per sample in batch order, every `Sample` field plus `tokens` and `response_length`, the samples
of one group (one `group_index`) contiguous. `read_debug_rollout` rebuilds the groups of `Sample`s in
file order and checks what the trainer relies on, so that a wrong file fails naming the file, the
sample and the field (or the flag it disagrees with) instead of deep in a training step.

It also reads the files slime's own --save-debug-rollout-data writes (slime/observability/
rollout_data_utils.py save_debug_rollout_data: `{"rollout_id", "samples": [Sample.to_dict()]}`, with
slime/utils/types.py's Sample: `tokens` = prompt + response ids, `response_length`, `rollout_log_probs`,
`loss_mask` (None: every response token trained), `reward`, `status` as its string value,
`weight_versions`, ...), so a migrating run can replay what slime saved (`_from_slime`). A file holds
one writer's samples: mixed formats are refused.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
from pathlib import Path
from typing import Any

import numpy as np
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


# slime's Sample.Status value -> our finish_reason (as slime_rl.rollout.slime_compat maps it); "pending"
# (never generated) is refused
SLIME_STATUS = {"completed": "stop", "truncated": "length", "aborted": "abort", "failed": "failed"}
SLIME_REQUIRED = ("index", "group_index", "tokens", "response_length", "rollout_log_probs", "reward")
SLIME_FORMAT = "slime's Sample.to_dict (rollout_log_probs or status, no prompt_ids)"
OUR_FORMAT = "this project's writer (prompt_ids, rollout_logprobs)"


def is_slime_sample(raw: Any) -> bool:
    """A sample dict written by slime's --save-debug-rollout-data (its Sample.to_dict)."""
    return isinstance(raw, dict) and "prompt_ids" not in raw and ("rollout_log_probs" in raw or "status" in raw)


def _plain(value: Any) -> Any:
    """A tensor (what slime may keep in a field) as nested lists, anything else as it is."""
    return value.tolist() if isinstance(value, torch.Tensor) else value


def _from_slime(raw: dict, reward_key: str | None = None) -> Sample | tuple[str, str]:
    """Our Sample from one slime sample dict, or (field, what is wrong). The split and the defaults are
    slime's training-data conversion's: the last `response_length` of `tokens` are the response,
    `loss_mask` None trains every response token, `remove_sample` zeroes the mask; a dict reward gives
    its `reward_key` entry (slime's Sample.get_reward_value with --reward-key)."""
    missing = [k for k in SLIME_REQUIRED if k not in raw]
    if missing:
        return missing[0], "missing (a slime sample dict holds it: slime/utils/types.py Sample.to_dict)"
    for name in ("index", "group_index"):
        if not _is_int(raw[name]):
            return name, f"expected an int, got {_describe(raw[name])}"
    for name in ("multimodal_inputs", "multimodal_train_inputs"):
        if raw.get(name) is not None:
            return name, "a multimodal sample: replaying slime's multimodal samples is not supported"
    tokens = _plain(raw["tokens"])
    bad = _int_list(tokens)
    if bad:
        return "tokens", bad
    n = raw["response_length"]
    if not _is_int(n) or not 0 < n < len(tokens):
        return "response_length", (f"{n!r}, but tokens holds {len(tokens)} ids (the trainer needs at least one "
                                   "prompt token and one response token)")
    logprobs = _plain(raw["rollout_log_probs"])
    if logprobs is None:
        return "rollout_log_probs", ("None: the run that saved it kept no engine log-probs, which the trainer "
                                     "needs (slime's generate keeps them with return_logprob)")
    if not isinstance(logprobs, list) or not all(_is_number(x) for x in logprobs):
        return "rollout_log_probs", "expected a list of numbers (the engine's log-prob of each response token)"
    if len(logprobs) != n:
        return "rollout_log_probs", f"{len(logprobs)} values for response_length {n}"
    mask = _plain(raw.get("loss_mask"))
    if mask is None:  # slime's conversion: no mask means every response token is trained
        mask = [1] * n
    if not isinstance(mask, list) or not all(x in (0, 1) and not isinstance(x, float) for x in mask):
        return "loss_mask", "expected None or a list of 0 and 1 (int or bool)"
    if len(mask) != n:
        return "loss_mask", f"{len(mask)} values for response_length {n}"
    if raw.get("remove_sample"):  # slime trains none of a removed sample's tokens
        mask = [0] * n
    reward = raw["reward"]
    if isinstance(reward, dict):
        keys = sorted(map(str, reward))
        if reward_key is None or reward_key not in reward:
            return "reward", (f"a dict (keys {keys}) without the --reward-key {reward_key!r} entry: slime trains "
                              "reward[--reward-key]; give the key the saving run used")
        reward = reward[reward_key]
        if not _is_number(reward):
            return "reward", f"reward[{reward_key!r}] (--reward-key): expected a number, got {_describe(reward)}"
    if not _is_number(reward):
        return "reward", f"expected a number, got {_describe(reward)}"
    status = raw.get("status", "completed")
    if status not in SLIME_STATUS:
        return "status", (f"{status!r}: expected one of {', '.join(SLIME_STATUS)} (a generated sample's "
                          "Sample.Status value)")
    prompt = raw.get("prompt", "")
    if isinstance(prompt, list):  # chat messages: kept readable (the trainer uses the token ids)
        prompt = json.dumps(prompt, ensure_ascii=False)
    if not isinstance(prompt, str):
        return "prompt", f"expected a string or a list of chat messages, got {_describe(prompt)}"
    response = raw.get("response", "")
    if not isinstance(response, str):
        return "response", f"expected a string, got {_describe(response)}"
    metadata = raw.get("metadata") or {}
    if not isinstance(metadata, dict):
        return "metadata", f"expected a dict or None, got {_describe(metadata)}"
    versions = raw.get("weight_versions") or []
    if not isinstance(versions, list):
        return "weight_versions", f"expected a list, got {_describe(versions)}"
    routed = _plain(raw.get("rollout_routed_experts"))
    if routed is not None:  # slime's [rows, layers, top_k] -> ours [rows, layers * top_k]
        try:
            routed = np.asarray(routed, dtype=np.int32)
        except (TypeError, ValueError) as exc:
            return "rollout_routed_experts", f"not an array of ints ({exc})"
        if routed.ndim < 1 or not 0 < routed.shape[0] <= len(tokens) - 1:
            return "rollout_routed_experts", (f"{routed.shape[0] if routed.ndim else 0} rows for {len(tokens)} "
                                              f"tokens (one per position fed to the engine: at most "
                                              f"{len(tokens) - 1})")
        routed = routed.reshape(routed.shape[0], -1).tolist()
    cut = len(tokens) - n
    return Sample(index=raw["index"], group_index=raw["group_index"], prompt=prompt, prompt_ids=tokens[:cut],
                  label=raw.get("label"), metadata=dict(metadata), response=response, response_ids=tokens[cut:],
                  rollout_logprobs=list(logprobs), loss_mask=list(mask), finish_reason=SLIME_STATUS[status],
                  reward=reward, weight_version=str(versions[-1]) if versions else None,
                  rollout_routed_experts=routed)


def samples_from_debug_data(payload: Any, where: str, reward_key: str | None = None) -> list[Sample]:
    """The `Sample`s of a --save-debug-rollout-data payload, in file order; `where` names the file in
    errors (DataError naming the sample index in the file and the field)."""
    if not isinstance(payload, dict) or not isinstance(payload.get("samples"), list):
        got = sorted(map(str, payload)) if isinstance(payload, dict) else type(payload).__name__
        raise DataError(f"{where}: expected {{'rollout_id', 'samples': [...]}} as --save-debug-rollout-data "
                        f"writes, got {got}")
    samples = []
    slime = bool(payload["samples"]) and is_slime_sample(payload["samples"][0])
    for i, raw in enumerate(payload["samples"]):
        if i and is_slime_sample(raw) != slime:
            raise DataError(f"{where}: sample {i}: written by {SLIME_FORMAT if not slime else OUR_FORMAT}, but "
                            f"sample 0 by {SLIME_FORMAT if slime else OUR_FORMAT}; a file holds one writer's "
                            "samples (mixed formats are refused)")
        if slime:
            out = _from_slime(raw, reward_key)
            bad = out if isinstance(out, tuple) else None
        else:
            bad = _check_sample(raw)
        if bad is not None:
            field, what = bad
            raise DataError(f"{where}: sample {i}" + (f", field {field!r}" if field else "") + f": {what}")
        samples.append(out if slime else Sample(**{k: v for k, v in raw.items() if k in SAMPLE_FIELDS}))
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
                       n_samples_per_prompt: int, routed_experts: bool = False,
                       reward_key: str | None = None) -> list[list[Sample]]:
    """Step `rollout_id`'s groups from `path` (--load-debug-rollout-data's template, formatted), checked
    against the run's --rollout-batch-size and --n-samples-per-prompt, and, with `routed_experts`
    (--use-rollout-routing-replay), that every sample holds the engines' routing. `reward_key`
    (--reward-key): the entry a slime sample's dict reward gives. Raises DataError
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
    samples = samples_from_debug_data(payload, where, reward_key)
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
