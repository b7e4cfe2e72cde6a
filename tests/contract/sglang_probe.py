"""An SGLang model class with its own `load_weights` whose parameters are stand-ins that record each
`weight_loader` call (target parameter, loaded shape, shard arguments): what SGLang would load, and
where, for the names weight sync sends, without SGLang's kernels."""

from __future__ import annotations

import types

import torch


def recording_probe(model_cls: type, config, param_names: list[str], num_layers: int) -> torch.nn.Module:
    """An instance of a subclass of `model_cls` (e.g. SGLang's Qwen3MoeForCausalLM) holding one
    recording parameter per SGLang parameter name; `probe.calls` lists (name, shape, args, kwargs)."""

    class Probe(model_cls):
        def __init__(self) -> None:
            torch.nn.Module.__init__(self)
            self.config = config
            self.model = types.SimpleNamespace(start_layer=0, end_layer=num_layers)
            self.calls: list[tuple] = []
            self._names = {}
            for k, name in enumerate(param_names):
                p = torch.nn.Parameter(torch.zeros(1), requires_grad=False)
                p.weight_loader = self._recorder(name)
                self.register_parameter(f"p{k}", p)
                self._names[f"p{k}"] = name

        def named_parameters(self, *args, **kwargs):
            for key, p in super().named_parameters(*args, **kwargs):
                yield self._names[key], p

        def _recorder(self, param_name: str):
            def load(param, loaded_weight, *args, **kwargs):
                self.calls.append((param_name, tuple(loaded_weight.shape), args, kwargs))
            return load

    return Probe()


def calls_by_target(probe: torch.nn.Module) -> dict[str, list[tuple]]:
    """`probe.calls` grouped by the SGLang parameter each loaded: name -> [(shape, args, kwargs), ...], in call
    order."""
    out: dict[str, list[tuple]] = {}
    for param, shape, args, kwargs in probe.calls:
        out.setdefault(param, []).append((shape, args, kwargs))
    return out


def sglang_qwen3_vision_names(depth: int) -> list[str]:
    """SGLang 0.5.23's vision tower parameters of Qwen3.5 (models/qwen3_vl.py's Qwen3VLMoeVisionModel, the `visual`
    of Qwen3_5(Moe)ForConditionalGeneration) with `depth` blocks and no DeepStack mergers, written out from its
    modules: the Conv3d patch embedding and the position table, per block two LayerNorms, VisionAttention's qkv_proj
    and proj and the MLP's linear_fc1 / fc2 (all with biases), the merger's LayerNorm and two linears."""
    wb = (".weight", ".bias")
    names = [f"visual.patch_embed.proj{x}" for x in wb] + ["visual.pos_embed.weight"]
    for i in range(depth):
        for module in ("norm1", "norm2", "attn.qkv_proj", "attn.proj", "mlp.linear_fc1", "mlp.linear_fc2"):
            names += [f"visual.blocks.{i}.{module}{x}" for x in wb]
    for module in ("norm", "linear_fc1", "linear_fc2"):
        names += [f"visual.merger.{module}{x}" for x in wb]
    return names
