"""--moe-grouped-gemm: an MoE layer's local experts as two grouped matrix products.

megatron-core's grouped experts (TEGroupedMLP) need TransformerEngine, which the trainer does not use; its local
spec's SequentialMLP runs one GEMM per local expert (a loop of E small kernels, twice, per layer and micro-batch).
`GroupedExperts` is SequentialMLP with the same parameters (each expert's `linear_fc1` / `linear_fc2`, so
checkpoints, the HF name maps and weight sync are unchanged) whose forward stacks the local experts' weights
and computes every expert's tokens in one `torch._grouped_mm` per projection: the dispatcher hands the tokens
sorted by local expert (`tokens_per_expert` of each), which is what a grouped product's offsets describe.

The math is megatron's MLP for our config (no bias, SwiGLU as `silu(gate) * up` of the two halves of this rank's
fc1 output, the routing probabilities applied after the activation in the activation's dtype):
    out_e = ((silu(x_e W1g_e^T) * (x_e W1u_e^T)) * p_e) W2_e^T
Any other setting (biases, another activation, fp8, probabilities on the input) takes SequentialMLP's forward, as
does fp32 on CUDA (its grouped kernel is bf16); on the CPU both dtypes run grouped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from slime_rl.trainer.mcore import SequentialMLP


class GroupedExperts(SequentialMLP):
    """SequentialMLP whose forward is two grouped products (module docstring)."""

    def _grouped(self) -> bool:
        c = self.config
        return (hasattr(torch, "_grouped_mm") and not c.add_bias_linear and c.gated_linear_unit
                and c.activation_func is F.silu and not c.moe_apply_probs_on_input and not (c.fp8 or c.fp4)
                and getattr(c, "activation_func_clamp_value", None) is None
                and not getattr(c, "glu_linear_offset", 0.0) and not c.use_te_activation_func
                and not c.bias_activation_fusion)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not self._grouped():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        x = permuted_local_hidden_states
        if x.is_cuda and x.dtype != torch.bfloat16:  # CUDA's grouped kernel is bf16 (Hopper); fp32 loops
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        counts = torch.as_tensor(tokens_per_expert, device=x.device)
        offs = torch.cumsum(counts, dim=0).to(torch.int32)
        w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E, 2I, H]
        w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E, H, I]
        h = torch._grouped_mm(x, w1.transpose(1, 2), offs=offs)  # [T, 2I]
        gate, up = torch.chunk(h, 2, dim=-1)
        inter = F.silu(gate) * up
        inter = (inter * permuted_probs.unsqueeze(-1)).to(inter.dtype)
        out = torch._grouped_mm(inter, w2.transpose(1, 2), offs=offs)  # [T, H]
        return _contiguous_grad(out), None


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: torch._grouped_mm's backward on the CPU
    (torch 2.14) rejects an expanded gradient (strides 0, as `sum().backward()` gives)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _contiguous_grad(x: torch.Tensor) -> torch.Tensor:
    return _ContiguousGrad.apply(x)
