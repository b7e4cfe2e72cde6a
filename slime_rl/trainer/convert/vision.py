"""The vision tower of a vision-language checkpoint (Qwen2.5-VL), in the registry's terms.

The trainer runs the HF vision module itself (`Qwen2_5_VisionTransformerPretrainedModel`, built
from config.json's `vision_config`) on the first pipeline stage, as `vision_model` of the GPTModel;
only the language decoder is Megatron's. So every vision tensor is one REPLICATED entry: the
checkpoint's `visual.<name>` is the trainer's `vision_model.<name>`, whole on every TP rank.

The list of names and shapes comes from the module itself, built on the meta device (no memory, no
weights): it is exactly what the module will hold, for any depth or width of the config.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from slime_rl.config.families import Layout, ParamMap

HF_PREFIX = "visual."  # the checkpoint's names (the Qwen2.5-VL safetensors layout)
MCORE_PREFIX = "vision_model."  # the GPTModel attribute the trainer attaches the tower as


@dataclass(frozen=True)
class VisionArch:
    config_json: str  # config.json's vision_config, as sorted JSON (hashable)
    image_token_id: int
    spatial_merge_size: int
    out_hidden_size: int
    params: tuple[ParamMap, ...]

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)


def vision_module(vision_config: dict[str, Any], device: str | None = None) -> Any:
    """The HF Qwen2.5-VL vision tower for this config (random init; `device="meta"` for shapes)."""
    import torch
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    cfg = Qwen2_5_VLVisionConfig(**{k: v for k, v in vision_config.items() if k != "model_type"})
    # the engine (HF from_pretrained) runs the tower with SDPA attention; the trainer must match it
    cfg._attn_implementation = "sdpa"
    with torch.device(device) if device else contextlib.nullcontext():
        return Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg, attn_implementation="sdpa")


@lru_cache(maxsize=8)
def _param_shapes(config_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    module = vision_module(json.loads(config_json), device="meta")
    return tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


def vision_arch(cfg: dict[str, Any], where: str) -> VisionArch:
    """VisionArch of a Qwen2.5-VL config.json (`vision_config` and the image token id)."""
    vc = cfg.get("vision_config")
    if not isinstance(vc, dict):
        raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} needs a vision_config object")
    if "image_token_id" not in cfg:
        raise ValueError(f"{where}: image_token_id is missing (the <|image_pad|> id)")
    config_json = json.dumps(vc, sort_keys=True)
    params = tuple(ParamMap(MCORE_PREFIX + n, (HF_PREFIX + n,), Layout.REPLICATED, (shape,))
                   for n, shape in _param_shapes(config_json))
    out_hidden = int(vc.get("out_hidden_size", vc.get("hidden_size")))
    return VisionArch(config_json=config_json, image_token_id=int(cfg["image_token_id"]),
                      spatial_merge_size=int(vc.get("spatial_merge_size", 2)), out_hidden_size=out_hidden,
                      params=params)
