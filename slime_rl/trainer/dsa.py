"""DeepSeek Sparse Attention (GLM-5's glm_moe_dsa) as the core attention of megatron's MLASelfAttention, in torch.

Each query attends only to the `index_topk` keys (of its own sample, causally) that a lightning indexer scores
highest; with fewer keys than that before it, it attends to all of them, as dense MLA does. The indexer of a layer
(HF `self_attn.indexer`): a query per indexer head from the normalized query latent (wq_b), one key per token from
the layer's input (wk, then a LayerNorm with bias, eps 1e-6), the first qk_rope_head_dim channels of both rotated by
interleaved RoPE at the token's position in its sample; score(t, s) = sum over heads h of
weights_proj(x_t)_h / sqrt(heads) * relu(q_th . k_s / sqrt(index_head_dim)). A "shared" layer (GLM-5.2's
index_topk_freq / index_skip_topk_offset; transformers' indexer_types) has no indexer and reuses the selection of the
last full layer before it; a pipeline stage therefore starts on a full layer, as slime's GLM-5
provider requires (convert/arch.py's `check_dsa_stages`, run by preflight and the model build).

The indexer is not trained. Its output is a choice of keys (integer indices), through which no gradient flows: in
transformers' GlmMoeDsaIndexer (`torch.no_grad`), in slime's GLM-5 provider (its inputs detached, only the top-k
indices used, no indexer loss: slime's RL recipe keeps it frozen with --freeze-indexer) and here. Its parameters are
frozen (requires_grad False): outside the optimizer, so weight decay does not move them either, and weight sync sends
them with the first sync only (as a frozen vision tower). Megatron's own DSAttention trains the indexer with a KL
loss against the attention's scores; slime does not, nor does this.

Computed in float32 (the indexer's weights cast, as transformers computes its scores in float32), one sample at a time
(packed THD: by cu_seqlens; padded BSHD: by row), with an explicit [tokens, tokens] mask: the CPU path, whose memory
grows with the square of a sample's length (the indexer's scores are taken a block of queries at a time, the mask and
SDPA's scores are not); long-context training on GPUs wants sparse kernels (slime's GLM-5 provider uses tilelang's
indexer and sparse MLA), which this path does not use. SGLang's
indexer rotates q and k by a Hadamard transform (scaled to be orthonormal) before its FP8 cache; an orthonormal
rotation of both leaves q . k unchanged, so the scores here are the same without it. Under sequence parallelism the
indexer's inputs (this rank's tokens) are gathered over the TP group first. Under context parallelism
(context_parallel.py's layout: each CP rank two chunks of every sample) the keys, the values and the indexer's
inputs are gathered over the CP group, and each rank's queries choose among the whole sample's keys by global
position, as SDPACoreAttention's context-parallel path attends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from slime_rl.trainer.attention import SDPACoreAttention
from slime_rl.trainer.context_parallel import all_gather_seq, local_positions
from slime_rl.trainer.mcore import gather_from_sequence_parallel_region

# the indexer key's LayerNorm epsilon (transformers' GlmMoeDsaIndexer and SGLang's Indexer: fixed, not in config.json)
K_NORM_EPS = 1e-6
# where a shared layer finds its source layer's selection: an attribute of the micro-batch's PackedSeqParams (the same
# object in a recomputed forward, another in the next micro-batch), or of the source module for padded batches (the last
# forward's: preflight refuses padded micro-batches with activation recompute under pipeline parallelism, where 1F1B
# runs a later micro-batch's forward before an earlier one's recomputed backward)
_HOLDER = "_slime_rl_dsa_topk"


class DSAIndexer(torch.nn.Module):
    """The lightning indexer's tensors, under HF's names (wq_b, wk, k_norm, weights_proj)."""

    def __init__(self, hidden: int, q_lora: int, heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.wq_b = torch.nn.Linear(q_lora, heads * head_dim, bias=False, **kw)
        self.wk = torch.nn.Linear(hidden, head_dim, bias=False, **kw)
        self.k_norm = torch.nn.LayerNorm(head_dim, eps=K_NORM_EPS, **kw)
        self.weights_proj = torch.nn.Linear(hidden, heads, bias=False, **kw)
        for p in self.parameters():
            p.requires_grad_(False)


def _rotate_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """RoPE on pairs (x[2j], x[2j + 1]); the output holds the rotated even channels, then the odd ones (the same
    order for queries and keys, so their products are those of the rotation in place). x [t, ..., r], cos/sin
    [t, r / 2] broadcast over the middle dimensions."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    cos, sin = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class DSACoreAttention(SDPACoreAttention):
    """SDPACoreAttention restricted to the keys the indexer chooses (see the module docstring). megatron's
    MLASelfAttention passes the layer's input `x` and the normalized query latent `qr` to a core attention that says
    `requires_dsa_inputs`."""

    requires_dsa_inputs = True

    def __init__(self, config, layer_number: int, *args, **kwargs) -> None:
        super().__init__(config, layer_number, *args, **kwargs)
        dsa = config.slime_rl_dsa
        self.topk = dsa["index_topk"]
        self.index_heads, self.index_head_dim = dsa["index_heads"], dsa["index_head_dim"]
        self.rope_dim, self.rotary_base = config.qk_pos_emb_head_dim, config.rotary_base
        self.sequence_parallel = config.sequence_parallel
        self.layer = layer_number - 1  # global, from 0
        full = dsa["indexer_layers"]
        self.source = max(i for i in range(self.layer + 1) if full[i])  # the full layer whose selection this uses
        self.indexer = None
        if self.source == self.layer:
            device = torch.cuda.current_device() if torch.cuda.is_available() else "cpu"
            self.indexer = DSAIndexer(config.hidden_size, config.q_lora_rank, self.index_heads, self.index_head_dim,
                                      config.params_dtype, device)

    # ---------------------------------------------------------------------------------------------- selection

    def _cos_sin(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        r = self.rope_dim
        inv_freq = 1.0 / (self.rotary_base ** (torch.arange(0, r, 2, dtype=torch.float32, device=pos.device) / r))
        freqs = pos.to(torch.float32)[:, None] * inv_freq[None, :]
        return freqs.cos(), freqs.sin()

    def _rope(self, z: Tensor, pos: Tensor) -> Tensor:
        cos, sin = self._cos_sin(pos)
        return torch.cat([_rotate_interleaved(z[..., :self.rope_dim], cos, sin), z[..., self.rope_dim:]], dim=-1)

    @torch.no_grad()
    def _choose(self, xq: Tensor, qrq: Tensor, pq: Tensor, xk: Tensor, pk: Tensor) -> Tensor:
        """One sample: the [queries, keys] mask of the keys each query attends to, from the queries' layer input xq,
        query latent qrq and positions pq, and the keys' layer input xk and positions pk (positions in the sample)."""
        ix, heads, dim = self.indexer, self.index_heads, self.index_head_dim
        q = self._rope(F.linear(qrq.float(), ix.wq_b.weight.float()).view(-1, heads, dim), pq)
        k = F.layer_norm(F.linear(xk.float(), ix.wk.weight.float()), (dim,), ix.k_norm.weight.float(),
                         ix.k_norm.bias.float(), K_NORM_EPS)
        k = self._rope(k, pk)
        w = F.linear(xq.float(), ix.weights_proj.weight.float()) * heads ** -0.5  # [queries, heads]
        # [queries, heads, keys] scores a block of queries at a time (at most ~2^28 floats)
        block = max(1, (1 << 28) // (heads * k.shape[0]))
        index = torch.cat([torch.einsum("th,ths->ts", w[i:i + block],
                                        F.relu(torch.einsum("thd,sd->ths", q[i:i + block], k) * dim ** -0.5))
                           for i in range(0, q.shape[0], block)])
        causal = pk[None, :] <= pq[:, None]
        index = index.masked_fill(~causal, float("-inf"))
        top = index.topk(min(self.topk, k.shape[0]), dim=-1).indices
        return torch.zeros_like(causal).scatter_(1, top, True) & causal

    def _masks(self, samples: list[tuple], packed_seq_params) -> list[Tensor]:
        """This layer's masks, one per sample: its indexer's, or (a shared layer) its source layer's of this
        micro-batch. `samples`: per sample (xq, qrq, pq, xk, pk) as `_choose` takes them."""
        holder = packed_seq_params
        if self.indexer is None:
            store = getattr(holder, _HOLDER, None) if holder is not None else getattr(self, "_source_module", None)
            masks = store.get(self.source) if isinstance(store, dict) else getattr(store, "_last_masks", None)
            if masks is None:
                raise RuntimeError(f"sparse attention: layer {self.layer} shares the top-k of layer {self.source}, "
                                   "which did not run before it in this forward (a pipeline stage must start on a "
                                   "layer with its own indexer)")
            return masks
        masks = [self._choose(*sample) for sample in samples]
        if holder is not None:
            store = getattr(holder, _HOLDER, None)
            if store is None:
                store = {}
                setattr(holder, _HOLDER, store)
            store[self.layer] = masks
        self._last_masks = masks
        return masks

    def _indexer_inputs(self, x: Tensor, qr: Tensor) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """(x, qr) of this rank's tokens, detached and whole over the TP group (sequence parallelism), and under
        context parallelism both gathered over the CP group (rank-ordered, as the keys are); None without it."""
        if self.indexer is None:
            return x, qr, None, None
        x, qr = x.detach(), qr.detach()
        if self.sequence_parallel:  # this rank's tokens -> the TP group's (the indexer sees every token)
            x, qr = (gather_from_sequence_parallel_region(v) for v in (x, qr))
        if self.cp_group is None:
            return x, qr, None, None
        with torch.no_grad():
            return x, qr, all_gather_seq(x, self.cp_group), all_gather_seq(qr, self.cp_group)

    # ------------------------------------------------------------------------------------------------ forward

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type=None, attention_bias: Tensor | None = None, packed_seq_params=None,
                x: Tensor | None = None, qr: Tensor | None = None) -> Tensor:
        assert attention_bias is None, "attention bias is not supported by DSACoreAttention"
        cp, dev = self.cp_size if self.cp_group is not None else 1, query.device
        rank = self.cp_group.rank() if cp > 1 else 0
        x, qr, xg, _ = self._indexer_inputs(x, qr)
        if cp > 1:  # keys and values of the whole sequence, in rank order (backward: summed onto their owners)
            kg, vg = (all_gather_seq(z, self.cp_group) for z in (key, value))
        if packed_seq_params is not None:
            assert packed_seq_params.qkv_format == "thd", f"qkv_format {packed_seq_params.qkv_format!r}"
            t = query.shape[0]  # q [t, np, hn], k [t, np, hn], v [t, np, hv]; x [t, 1, h], qr [t, q_lora]
            x, qr = x.reshape(t, -1), qr.reshape(t, -1)
            bounds = packed_seq_params.cu_seqlens_q.tolist()
            if cp == 1 and bounds[-1] < t:  # pack padding: a sample of its own, never read
                bounds.append(t)
            rows, samples = [], []
            for start, end in zip(bounds[:-1], bounds[1:], strict=True):
                n = end - start
                if n == 0:
                    continue
                if cp == 1:
                    sl, pq = slice(start, end), torch.arange(n, device=dev)
                    rows.append((query[sl], key[sl], value[sl]))
                    samples.append((x[sl], qr[sl], pq, x[sl], pq))
                    continue
                sl = slice(start // cp, end // cp)  # the sample's local slice (its two chunks)
                pq = local_positions(n, cp, rank).to(dev)
                pk = torch.cat([local_positions(n, cp, j) for j in range(cp)]).to(dev)
                ks, vs = (z.view(cp, t, *z.shape[1:])[:, sl].reshape(-1, *z.shape[1:]) for z in (kg, vg))
                rows.append((query[sl], ks, vs))
                if self.indexer is not None:
                    xk = xg.reshape(cp, t, -1)[:, sl].reshape(-1, x.shape[-1])
                    samples.append((x[sl], qr[sl], pq, xk, pk))
            masks = self._masks(samples, packed_seq_params)
            out = torch.cat([self._sdpa(*(z.transpose(0, 1)[None] for z in row), mask)[0].transpose(0, 1)
                             for row, mask in zip(rows, masks, strict=True)], dim=0)
            return out.reshape(out.shape[0], -1)
        # padded rows: q [s, b, np, hn] (this CP rank's chunks of each row); each row a sample from position 0, its
        # padding after it (never read); x [s, b, h], qr [s, b, q_lora]
        assert not self.sequence_parallel, "sequence parallelism needs packed micro-batches"
        s, b = query.shape[:2]
        pq = local_positions(s * cp, cp, rank).to(dev) if cp > 1 else torch.arange(s, device=dev)
        pk = torch.cat([local_positions(s * cp, cp, j) for j in range(cp)]).to(dev) if cp > 1 else pq
        keys, values, xk = (kg, vg, xg) if cp > 1 else (key, value, x)
        samples = [(x[:, r], qr[:, r], pq, xk[:, r], pk) for r in range(b)] if self.indexer is not None else []
        masks = self._masks(samples, None)
        q, k, v = (z.permute(1, 2, 0, 3) for z in (query, keys, values))  # [b, h, s, d]
        out = self._sdpa(q, k, v, torch.stack(masks)[:, None])  # [b, np, s, hv]
        return out.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.v_dim)


def link_shared_layers(model: torch.nn.Module) -> None:
    """Give each shared layer's core attention its source layer's module on this stage (where a padded micro-batch's
    selection is kept; a packed one's travels with its PackedSeqParams)."""
    by_layer = {m.layer: m for m in model.modules() if isinstance(m, DSACoreAttention)}
    for m in by_layer.values():
        if m.indexer is None and m.source in by_layer:
            object.__setattr__(m, "_source_module", by_layer[m.source])


__all__ = ["DSACoreAttention", "DSAIndexer", "link_shared_layers"]
