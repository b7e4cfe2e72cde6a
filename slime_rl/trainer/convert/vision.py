"""The vision tower of a vision-language checkpoint (Qwen2.5-VL, Qwen3.5), in the registry's terms.

The trainer runs the HF vision module itself (built from config.json's `vision_config`:
`Qwen2_5_VisionTransformerPretrainedModel`, or Qwen3.5's `Qwen3_5VisionModel` / `Qwen3_5MoeVisionModel`) on the
first pipeline stage, as `vision_model` of the GPTModel; only the language decoder is Megatron's. So every vision
tensor is one REPLICATED entry: the checkpoint's `<prefix><name>` (`Family.vision_prefix`: Qwen2.5-VL's `visual.`,
Qwen3.5's `model.visual.`) is the trainer's `vision_model.<name>`, whole on every TP rank.

Qwen3.5's tower is Qwen2.5-VL's idea without window attention and without DeepStack: a Conv3d patch embedding plus a
learned position table resampled bilinearly to each image's grid, full-attention blocks with 2-D rotary positions
(LayerNorm, GELU MLP), and a patch merger (LayerNorm, two linears) whose output, one vector per 2 x 2 patches, is
what goes to the image tokens (`pooler_output`, as for Qwen2.5-VL).

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

MCORE_PREFIX = "vision_model."  # the GPTModel attribute the trainer attaches the tower as


@dataclass(frozen=True)
class VisionArch:
    config_json: str  # config.json's vision_config, as sorted JSON (hashable)
    model_type: str  # the checkpoint's (which HF module the tower is)
    image_token_id: int
    spatial_merge_size: int
    out_hidden_size: int
    params: tuple[ParamMap, ...]

    @property
    def config(self) -> dict[str, Any]:
        return json.loads(self.config_json)


def vision_module(vision_config: dict[str, Any], device: str | None = None, model_type: str = "qwen2_5_vl") -> Any:
    """The HF vision tower of `model_type` for this config (random init; `device="meta"` for shapes)."""
    import torch

    if model_type == "qwen2_5_vl":
        from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig as config_cls
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel as module_cls,
        )
    elif model_type == "qwen3_5":
        from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5VisionConfig as config_cls
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel as module_cls
    elif model_type == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeVisionConfig as config_cls
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel as module_cls
    else:
        raise ValueError(f"model_type {model_type!r} has no vision tower here")
    cfg = config_cls(**{k: v for k, v in vision_config.items() if k != "model_type"})
    # the engine (HF from_pretrained, SGLang's port) runs the tower with SDPA-equivalent attention; the trainer too
    cfg._attn_implementation = "sdpa"
    with torch.device(device) if device else contextlib.nullcontext():
        return module_cls._from_config(cfg, attn_implementation="sdpa")


@lru_cache(maxsize=8)
def _param_shapes(config_json: str, model_type: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    module = vision_module(json.loads(config_json), device="meta", model_type=model_type)
    return tuple((n, tuple(p.shape)) for n, p in module.named_parameters())


def vision_arch(cfg: dict[str, Any], where: str, prefix: str = "visual.") -> VisionArch:
    """VisionArch of a vision-language config.json (`vision_config` and the image token id); `prefix`: where the
    checkpoint holds the tower (Family.vision_prefix)."""
    vc = cfg.get("vision_config")
    if not isinstance(vc, dict):
        raise ValueError(f"{where}: model_type {cfg.get('model_type')!r} needs a vision_config object")
    if "image_token_id" not in cfg:
        raise ValueError(f"{where}: image_token_id is missing (the <|image_pad|> id)")
    config_json = json.dumps(vc, sort_keys=True)
    model_type = cfg["model_type"]
    params = tuple(ParamMap(MCORE_PREFIX + n, (prefix + n,), Layout.REPLICATED, (shape,))
                   for n, shape in _param_shapes(config_json, model_type))
    out_hidden = int(vc.get("out_hidden_size", vc.get("hidden_size")))
    return VisionArch(config_json=config_json, model_type=model_type, image_token_id=int(cfg["image_token_id"]),
                      spatial_merge_size=int(vc.get("spatial_merge_size", 2)), out_hidden_size=out_hidden,
                      params=params)
