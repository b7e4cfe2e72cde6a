"""Mixture-of-experts models in the built-in engine: the experts under their checkpoint names.

transformers 5 holds a Qwen-MoE layer's routed experts fused, as two 3-D parameters per layer:
`mlp.experts.gate_up_proj` [E, 2 x I, H] (each expert's gate rows, then its up rows: the forward
chunks the product in two, gate first) and `mlp.experts.down_proj` [E, H, I]. The checkpoint, the
hub, SGLang's loader and the trainer's weight sync name them per expert
(`mlp.experts.{e}.gate_proj.weight` [I, H], `up_proj.weight` [I, H], `down_proj.weight` [H, I]), as
transformers' own save_pretrained writes them. Each alias here is a view of the fused parameter
(no copy): a weight update through it writes the model's tensor, and a read returns the live values.

MiniMax-M2's checkpoint names the whole MoE block `block_sparse_moe` (transformers 5 loads it as `mlp`): its
experts' projections w1 (gate), w3 (up), w2 (down) per expert, its router `block_sparse_moe.gate.weight` and
the router's bias `block_sparse_moe.e_score_correction_bias` (a buffer of transformers' `mlp`); each is an
alias of the module's tensor too.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from slime_rl.config.families import FAMILIES

MOE_MODEL_TYPES = tuple(t for t, f in FAMILIES.items() if f.moe)
_FUSED = re.compile(r"^(.*\.mlp\.experts\.)(gate_up_proj|down_proj)$")
# the checkpoint's names of each expert's (gate, up, down) projections, by model_type
_EXPERT_NAMES = {"minimax_m2": ("w1", "w3", "w2")}
_MOE_BLOCK = {"minimax_m2": "block_sparse_moe"}  # the MoE block's checkpoint name where it is not `mlp`


def expert_aliases(params: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
    """{checkpoint name: view of the fused parameter} for every routed expert of an MoE model (and, where the
    checkpoint names the MoE block otherwise, its router and bias: `params` holds the buffers too); {} for any
    other model."""
    model_type = getattr(config, "model_type", None)
    if model_type not in MOE_MODEL_TYPES:
        return {}
    gate_name, up_name, down_name = _EXPERT_NAMES.get(model_type, ("gate_proj", "up_proj", "down_proj"))
    block = _MOE_BLOCK.get(model_type)
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        if block is not None and ".mlp." in name and not _FUSED.match(name):  # the router and its bias
            out[name.replace(".mlp.", f".{block}.", 1)] = p
            continue
        m = _FUSED.match(name)
        if m is None:
            continue
        prefix, kind = m.groups()
        if block is not None:
            prefix = prefix.replace(".mlp.", f".{block}.", 1)
        data = p.detach()  # views without autograd history: written in place by weight updates
        for e in range(data.shape[0]):
            if kind == "gate_up_proj":
                gate, up = data[e].chunk(2, dim=0)
                out[f"{prefix}{e}.{gate_name}.weight"], out[f"{prefix}{e}.{up_name}.weight"] = gate, up
            else:
                out[f"{prefix}{e}.{down_name}.weight"] = data[e]
    return out
