"""The bodies of SGLang's native API, and the fields of its answers we decode; no HTTP here (client.py
sends them).

One function per endpoint builds the JSON body with SGLang's own field names (GenerateReqInput,
InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput, AbortReq, ... in
python/sglang/srt/managers/io_struct.py, SGLang 0.5.23; tests/rollout/sglang_fields.json is the
checked-in snapshot the contract test holds them to). Fields left at None are not sent, so the
server's defaults apply. With them: a generate request's images (`image_data_of`, `one_pad_per_image`)
and `decode_routed_experts` for an answer's meta_info["routed_experts"].
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from typing import Any

import numpy as np

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name


def image_data_of(images: Sequence[str | bytes]) -> list[str] | None:
    """GenerateReqInput.image_data for one request: a list of `data:image/...;base64,` URLs (one of
    the forms SGLang's load_image accepts; raw PNG bytes are wrapped into one), or None for a
    text-only prompt (the field is then omitted)."""
    if not images:
        return None
    return [b if isinstance(b, str) else "data:image/png;base64," + base64.b64encode(bytes(b)).decode("ascii")
            for b in images]


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def generate_payload(input_ids: Sequence[int] | Sequence[Sequence[int]] | None,
                     sampling_params: dict[str, Any] | Sequence[dict[str, Any]],
                     return_logprob: bool = True, rid: str | list[str] | None = None, image_data: Any = None,
                     logprob_start_len: int | None = None, text: str | list[str] | None = None,
                     return_text_in_logprobs: bool | None = None,
                     return_routed_experts: bool | None = None) -> dict[str, Any]:
    """GenerateReqInput body: exactly one of `input_ids` / `text`; a list of lists is a batch, whose
    `sampling_params` (and `rid`, `image_data`) may be one per prompt (a list) or shared."""
    if (input_ids is None) == (text is None):
        raise ValueError("generate_payload: give exactly one of input_ids and text")
    if input_ids is not None:
        input_ids = [list(x) for x in input_ids] if input_ids and isinstance(input_ids[0], Sequence) \
            else list(input_ids)
    sampling_params = dict(sampling_params) if isinstance(sampling_params, dict) \
        else [dict(p) for p in sampling_params]
    return _drop_none({"input_ids": input_ids, "text": text, "sampling_params": sampling_params,
                       "return_logprob": return_logprob, "logprob_start_len": logprob_start_len, "rid": rid,
                       "image_data": image_data, "return_text_in_logprobs": return_text_in_logprobs,
                       "return_routed_experts": return_routed_experts})


def one_pad_per_image(input_ids: Sequence[int], prompt_len: int, n_images: int, pad_id: int,
                      start_id: int) -> list[int]:
    """`input_ids` as SGLang 0.5.23 takes them with `image_data`: each image's run of <|image_pad|>
    after <|vision_start|> in the prompt (the first `prompt_len` ids) cut to one pad. SGLang decodes
    the ids to text and the HF processor expands every pad into grid_t*grid_h*grid_w/merge^2 of them,
    refusing a prompt whose pad count is not the image count; the expanded prompt it builds is the
    one the trainer holds, and the answer carries only output tokens, so both stay aligned."""
    ids, out, k, runs = list(input_ids), [], 0, 0
    while k < len(ids):
        out.append(ids[k])
        if ids[k] == pad_id and k < prompt_len and k > 0 and ids[k - 1] == start_id:
            runs += 1
            while k + 1 < min(len(ids), prompt_len) and ids[k + 1] == pad_id:
                k += 1
        k += 1
    assert runs == n_images, f"{runs} image placeholders in the prompt for {n_images} images"
    return out


def abort_request_payload(rid: str = "", abort_all: bool = False) -> dict[str, Any]:
    """AbortReq body. SGLang 0.5.23 aborts the request whose rid is exactly `rid` (or all of them with
    `abort_all`); a rid it does not hold is dropped without an answer."""
    return {"rid": rid, "abort_all": abort_all}


def pause_generation_payload(mode: str = "abort") -> dict[str, Any]:
    """PauseGenerationReqInput: mode "abort" (default), "retract" or "in_place"."""
    if mode not in ("abort", "retract", "in_place"):
        raise ValueError(f"pause mode {mode!r}: expected 'abort', 'retract' or 'in_place'")
    return {"mode": mode}


def continue_generation_payload() -> dict[str, Any]:
    return {}


def init_weights_update_group_payload(master_address: str, master_port: int, rank_offset: int, world_size: int,
                                      group_name: str = DEFAULT_GROUP, backend: str = "nccl") -> dict[str, Any]:
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def update_weights_from_distributed_payload(names: Sequence[str], dtypes: Sequence[Any],
                                            shapes: Sequence[Sequence[int]], group_name: str = DEFAULT_GROUP,
                                            flush_cache: bool = True, weight_version: str | None = None,
                                            abort_all_requests: bool | None = None,
                                            load_format: str | None = None) -> dict[str, Any]:
    """UpdateWeightsFromDistributedReqInput; dtypes may be torch dtypes or names ("bfloat16")."""
    if not (len(names) == len(dtypes) == len(shapes)):
        raise ValueError(f"names, dtypes, shapes: lengths differ ({len(names)}, {len(dtypes)}, {len(shapes)})")
    return _drop_none({
        "names": list(names), "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
        "shapes": [[int(x) for x in s] for s in shapes], "group_name": group_name, "flush_cache": flush_cache,
        "abort_all_requests": abort_all_requests, "weight_version": weight_version, "load_format": load_format})


def destroy_weights_update_group_payload(group_name: str = DEFAULT_GROUP) -> dict[str, Any]:
    return {"group_name": group_name}


def get_weights_by_name_payload(name: str, truncate_size: int = 100) -> dict[str, Any]:
    return {"name": name, "truncate_size": truncate_size}


def update_weight_version_payload(new_version: str, abort_all_requests: bool = True) -> dict[str, Any]:
    return {"new_version": new_version, "abort_all_requests": abort_all_requests}


def update_weights_from_tensor_payload(serialized_named_tensors: Sequence[str], load_format: str | None = None,
                                       flush_cache: bool = True, abort_all_requests: bool | None = None,
                                       weight_version: str | None = None) -> dict[str, Any]:
    """UpdateWeightsFromTensorReqInput: one serialized entry per engine TP rank
    (engines/tensor_ipc.serialize_named_tensors)."""
    return _drop_none({"serialized_named_tensors": list(serialized_named_tensors), "load_format": load_format,
                       "flush_cache": flush_cache, "abort_all_requests": abort_all_requests,
                       "weight_version": weight_version})


def update_weights_from_disk_payload(model_path: str, weight_version: str | None = None, flush_cache: bool = True,
                                     abort_all_requests: bool = False, load_format: str | None = None
                                     ) -> dict[str, Any]:
    """UpdateWeightFromDiskReqInput: an HF checkpoint folder the engine loads every weight from (no
    weight-update session needed: SGLang 0.5.23's loader restores and post-processes the weights itself)."""
    return _drop_none({"model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache,
                       "abort_all_requests": abort_all_requests, "load_format": load_format})


def memory_occupation_payload(tags: list[str] | None = None) -> dict[str, Any]:
    """Release/ResumeMemoryOccupationReqInput; tags among "weights", "kv_cache", "cuda_graph"
    (SGLang's memory-saver tags; None = all three)."""
    return _drop_none({"tags": tags})


def begin_weight_update_payload(selector: str = "all") -> dict[str, Any]:
    """BeginWeightUpdateReqInput: which runners the session covers ("all", "target" or "draft")."""
    if selector not in ("all", "target", "draft"):
        raise ValueError(f"selector {selector!r}: expected 'all', 'target' or 'draft'")
    return {"selector": selector}


def end_weight_update_payload() -> dict[str, Any]:
    """EndWeightUpdateReqInput has no fields of its own."""
    return {}


def lora_adapter_name(version: str) -> str:
    """The name the engines serve a LoRA run's adapters of weight version `version` under (--lora-sync
    adapter); a request names it in `lora_path`."""
    return f"policy_v{version}"


def load_lora_adapter_from_tensors_payload(lora_name: str, config_dict: dict[str, Any],
                                           serialized_named_tensors: Sequence[str],
                                           pinned: bool = False) -> dict[str, Any]:
    """LoadLoRAAdapterFromTensorsReqInput: PEFT's adapter_config as a dict and one serialized_named_tensors
    entry per engine TP rank, each the whole adapter (SGLang's LoRA layers slice A and B themselves)."""
    return {"lora_name": lora_name, "config_dict": dict(config_dict),
            "serialized_named_tensors": list(serialized_named_tensors), "pinned": pinned}


def load_lora_adapter_payload(lora_name: str, lora_path: str, pinned: bool = False) -> dict[str, Any]:
    """LoadLoRAAdapterReqInput: a PEFT folder the engine reads."""
    return {"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned}


def unload_lora_adapter_payload(lora_name: str) -> dict[str, Any]:
    return {"lora_name": lora_name}


def decode_routed_experts(value: Any, where: str = "routed_experts") -> np.ndarray:
    """meta_info["routed_experts"] -> a flat int32 array (the caller knows its shape)."""
    if not isinstance(value, str):
        raise ValueError(f"{where}: expected SGLang's base64 string, got {type(value).__name__}")
    try:
        raw = base64.b64decode(value, validate=True)
    except ValueError as e:
        raise ValueError(f"{where}: not base64 ({e})") from None
    if len(raw) % 4:
        raise ValueError(f"{where}: {len(raw)} bytes is not a whole number of int32")
    return np.frombuffer(raw, dtype=np.int32).copy()
