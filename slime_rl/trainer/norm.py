"""The trainer's RMSNorm: the engine's rounding, bit for bit, with a fused-style backward.

In bf16 the loop's trainer runs under megatron's Float16Module, which casts every parameter to bf16,
the norm weights included. torch's RMSNorm then takes its fused kernel (`_fused_rms_norm`: a bf16
input and a bf16 weight), whose sum of squares adds in another order than the engine's norm
(engines/embedded/precision.py `rmsnorm_fp32_weight`, SGLang's `RMSNorm.forward_native`:
`x.float()`, `rsqrt(mean(x^2) + eps)`, times the fp32 weight, one rounding). On SmolLM2-135M
(1xH200, BENCHMARKS.md, 2026-12-02) the same model unwrapped (fp32 norm weights: torch's composite
path, the engine's formula) agreed with the engine's deterministic path to 2e-6, while the loop
(wrapped) stayed at 2.8e-2 whatever the engine's scheduling. With this norm the wrapped trainer
agrees to 2.08e-6 (`precision_gap.py --loop-pack`) and the loop's `train/rollout_logprob_abs_diff`
is 2.8e-6 at step 0 (2026-12-03).

So the forward here is that formula, written out, and the backward is the analytic one (what the
fused kernel's backward computes), saving the input and the per-row 1/rms only, as the fused kernel
does: the formula under autograd would keep three fp32 copies of every norm's input.
"""

from __future__ import annotations

import torch
from torch import Tensor


def rmsnorm_engine_rounding(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> tuple[Tensor, Tensor]:
    """(output, rstd): the engine's RMSNorm (fp32 normalization, times the weight in fp32, one
    rounding to x's dtype) and the per-row 1 / rms [..., 1] in fp32 (float64 stays float64).
    offset 1: a zero-centred weight (Qwen3-Next's norms: times 1 + w, the sum in fp32)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    h = x.to(acc)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * rstd * (weight.to(acc) + offset)).to(x.dtype), rstd


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
        out, rstd = rmsnorm_engine_rounding(x, weight, eps, offset)
        ctx.save_for_backward(x, weight, rstd)
        ctx.offset = offset
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor) -> tuple[Tensor | None, Tensor | None, None, None]:
        # y = w * n, n = x * r, r = (mean(x^2) + eps)^-1/2:
        # dL/dx = r * (g*w - n * mean(g*w*n)), dL/dw = sum over rows of g*n
        x, weight, rstd = ctx.saved_tensors
        g = grad_out.to(rstd.dtype)
        n = x.to(rstd.dtype) * rstd
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            gn = g * (weight.to(rstd.dtype) + ctx.offset)
            grad_x = (rstd * (gn - n * (gn * n).mean(-1, keepdim=True))).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = (g * n).reshape(-1, n.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_w, None, None


def rms_norm(x: Tensor, weight: Tensor, eps: float, offset: float = 0.0) -> Tensor:
    """RMSNorm over the last dim with the engine's rounding (module docstring); differentiable. offset 1: the
    weight is zero-centred (scales by 1 + w)."""
    return _RMSNormFunction.apply(x, weight, eps, offset)


class TrainerRMSNorm(torch.nn.RMSNorm):
    """The decoder's norms (input, pre-MLP, q/k, final), built as megatron's WrappedTorchNorm builds
    torch's (config, hidden_size, eps), computed by `rms_norm`. Under sequence parallelism each TP
    rank normalizes its own slice of the sequence, so the weight's grad is partial:
    `sequence_parallel = True` makes finalize_model_grads sum it over the TP group. Under megatron's
    layernorm_zero_centered_gamma (Qwen3-Next) the weight is stored as w and scales by 1 + w."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(normalized_shape=hidden_size, eps=eps)
        if config.sequence_parallel:
            self.weight.sequence_parallel = True
        self.offset = 1.0 if getattr(config, "layernorm_zero_centered_gamma", False) else 0.0

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)
