"""Does a one-token decode attention give the trainer's attention output bit for bit? (#18's bf16 gap)

bench/gemm_invariance.py showed that on the H200 every bf16 GEMM of SmolLM2-135M gives a row the
same bits at any row count (no split-K at K = 576 / 1536), so the 2e-2 decode-vs-prefill gap of the
engine is not its linear layers. What is left that a decode step computes differently from a
one-pass forward is attention: the trainer (and the engine's prefill) run flash attention over the
whole sequence; a decode step runs another kernel for one query against the cache.

For rows of random lengths (SmolLM2's heads: 9 query, 3 KV, dim 64; bf16 q/k/v of unit scale), the
reference is the last query position of a causal flash attention over each row's whole sequence
(torch's varlen flash, the trainer's call), and each variant computes only that last query:

- `engine`: the engine's decode attention (slime_rl.engines.embedded.attention.decode_attention)
  over a padded slot cache [B, Hkv, capacity, D] with its boolean mask (SDPA, enable_gqa);
- `sdpa_flash_row`: SDPA's flash backend, one row at a time, q of length 1, no mask;
- `varlen_q1`: varlen flash with one query per row (cu_seqlens_q = 0..B), keys packed, causal;
- `varlen_q1_gqa`: the same with the 3 KV heads as they are (flash's grouped-query path);
- `flash_seqused_k` (`_expanded`: KV heads repeated to 9): aten's flash forward over a padded
  cache laid out [B * capacity, Hkv, D] (per row `seqused_k` keys from its slot), the layout a
  decode kernel over slots would use;
- `math_fp32`: fp32 softmax of fp32 scores, probabilities rounded to bf16, then P @ V (the
  engine's CPU path).

Printed: per variant, the fraction of output elements that differ from the reference, and the
largest difference; JSON with --out.

    python bench/attention_invariance.py [--rows 32] [--max-len 300] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H, HKV, D = 9, 3, 64


def _causal() -> dict:
    """varlen_attn's causality keyword, as the engine's varlen prefill spells it for this torch."""
    from torch.nn.attention.varlen import varlen_attn

    from slime_rl.engines.embedded.attention import varlen_call

    return varlen_call(varlen_attn)[0]


def reference(q, k, v, lens, scale):
    """Last-position outputs [B, H, D] of causal attention over each row's packed sequence (varlen flash)."""
    from torch.nn.attention.varlen import varlen_attn

    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=q.device)
    g = H // HKV
    out = varlen_attn(q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), cu, cu, max(lens),
                      max(lens), scale=scale, **_causal())
    return out[cu[1:].long() - 1]


def variants(q, k, v, lens, scale, cap) -> dict[str, Callable[[], torch.Tensor]]:
    B, dev = len(lens), q.device
    cu = [0] + list(torch.tensor(lens).cumsum(0).tolist())
    last = torch.stack([q[cu[i + 1] - 1] for i in range(B)])  # [B, H, D]
    cache_k = torch.zeros(B, HKV, cap, D, dtype=q.dtype, device=dev)
    cache_v = torch.zeros_like(cache_k)
    for i in range(B):
        cache_k[i, :, :lens[i]] = k[cu[i]:cu[i + 1]].transpose(0, 1)
        cache_v[i, :, :lens[i]] = v[cu[i]:cu[i + 1]].transpose(0, 1)
    mask = (torch.arange(cap, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None])[:, None, None, :]
    g = H // HKV

    def engine():
        from slime_rl.engines.embedded.attention import FP32_SCORES, decode_attention

        mod = SimpleNamespace(**{FP32_SCORES: True})
        out, _ = decode_attention(mod, last[:, :, None, :], cache_k, cache_v, mask, scaling=scale)
        return out[:, 0]

    def sdpa_flash_row():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        outs = []
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            for i in range(B):
                kk = k[cu[i]:cu[i + 1]].transpose(0, 1).repeat_interleave(g, dim=0)[None]
                vv = v[cu[i]:cu[i + 1]].transpose(0, 1).repeat_interleave(g, dim=0)[None]
                outs.append(F.scaled_dot_product_attention(last[i][None, :, None, :], kk, vv, scale=scale)[0, :, 0])
        return torch.stack(outs)

    def varlen_q1():
        from torch.nn.attention.varlen import varlen_attn

        cu_q = torch.arange(B + 1, dtype=torch.int32, device=dev)
        cu_k = torch.tensor(cu, dtype=torch.int32, device=dev)
        return varlen_attn(last, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1), cu_q, cu_k, 1,
                           max(lens), scale=scale, **_causal())

    def varlen_q1_gqa(window: dict | None = None):  # KV heads not expanded (flash's grouped-query path)
        cu_q = torch.arange(B + 1, dtype=torch.int32, device=dev)
        cu_k = torch.tensor(cu, dtype=torch.int32, device=dev)
        return torch.ops.aten._flash_attention_forward(last, k, v, cu_q, cu_k, 1, max(lens), 0.0, True, False,
                                                       scale=scale, **(window or {}))[0]

    def flash_seqused_k(heads: int = HKV, window: dict | None = None):
        kp = cache_k.repeat_interleave(heads // HKV, dim=1).transpose(1, 2).reshape(B * cap, heads, D)
        vp = cache_v.repeat_interleave(heads // HKV, dim=1).transpose(1, 2).reshape(B * cap, heads, D)
        cu_q = torch.arange(B + 1, dtype=torch.int32, device=dev)
        cu_k = torch.arange(B + 1, dtype=torch.int32, device=dev) * cap
        used = torch.tensor(lens, dtype=torch.int32, device=dev)
        out = torch.ops.aten._flash_attention_forward(last, kp, vp, cu_q, cu_k, 1, cap, 0.0, True, False,
                                                      scale=scale, seqused_k=used, **(window or {}))
        return out[0]

    def math_fp32():
        scores = torch.einsum("bhd,bhtd->bht", last.float(), cache_k.repeat_interleave(g, dim=1).float()) * scale
        scores = scores.masked_fill(~mask[:, 0], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.einsum("bht,bhtd->bhd", probs, cache_v.repeat_interleave(g, dim=1))

    return {"engine": engine, "sdpa_flash_row": sdpa_flash_row, "varlen_q1": varlen_q1,
            "varlen_q1_gqa": varlen_q1_gqa, "flash_seqused_k": flash_seqused_k,
            "varlen_q1_gqa_window": lambda: varlen_q1_gqa({"window_size_left": 1 << 20, "window_size_right": 0}),
            "flash_seqused_k_expanded": lambda: flash_seqused_k(H),
            "flash_seqused_k_window": lambda: flash_seqused_k(HKV, {"window_size_left": 1 << 20,
                                                                    "window_size_right": 0}), "math_fp32": math_fp32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device (flash attention)")
    g = torch.Generator().manual_seed(a.seed)
    lens = torch.randint(8, a.max_len + 1, (a.rows,), generator=g).tolist()
    total = sum(lens)
    q, k, v = (torch.randn(total, h, D, generator=g).to("cuda", torch.bfloat16) for h in (H, HKV, HKV))
    scale = D ** -0.5
    ref = reference(q, k, v, lens, scale)
    results = {}
    for name, fn in variants(q, k, v, lens, scale, a.max_len + 16).items():
        try:
            diff = (fn().float() - ref.float()).abs()
            results[name] = {"frac_differ": float((diff > 0).float().mean()), "max_abs": float(diff.max())}
        except Exception as e:  # a variant this torch lacks: say so, measure the others
            results[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    dev = torch.cuda.get_device_name()
    print(f"# {dev}, torch {torch.__version__}: {a.rows} rows of 8-{a.max_len} keys; last-query attention output "
          "vs causal varlen flash over the whole row (fraction of elements that differ, max |diff|)")
    for name, r in results.items():
        print(f"  {name:18s} " + (r["error"] if "error" in r else f"{r['frac_differ']:.4f} ({r['max_abs']:.3g})"))
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__, "rows": a.rows, "lens": lens, "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
