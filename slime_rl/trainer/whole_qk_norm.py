"""MiniMax-M2's q/k norms on megatron-core's SelfAttention: one RMSNorm over all heads' channels together.

transformers' MiniMaxM2Attention normalizes each token's query projection as one vector of heads x head_dim
channels (`q_norm`, weight [heads x head_dim]) and its key projection as one of kv heads x head_dim (`k_norm`),
before RoPE; SGLang's MiniMaxM2RMSNormTP does the same from its TP shards (a sum of squares over all of them).
megatron-core 0.19's SelfAttention has per-head norms only (`q_layernorm` / `k_layernorm` on [sq, b, heads,
head_dim]), and with `qk_layernorm` on its finalize_model_grads sums every `q_layernorm` / `k_layernorm` gradient
over the TP group, which is right for per-head weights each rank sees a share of heads of.

`WholeQKNormSelfAttention` keeps megatron's attention (its RoPE, packed sequences, recompute, core attention)
with `qk_layernorm` off and adds the two norms under HF's names (`self_attention.q_norm.weight`,
`self_attention.k_norm.weight`), applied where megatron applies its own: right after the fused projection is split,
before RoPE. Each flattens the heads, gathers the tensor-parallel ranks' heads (megatron's
gather_from_tensor_model_parallel_region: the ranks hold consecutive heads, whole query groups, so the
concatenation is HF's order), normalizes the whole width with the trainer's RMSNorm (norm.py: the engine's
rounding), and keeps this rank's heads (scatter_to_tensor_model_parallel_region). Its backward gathers the
output's gradient from every rank, so each rank computes the whole weight gradient, over the whole sequence (the
attention sees the gathered sequence under sequence parallelism too): the weight is whole on every TP rank with
the same complete gradient, not marked `sequence_parallel` (megatron would sum it over TP).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from slime_rl.trainer.mcore import SelfAttention, tensor_parallel
from slime_rl.trainer.norm import rms_norm


class WholeWidthRMSNorm(torch.nn.RMSNorm):
    """RMSNorm over all heads of [..., heads here, head_dim]: `heads` x `head_dim` channels in all, split over
    `tp` ranks by whole heads (module docstring)."""

    def __init__(self, heads: int, head_dim: int, eps: float, tp: int) -> None:
        super().__init__(normalized_shape=heads * head_dim, eps=eps)
        self.tp = tp

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(*shape[:-2], shape[-2] * shape[-1])
        if self.tp > 1:
            flat = tensor_parallel.gather_from_tensor_model_parallel_region(flat)
        out = rms_norm(flat, self.weight, self.eps)
        if self.tp > 1:
            out = tensor_parallel.scatter_to_tensor_model_parallel_region(out)
        return out.reshape(shape)


class WholeQKNormSelfAttention(SelfAttention):
    """megatron's SelfAttention with MiniMax-M2's q_norm / k_norm over all heads (module docstring)."""

    def __init__(self, config: Any, submodules: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, submodules, *args, **kwargs)
        hd, tp, eps = self.hidden_size_per_attention_head, config.tensor_model_parallel_size, config.layernorm_epsilon
        self.q_norm = WholeWidthRMSNorm(config.num_attention_heads, hd, eps, tp)
        self.k_norm = WholeWidthRMSNorm(config.num_query_groups, hd, eps, tp)

    def get_query_key_value_tensors(self, hidden_states: Tensor, key_value_states: Tensor | None = None,
                                    output_gate: bool = False, split_qkv: bool = True) -> tuple[Tensor, Tensor, Tensor]:
        if output_gate or not split_qkv:
            raise ValueError("MiniMax-M2's whole-width q/k norms need the split query and key (no output gate, no "
                             "fused single qkv RoPE)")
        query, key, value = super().get_query_key_value_tensors(hidden_states, key_value_states)
        return self.q_norm(query), self.k_norm(key), value
