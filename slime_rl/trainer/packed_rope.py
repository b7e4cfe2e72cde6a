"""RoPE for packed (THD) sequences without host synchronisation.

megatron-core 0.19's `_apply_rotary_pos_emb_thd` splits the packed row per sample: it reads the
sequence lengths to the host (`.tolist()` and `.item()`: two device syncs) and launches a handful of
small kernels per sample, for q and for k, in every layer. On an H200 that was ~900 host syncs per
training step of the 1.5B MFU bench (bench/train_mfu.py). Without context parallelism the same
result is one gather: token i of a sample starting at offset s gets `freqs[i - s]` (or `freqs[i]`
when megatron was given per-token frequencies for the whole packed row), then the usual [s, b, h, d]
rotation. With CP > 1 megatron's own (looping) function runs, since each rank holds two chunks per
sample.

`install()` replaces the module-level function that `apply_rotary_pos_emb` calls; it is idempotent
and keeps the original for CP and as the test reference.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from slime_rl.trainer.mcore import rope_utils

_ORIGINAL: Any = None


def packed_positions(cu_seqlens: Tensor, total: int) -> Tensor:
    """Position of every packed token inside its own sample ([total], int64), on the device of
    `cu_seqlens`, with no host sync (`output_size` tells repeat_interleave the length)."""
    cu = cu_seqlens.to(torch.int64)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=total)
    return torch.arange(total, device=cu.device) - starts


def apply_rotary_pos_emb_thd(t: Tensor, cu_seqlens: Tensor, freqs: Tensor, rotary_interleaved: bool = False,
                             mla_rotary_interleaved: bool = False, mscale: float = 1.0, cp_group: Any = None,
                             multi_latent_attention: bool | None = None) -> Tensor:
    """Same contract as megatron's `_apply_rotary_pos_emb_thd`: t [T, h, d], cu_seqlens [b + 1],
    freqs [max_s, 1, 1, d] (positions restart at 0 per sample) or [T, 1, 1, d] (one per packed token)."""
    if cp_group is not None and cp_group.size() > 1:
        return _ORIGINAL(t, cu_seqlens, freqs, rotary_interleaved=rotary_interleaved,
                         mla_rotary_interleaved=mla_rotary_interleaved, mscale=mscale, cp_group=cp_group,
                         multi_latent_attention=multi_latent_attention)
    if multi_latent_attention is not None:
        mla_rotary_interleaved = multi_latent_attention
    total = t.shape[0]
    # megatron: per-token frequencies when their count equals cu_seqlens[-1], which is T without CP
    per_token = freqs if freqs.size(0) == total else freqs[packed_positions(cu_seqlens, total).to(freqs.device)]
    return rope_utils._apply_rotary_pos_emb_bshd(t.unsqueeze(1), per_token, rotary_interleaved=rotary_interleaved,
                                                 mla_rotary_interleaved=mla_rotary_interleaved,
                                                 mscale=mscale).squeeze(1)


def install() -> None:
    """Route megatron's THD RoPE through `apply_rotary_pos_emb_thd` (once per process)."""
    global _ORIGINAL
    if rope_utils._apply_rotary_pos_emb_thd is apply_rotary_pos_emb_thd:
        return
    _ORIGINAL = rope_utils._apply_rotary_pos_emb_thd
    rope_utils._apply_rotary_pos_emb_thd = apply_rotary_pos_emb_thd
