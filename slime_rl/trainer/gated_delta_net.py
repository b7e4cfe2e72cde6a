"""megatron-core's GatedDeltaNet (Qwen3-Next's linear attention) without flash-linear-attention.

megatron-core 0.19.2's GatedDeltaNet takes three functions from `fla` (flash-linear-attention: Triton kernels, GPU
only): `causal_conv1d`, `l2norm` and `chunk_gated_delta_rule`, and refuses to build when `fla` does not import
(`common.HAVE_FLA`). Where `fla` is installed (the GPU images) megatron runs as it is. Where it is not (the CPU
trainer), `install()` gives megatron torch implementations of the three in their places:

  * `causal_conv1d`: the depthwise causal convolution of each sequence ([b, s, d], weight [d, w]; a packed batch's
    sequences each from zeros, cu_seqlens), then the activation (silu), as fla's;
  * `l2norm`: x / sqrt(sum(x^2) + 1e-6) over the last dim, fla's formula;
  * `chunk_gated_delta_rule`: megatron's own `torch_chunk_gated_delta_rule` (its deterministic path, fp32 inside),
    once per packed sequence.

The GatedDeltaNet's output norm (`GatedDeltaNetOutNorm`) scales by w (HF's Qwen3NextRMSNormGated), not by 1 + w as
the decoder's zero-centred norms do; each TP rank applies it to its own heads, so its gradient is summed over TP in
the backward (megatron sums a norm's gradient only under sequence parallelism, or for names it knows).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import Tensor

from slime_rl.trainer.norm import TrainerRMSNorm, rms_norm

log = logging.getLogger(__name__)


def causal_conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, activation: str | None = None,
                  initial_state: Tensor | None = None, output_final_state: bool = False,
                  cu_seqlens: Tensor | None = None, **_unused) -> tuple[Tensor, None]:
    """fla's causal_conv1d on torch: x [b, s, d], weight [d, w] -> ([b, s, d], None)."""
    if initial_state is not None or output_final_state:
        raise NotImplementedError("causal_conv1d on torch: no recurrent state (the trainer runs whole sequences)")
    width = weight.shape[-1]

    def conv(seq: Tensor) -> Tensor:  # [b, n, d] -> [b, n, d]
        n = seq.shape[1]
        out = F.conv1d(seq.transpose(1, 2), weight.unsqueeze(1), bias, padding=width - 1, groups=weight.shape[0])
        return out[..., :n].transpose(1, 2)

    if cu_seqlens is None:
        out = conv(x)
    else:
        bounds = [int(b) for b in cu_seqlens.tolist()]
        out = torch.cat([conv(x[:, s:e]) for s, e in zip(bounds[:-1], bounds[1:], strict=True)], dim=1)
    if activation in ("silu", "swish"):
        out = F.silu(out)
    elif activation is not None:
        raise ValueError(f"causal_conv1d on torch: activation {activation!r} (silu only)")
    return out, None


def l2norm(x: Tensor, eps: float = 1e-6, **_unused) -> Tensor:
    """fla's l2norm over the last dim."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                           initial_state: Tensor | None = None, output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens: Tensor | None = None,
                           **_unused) -> tuple[Tensor, None]:
    """fla's chunk_gated_delta_rule by megatron's torch_chunk_gated_delta_rule: q/k [b, s, h, dk], v [b, s, h, dv],
    g/beta [b, s, h] -> ([b, s, h, dv], None); each packed sequence (cu_seqlens, b = 1) on its own."""
    from slime_rl.trainer.mcore import torch_chunk_gated_delta_rule

    if initial_state is not None or output_final_state:
        raise NotImplementedError("chunk_gated_delta_rule on torch: no recurrent state (whole sequences)")
    if scale is not None and scale != q.shape[-1] ** -0.5:
        raise NotImplementedError(f"chunk_gated_delta_rule on torch: scale {scale} (1 / sqrt(head width) only)")

    def run(sl: slice) -> Tensor:
        out, _ = torch_chunk_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        return out

    if cu_seqlens is None:
        return run(slice(None)), None
    bounds = [int(b) for b in cu_seqlens.tolist()]
    return torch.cat([run(slice(s, e)) for s, e in zip(bounds[:-1], bounds[1:], strict=True) if e > s], dim=1), None


def install() -> bool:
    """Give megatron's GatedDeltaNet the torch functions above where `fla` does not import; True when installed
    (False: fla is there and megatron uses it)."""
    from slime_rl.trainer.mcore import gated_delta_net_common as common
    from slime_rl.trainer.mcore import gated_delta_net_module as gdn

    if common.HAVE_FLA and common.chunk_gated_delta_rule is not chunk_gated_delta_rule:
        return False
    if torch.cuda.is_available():
        log.warning("flash-linear-attention (fla) is not installed: the Gated DeltaNet layers run on torch "
                    "(pip install flash-linear-attention for its kernels)")
    common.HAVE_FLA = True
    common.causal_conv1d, common.l2norm, common.chunk_gated_delta_rule = causal_conv1d, l2norm, chunk_gated_delta_rule
    gdn.causal_conv1d, gdn.chunk_gated_delta_rule = causal_conv1d, chunk_gated_delta_rule
    return True


class GatedDeltaNetOutNorm(TrainerRMSNorm):
    """The GatedDeltaNet's output norm over one value head's channels: times w (not zero-centred), its gradient
    summed over the TP group in the backward (each rank normalizes its own heads)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused) -> None:
        super().__init__(config, hidden_size, eps)
        self.offset = 0.0
        if hasattr(self.weight, "sequence_parallel"):  # summed here, not again by finalize_model_grads
            del self.weight.sequence_parallel
        self.tp_size = config.tensor_model_parallel_size

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if self.tp_size > 1:
            from slime_rl.trainer.mcore import copy_to_tensor_model_parallel_region

            weight = copy_to_tensor_model_parallel_region(weight)
        return rms_norm(x, weight, self.eps, self.offset)
