"""GLM-4's norms after attention and after the MLP on megatron-core's TransformerLayer.

transformers' Glm4DecoderLayer normalizes the attention's output (`post_self_attn_layernorm`) and the MLP's
(`post_mlp_layernorm`), each before its residual add:
    h = x + post_self_attn_layernorm(attn(input_layernorm(x)))
    y = h + post_mlp_layernorm(mlp(post_attention_layernorm(h)))
megatron-core 0.19's TransformerLayer has no such norms: it hands each output to its bias-dropout-add
(`self_attn_bda`, `mlp_bda`: `(output, bias), residual, dropout -> residual + dropout(output + bias)`). This
layer holds the two norms under HF's names (`decoder.layers.{i}.post_self_attn_layernorm.weight`, ...) and
puts each in front of megatron's own bias-dropout-add: the output (plus its bias, where a linear has one; GLM-4's
o_proj and down_proj have none) is normalized, then added to the residual as megatron adds it. Everything else
(the recompute, sequence-parallel and pipeline paths) stays megatron's.

The norms are the trainer's RMSNorm (norm.py). Under sequence parallelism each TP rank normalizes its own slice
of the sequence (the attention's and MLP's outputs are reduce-scattered before the add), so each weight's
gradient is partial per rank and marked `sequence_parallel` for finalize_model_grads to sum over TP, as megatron
does for its own norms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from slime_rl.trainer.mcore import TransformerLayer
from slime_rl.trainer.norm import TrainerRMSNorm

BiasDropoutAdd = Callable[[tuple[Tensor, Tensor | None], Tensor, float], Tensor]


def _normed(bda: BiasDropoutAdd, norm: TrainerRMSNorm) -> BiasDropoutAdd:
    def apply(x_with_bias: tuple[Tensor, Tensor | None], residual: Tensor, prob: float) -> Tensor:
        x, bias = x_with_bias
        if bias is not None:
            x = x + bias
        return bda((norm(x), None), residual, prob)

    return apply


class PostNormTransformerLayer(TransformerLayer):
    """megatron's TransformerLayer with `post_self_attn_layernorm` and `post_mlp_layernorm` (module docstring).
    The bias-dropout-adds are bound methods (not closures over the norms), so a deep copy of the model normalizes
    with its own copies."""

    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        self.post_self_attn_layernorm = TrainerRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
        self.post_mlp_layernorm = TrainerRMSNorm(config, config.hidden_size, eps=config.layernorm_epsilon)
        self._megatron_attn_bda, self._megatron_mlp_bda = self.self_attn_bda, self.mlp_bda
        self.self_attn_bda, self.mlp_bda = self._attn_bda, self._mlp_bda

    def _attn_bda(self, training: bool, fused: bool) -> BiasDropoutAdd:
        return _normed(self._megatron_attn_bda(training, fused), self.post_self_attn_layernorm)

    def _mlp_bda(self, training: bool, fused: bool) -> BiasDropoutAdd:
        return _normed(self._megatron_mlp_bda(training, fused), self.post_mlp_layernorm)
