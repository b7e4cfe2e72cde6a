"""Mixture-of-experts models in the built-in engine: the experts under their checkpoint names.

transformers 5 holds a Qwen-MoE layer's routed experts fused, as two 3-D parameters per layer:
`mlp.experts.gate_up_proj` [E, 2 x I, H] (each expert's gate rows, then its up rows: the forward
chunks the product in two, gate first) and `mlp.experts.down_proj` [E, H, I]. The checkpoint, the
hub, SGLang's loader and the trainer's weight sync name them per expert
(`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj.weight` [I, H], `down_proj.weight` [H, I]), as
transformers' own save_pretrained writes them. Each alias here is a view of the fused parameter
(no copy): a weight update through it writes the model's tensor, and a read returns the live values.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from slime_rl.config.families import FAMILIES

MOE_MODEL_TYPES = tuple(t for t, f in FAMILIES.items() if f.moe)
_FUSED = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")


def expert_aliases(params: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """{checkpoint name: view of the fused parameter} for every routed expert of a Qwen-MoE model;
    {} for any other model."""
    if getattr(config, "model_type", None) not in MOE_MODEL_TYPES:
        return {}
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        m = _FUSED.match(name)
        if m is None:
            continue
        prefix, kind = m.groups()
        data = p.detach()  # views without autograd history: written in place by weight updates
        for e in range(data.shape[0]):
            if kind == "gate_up_proj":
                gate, up = data[e].chunk(2, dim=0)
                out[f"{prefix}{e}.gate_proj.weight"], out[f"{prefix}{e}.up_proj.weight"] = gate, up
            else:
                out[f"{prefix}{e}.down_proj.weight"] = data[e]
    return out
