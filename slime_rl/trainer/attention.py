"""Core attention for the local (non-TransformerEngine) layer spec, on torch SDPA, with THD packing.

megatron-core 0.19.2's local `DotProductAttention` asserts `packed_seq_params is None` (packed
sequences are TE-only there) and materializes the [b, np, s, s] score matrix. `SDPACoreAttention`
takes its place as `submodules.core_attention` (same constructor, same forward signature):
  * BSHD (right-padded micro-batches): one `scaled_dot_product_attention(is_causal=True)` call,
    so on GPU torch picks the flash / memory-efficient backend (issue 3's fast attention path);
  * THD (packed, `packed_seq_params.qkv_format == "thd"`): every sample attends only to itself.
    On CUDA with torch's `varlen_attn` (torch >= 2.11, flash kernel) one call over the pack;
    otherwise on CUDA (fp32, dropout, older torch) one causal SDPA call over the samples right-padded
    (`padded_causal`), on CPU one call per sample of the pack (`looped_causal`).
  * context parallel (cp > 1, context_parallel.py's layout): K and V are all-gathered over the CP
    group and an explicit mask by global positions keeps attention causal; THD packs loop over
    samples (each split into 2 * cp chunks). The explicit mask rules out the flash backend (SDPA
    picks the memory-efficient one on GPU).
Query/key/value arrive after RoPE (SelfAttention applies it per packed sample from cu_seqlens).
Shapes (per TP rank): BSHD q [s, b, np, hn], k/v [s, b, ng, hn] -> [s, b, np * hn];
THD q [t, np, hn], k/v [t, ng, hn] -> [t, np * hn] (SelfAttention reshapes to [t, 1, h]).
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from slime_rl.trainer.context_parallel import all_gather_seq, local_positions
from slime_rl.trainer.mcore import MegatronModule, ProcessGroupCollection


def looped_causal(sdpa: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor,
                  bounds: list[int]) -> Tensor:
    """Causal attention of each packed sample on its own: q [t, np, hn], k/v [t, ng, hn], sample i is
    tokens bounds[i]:bounds[i + 1] (bounds[-1] == t); `sdpa` maps [b, h, s, hn] q/k/v to [b, np, s, hn]
    causally. One call per sample. -> [t, np, hn]."""
    outs = []
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            sl = slice(start, end)  # [n, h, d] -> [1, h, n, d]
            outs.append(sdpa(q[sl].transpose(0, 1)[None], k[sl].transpose(0, 1)[None],
                             v[sl].transpose(0, 1)[None])[0].transpose(0, 1))
    return torch.cat(outs, dim=0)


def padded_causal(sdpa: Callable[[Tensor, Tensor, Tensor], Tensor], q: Tensor, k: Tensor, v: Tensor,
                  bounds: list[int]) -> Tensor:
    """`looped_causal` in one call: the samples right-padded to the longest ([b, h, s, hn]); causal
    attention keeps each real token off the padding after it, and the padding's outputs are dropped."""
    dev = q.device
    lens = torch.tensor([e - s for s, e in zip(bounds[:-1], bounds[1:], strict=True)], device=dev)
    row = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens)
    col = torch.arange(q.shape[0], device=dev) - torch.tensor(bounds[:-1], device=dev)[row]
    width = int(lens.max())

    def pad(x: Tensor) -> Tensor:  # [t, h, d] -> [b, h, s, d]
        return x.new_zeros(len(lens), width, *x.shape[1:]).index_put((row, col), x).transpose(1, 2)

    return sdpa(pad(q), pad(k), pad(v)).transpose(1, 2)[row, col]


@functools.cache
def varlen() -> tuple[Callable, dict, bool] | None:
    """torch's variable-length flash attention (torch >= 2.11, CUDA only), how it is called causally
    (torch 2.11 spells it `is_causal=True`, later versions a (left, right) window) and whether it takes
    `enable_gqa` (torch 2.11's has none, seen on the H200 machines: k/v heads are expanded there).
    Imported on first use: its module imports torch._dynamo, ~0.5 s of CPU in every rank start."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # pragma: no cover - depends on the torch build
        return None
    params = set(inspect.signature(varlen_attn).parameters)
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


class SDPACoreAttention(MegatronModule):
    """Drop-in for megatron's DotProductAttention (see the module docstring)."""

    def __init__(self, config, layer_number: int, attn_mask_type, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None) -> None:
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        tp = pg_collection.tp.size()
        self.cp_group = getattr(pg_collection, "cp", None) if config.context_parallel_size > 1 else None
        self.cp_size = config.context_parallel_size
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        # multi-latent attention gives its query/key and value widths (and its softmax scale)
        self.head_dim = k_channels or config.kv_channels
        self.v_dim = v_channels or self.head_dim
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _sdpa(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
        """q [b, np, s, hn], k/v [b, ng, s, hn] -> [b, np, s, hn]; causal unless a mask is given."""
        dropout = self.dropout_p if self.training else 0.0
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True,
                                                  scale=self.softmax_scale, enable_gqa=self.heads != self.groups)
        if self.heads != self.groups:  # an explicit mask with GQA: expand k/v (enable_gqa + mask
            k = k.repeat_interleave(self.heads // self.groups, dim=1)  # is not on every backend)
            v = v.repeat_interleave(self.heads // self.groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                              scale=self.softmax_scale)

    def _thd(self, q: Tensor, k: Tensor, v: Tensor, packed_seq_params) -> Tensor:
        cu_q = packed_seq_params.cu_seqlens_q
        cu_k = packed_seq_params.cu_seqlens_kv if packed_seq_params.cu_seqlens_kv is not None else cu_q
        assert torch.equal(cu_q, cu_k), "self-attention packs need cu_seqlens_q == cu_seqlens_kv"
        flash = varlen() if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and self.dropout_p == 0.0 else None
        if flash is not None:
            varlen_attn, causal, takes_gqa = flash
            gqa = self.heads != self.groups
            kwargs = dict(causal)
            if gqa and takes_gqa:
                kwargs["enable_gqa"] = True
            elif gqa:  # [t, ng, hn] -> [t, np, hn]: query head i reads kv head i // (np / ng)
                k = k.repeat_interleave(self.heads // self.groups, dim=1)
                v = v.repeat_interleave(self.heads // self.groups, dim=1)
            return varlen_attn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32),
                                int(packed_seq_params.max_seqlen_q), int(packed_seq_params.max_seqlen_kv),
                                scale=self.softmax_scale, **kwargs)
        # tokens past cu[-1] (pack padding) attend causally among themselves, their outputs are never read
        bounds = cu_q.tolist()
        if bounds[-1] < q.shape[0]:
            bounds.append(q.shape[0])
        sdpa = functools.partial(self._sdpa, mask=None)
        # CUDA without the varlen kernel (fp32, dropout): the samples right-padded into one SDPA call (with
        # one call per sample an fp32 train step of 128 samples took 5.0 s on an H200, and 0.4 s with
        # right-padded micro-batches, --no-pack-sequences; 2026-12-03); CPU: one call per sample
        return (padded_causal if q.is_cuda else looped_causal)(sdpa, q, k, v, bounds)

    def _cp_bshd(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """q [b, np, s, hn], k/v [b, ng, s, hn] of this CP rank's chunks -> [b, np, s, hn]."""
        s, rank = q.shape[2], self.cp_group.rank()
        full = s * self.cp_size
        q_pos = local_positions(full, self.cp_size, rank).to(q.device)
        # gathered keys come in rank order: rank j's chunks j and 2cp-1-j; the mask takes them as they are
        k_pos = torch.cat([local_positions(full, self.cp_size, j) for j in range(self.cp_size)]).to(q.device)
        k, v = (all_gather_seq(x.permute(2, 0, 1, 3), self.cp_group).permute(1, 2, 0, 3) for x in (k, v))
        return self._sdpa(q, k, v, k_pos.unsqueeze(0) <= q_pos.unsqueeze(1))

    def _cp_thd(self, q: Tensor, k: Tensor, v: Tensor, packed_seq_params) -> Tensor:
        """q [t, np, hn], k/v [t, ng, hn] (t = this rank's share of the pack) -> [t, np, hn];
        cu_seqlens are the global (padded) sample bounds, each a multiple of 2 * cp."""
        cu = packed_seq_params.cu_seqlens_q.tolist()
        t, rank = q.shape[0], self.cp_group.rank()
        kg, vg = (all_gather_seq(x, self.cp_group).view(self.cp_size, t, *x.shape[1:]) for x in (k, v))
        outs = []
        for start, end in zip(cu[:-1], cu[1:], strict=True):
            n = end - start
            if n == 0:
                continue
            sl = slice(start // self.cp_size, end // self.cp_size)  # the sample's local slice
            q_pos = local_positions(n, self.cp_size, rank).to(q.device)
            k_pos = torch.cat([local_positions(n, self.cp_size, j) for j in range(self.cp_size)]).to(q.device)
            ks, vs = (x[:, sl].reshape(-1, *x.shape[2:]) for x in (kg, vg))  # rank-ordered chunks
            out = self._sdpa(q[sl].transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
                             k_pos.unsqueeze(0) <= q_pos.unsqueeze(1))
            outs.append(out[0].transpose(0, 1))
        return torch.cat(outs, dim=0)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None,
                packed_seq_params=None) -> Tensor:
        assert attention_bias is None, "attention bias is not supported by SDPACoreAttention"
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            if self.cp_group is not None:
                out = self._cp_thd(query, key, value, packed_seq_params)
            else:
                out = self._thd(query, key, value, packed_seq_params)  # [t, np, hn]
            return out.reshape(out.shape[0], -1)
        assert packed_seq_params is None, f"qkv_format {packed_seq_params.qkv_format!r} is not supported"
        # megatron's masks are True where attention is NOT allowed; SDPA's bool masks the opposite
        mask = None if attention_mask is None else ~attention_mask.bool()
        s, b = query.shape[:2]
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [s, b, h, d] -> [b, h, s, d]
        if self.cp_group is not None:
            assert mask is None, "context parallel attention builds its own causal mask"
            out = self._cp_bshd(q, k, v)
        else:
            out = self._sdpa(q, k, v, mask)  # [b, np, s, hn]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v_dim)
