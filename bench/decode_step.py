"""Where a decode step of the built-in engine spends its device time, attention variants side by side.

One process, one GPU: a random Qwen2.5-shape model (bench/common.py) in bf16 with the engine's
precision policy, the engine's own StaticDecoder (static KV cache + CUDA graphs, graphs.py), its
slots filled with random keys/values up to `--context` columns, and the step replayed from its CUDA
graph. For each attention variant (registered in place of the engine's decode attention) and batch:

- step_ms: a graph replay, mean over `--iters` (CUDA events);
- the same step at a 16-column context (weights and per-token work only: what attention adds is the
  difference);
- kernels: torch.profiler's device time per kernel name over 10 replays of the first variant (CUPTI
  sees the kernels inside a graph replay), top `--top`;
- sampler_ms, sampler_compiled_ms: the engine's sampler (uniforms, the row's fp32 log-normalizer and
  the Gumbel-max argmax) on [B, V], eager and as --enable-torch-compile runs it (compiled.py);
- roofline_ms: bytes of weights + KV over `--context` columns / a device-to-device copy's bandwidth.

Variants: `fp32_copy` (the attention of 2026-12-01: q and the cached keys converted to fp32 each step),
`bf16` (bf16 scores: the island off), `engine` (the engine's attention as it is now), `sdpa_gqa`
(torch's scaled_dot_product_attention with enable_gqa and the boolean mask), `sdpa_grouped` (the
same without enable_gqa, each KV head's G query heads as G query positions), `compiled` (the
engine's attention, the step with --enable-torch-compile: compiled.py's RMSNorm, MLP and RoPE).

    python bench/decode_step.py [--shape 1.5b] [--batches 64,256] [--context 256] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import make_checkpoint  # noqa: E402
from engine_throughput import device_bandwidth, step_bytes  # noqa: E402


def attention_variants() -> dict:
    import torch.nn.functional as F

    from slime_rl.engines.embedded import attention as A

    def fp32_copy(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        B, H, _, D = query.shape
        hkv = key.shape[1]
        qg = query.reshape(B, hkv, H // hkv, D)
        scores = torch.matmul(qg.float(), key.transpose(-1, -2).float()) * (scaling or D ** -0.5)
        scores = scores.masked_fill(~attention_mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
        return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None

    def bf16(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        B, H, _, D = query.shape
        hkv = key.shape[1]
        qg = query.reshape(B, hkv, H // hkv, D)
        scores = torch.matmul(qg, key.transpose(-1, -2)).float() * (scaling or D ** -0.5)
        scores = scores.masked_fill(~attention_mask, float("-inf"))
        out = torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)
        return out.reshape(B, H, 1, D).transpose(1, 2).contiguous(), None

    def sdpa_gqa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, scale=scaling,
                                             enable_gqa=True)
        return out.transpose(1, 2).contiguous(), None

    def sdpa_grouped(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        B, H, _, D = query.shape
        hkv = key.shape[1]
        out = F.scaled_dot_product_attention(query.reshape(B, hkv, H // hkv, D), key, value,
                                             attn_mask=attention_mask, scale=scaling)
        return out.reshape(B, 1, H, D), None

    # "compiled": the engine's attention, the step under --enable-torch-compile (graphs.StaticDecoder._run)
    return {"fp32_copy": fp32_copy, "bf16": bf16, "engine": A.decode_attention, "sdpa_gqa": sdpa_gqa,
            "sdpa_grouped": sdpa_grouped, "compiled": A.decode_attention}


def fill(decoder, bs: int, context: int, vocab: int) -> None:
    """Random keys/values in the first bs slots up to `context` columns; inputs: random ids at
    position `context` (every row writes column `context`)."""
    for layer in decoder.cache.layers:
        layer.keys[:bs].normal_()
        layer.values[:bs].normal_()
    decoder.inputs[0, :bs] = torch.randint(0, vocab, (bs,), device=decoder.device)
    decoder.inputs[1:, :bs] = context


def time_replays(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def kernel_table(fn, top: int) -> list[tuple[str, float, int]]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
    rows = {}
    for e in prof.events():
        if e.device_type.name == "CUDA":
            name = e.name[:90]
            t, n = rows.get(name, (0.0, 0))
            rows[name] = (t + e.time_range.elapsed_us() / 1000 / 10, n + 1)
    ordered = sorted(((k, round(v[0], 4), v[1] // 10) for k, v in rows.items()), key=lambda r: -r[1])
    return ordered[:top]


def sampler_ms(bs: int, vocab: int, iters: int, compiled: bool = False) -> float:
    """The engine's sampler on bf16 logits [bs, vocab], every row sampling at temperature 1:
    `SamplerPlan.draw` (uniforms, the row's log-normalizer and the Gumbel-max argmax, the token's
    log-prob), eager or with --enable-torch-compile's compiled `gumbel_pick`."""
    from slime_rl.engines.embedded.sampling import SamplerPlan, SamplingParams

    logits = torch.randn(bs, vocab, device="cuda", dtype=torch.bfloat16) * 3
    plan = SamplerPlan([SamplingParams() for _ in range(bs)], [None] * bs, vocab, logits.device)
    gen = torch.Generator(device="cuda").manual_seed(0)
    pick = None
    if compiled:
        from slime_rl.engines.embedded.compiled import CompiledSampler

        pick = CompiledSampler()
    return time_replays(lambda: plan.draw(logits, gen, pick), iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1.5b")
    p.add_argument("--batches", default="64,256")
    p.add_argument("--context", type=int, default=256, help="cached columns per row (the mean context of "
                   "engine_throughput's 128 + 256 tokens is 256)")
    p.add_argument("--variants", default="fp32_copy,bf16,engine,sdpa_gqa,compiled")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--top", type=int, default=14)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from transformers import AttentionInterface, AutoModelForCausalLM

    from slime_rl.engines.embedded import attention as A
    from slime_rl.engines.embedded.graphs import StaticDecoder
    from slime_rl.engines.embedded.precision import apply_precision_policy

    batches = [int(b) for b in a.batches.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="decode_step_"))
    ckpt = make_checkpoint(a.shape, tmp / "ckpt", cuda=True)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    islands = apply_precision_policy(model)
    vocab = model.config.vocab_size
    bw = device_bandwidth(True)
    variants = attention_variants()
    names = [v for v in a.variants.split(",") if v]
    result = {"shape": a.shape, "device": torch.cuda.get_device_name(), "context": a.context,
              "islands": islands, "bandwidth_Bps": bw, "torch": torch.__version__, "batches": {}}
    with torch.no_grad():
        like = model(input_ids=torch.zeros((1, 1), dtype=torch.long, device="cuda"), use_cache=True).past_key_values
        for bs in batches:
            dec = StaticDecoder(model, "past_key_values", 0, max(batches), use_graphs=True,
                                capacity=a.context + 1, min_kv_len=16)
            dec.cache.allocate(like)
            w_bytes, kv_bytes = step_bytes(ckpt, bs, a.context, 2)
            row = {"roofline_ms": (w_bytes + kv_bytes) / bw * 1e3, "weight_bytes": w_bytes, "kv_bytes": kv_bytes,
                   "sampler_ms": sampler_ms(bs, vocab, a.iters),
                   "sampler_compiled_ms": sampler_ms(bs, vocab, a.iters, compiled=True), "variants": {}}
            for name in names:
                AttentionInterface.register(A.SLOT_DECODE, variants[name])
                dec.compile_max_bs = max(batches) if name == "compiled" else 0
                out = {}
                for ctx, key in ((a.context, "step_ms"), (15, "step_ms_ctx16")):
                    fill(dec, bs, ctx, vocab)
                    kv_len = max(dec.min_kv_len, 1 << ctx.bit_length())
                    dec._drop_graphs()
                    try:
                        entry = dec._capture(bs, kv_len)
                        if entry is None:
                            raise RuntimeError("capture failed")
                        out[key] = time_replays(entry[0].replay, a.iters)
                        if key == "step_ms" and name in (names[0], names[-1]):
                            row["kernels_" + name] = kernel_table(entry[0].replay, a.top)
                    except Exception as e:  # noqa: BLE001 - a variant that cannot run is reported
                        out[key] = None
                        out["error"] = f"{type(e).__name__}: {e}"[:300]
                        dec.use_graphs = True
                row["variants"][name] = out
                print(f"bs {bs} {name:10s} step {out.get('step_ms')} ms  ctx16 {out.get('step_ms_ctx16')} ms "
                      f"(roofline {row['roofline_ms']:.3f} ms, sampler {row['sampler_ms']:.3f} ms, "
                      f"compiled {row['sampler_compiled_ms']:.3f} ms)"
                      + (f"  {out['error']}" if "error" in out else ""), flush=True)
            AttentionInterface.register(A.SLOT_DECODE, A.decode_attention)
            result["batches"][bs] = row
            del dec
            torch.cuda.empty_cache()
    for bs, row in result["batches"].items():
        for k, v in row.items():
            if k.startswith("kernels_"):
                print(f"bs {bs} {k} (ms per step):")
                for name, ms, n in v:
                    print(f"  {ms:8.4f}  x{n:<4d} {name}")
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({bs: {n: v.get("step_ms") for n, v in r["variants"].items()} | {"roofline": r["roofline_ms"]}
                      for bs, r in result["batches"].items()}))


if __name__ == "__main__":
    main()
