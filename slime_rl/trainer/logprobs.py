"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the full vocabulary.

Each TP rank holds logits [..., V_pad / tp] for the contiguous vocab slice
[tp_rank * V_pad / tp, (tp_rank + 1) * V_pad / tp). Ids >= the true vocab size (padding added so
the vocab splits evenly over TP) are masked to -inf, so they get probability exactly 0 and never
change a log-prob or the entropy. Logits are divided by the sampling temperature first, as the
rollout engine does, so trainer and engine log-probs refer to the same distribution.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from slime_rl.trainer.mcore import mpu, vocab_parallel_cross_entropy


def _tp_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if group is not None:
        return group
    return mpu.get_tensor_model_parallel_group()


def _scaled_masked(logits: Tensor, temperature: float, vocab_size: int | None,
                   group: dist.ProcessGroup) -> Tensor:
    """float32 logits / temperature with padded ids at -inf; always a new tensor (megatron's
    cross entropy works in place on its input)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    out = logits.float() / temperature
    local = logits.shape[-1]
    start = dist.get_rank(group) * local
    if vocab_size is not None and start + local > vocab_size:
        ids = torch.arange(start, start + local, device=logits.device)
        out = out.masked_fill(ids >= vocab_size, float("-inf"))
    return out


def vocab_parallel_logprobs(logits: Tensor, targets: Tensor, *, temperature: float = 1.0,
                            vocab_size: int | None = None,
                            tp_group: dist.ProcessGroup | None = None) -> Tensor:
    """log p(target) under softmax(logits / temperature), differentiable w.r.t. logits.

    logits: [..., V_pad / tp] (this TP rank's shard; any leading shape, e.g. [b, T] or [s, b]);
    targets: [...] global token ids (< vocab_size). Returns float32 [...].
    Uses megatron's vocab_parallel_cross_entropy (all-reduces max, target logit and sum-exp over
    the TP group; its backward is softmax - onehot on the local slice).
    """
    group = _tp_group(tp_group)
    scaled = _scaled_masked(logits, temperature, vocab_size, group)
    return -vocab_parallel_cross_entropy(scaled, targets, tp_group=group)


class _VocabParallelEntropy(torch.autograd.Function):
    """H per position of softmax over the vocab split across `group`; input: float32 scaled logits
    [..., V_local] (padded ids at -inf). With m = max_v l_v (all-reduced), e_v = exp(l_v - m),
    Z = sum_v e_v, S = sum_v e_v * (l_v - m) (both all-reduced): H = log Z - S / Z.
    Backward: dH/dl_v = -p_v * (log p_v + H), local to each shard once H and Z are global."""

    @staticmethod
    def forward(ctx, scaled: Tensor, group: dist.ProcessGroup) -> Tensor:
        m = scaled.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        shifted = scaled - m.unsqueeze(-1)
        e = torch.exp(shifted)
        # padded ids: e = 0 and l = -inf; their term is 0, not 0 * -inf = nan
        finite = torch.isfinite(shifted)
        el = torch.where(finite, e * shifted, torch.zeros_like(e))
        sums = torch.stack([e.sum(dim=-1), el.sum(dim=-1)])
        dist.all_reduce(sums, group=group)
        z, s = sums[0], sums[1]
        h = torch.log(z) - s / z
        ctx.save_for_backward(shifted, z, h)
        return h

    @staticmethod
    def backward(ctx, grad_h: Tensor) -> tuple[Tensor, None]:
        shifted, z, h = ctx.saved_tensors
        logp = shifted - torch.log(z).unsqueeze(-1)
        grad = -torch.exp(logp) * (logp + h.unsqueeze(-1))
        grad = torch.where(torch.isfinite(shifted), grad, torch.zeros_like(grad))
        return grad * grad_h.unsqueeze(-1), None


def vocab_parallel_entropy(logits: Tensor, *, temperature: float = 1.0, vocab_size: int | None = None,
                           tp_group: dist.ProcessGroup | None = None) -> Tensor:
    """Entropy of softmax(logits / temperature) per position: [..., V_pad / tp] -> [...] float32,
    differentiable w.r.t. logits (the entropy bonus of the policy loss); padded ids never count.
    Each TP rank gets the gradient of its own vocab slice (no communication in backward)."""
    group = _tp_group(tp_group)
    return _VocabParallelEntropy.apply(_scaled_masked(logits, temperature, vocab_size, group), group)


def gather_response_logits(logits: Tensor, index: Tensor) -> Tensor:
    """logits [b, s, V_local], index [b, T] (positions whose logits predict response tokens)
    -> [b, T, V_local]; differentiable. Slicing before the softmax keeps memory ~ response size."""
    return torch.gather(logits, 1, index.unsqueeze(-1).expand(-1, -1, logits.shape[-1]))
