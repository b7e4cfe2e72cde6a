"""The whole loop on one GPU with a Qwen3-MoE-shape model (random weights, about 2B parameters) built
here: Ray, the Megatron trainer (bf16, megatron's MoELayer: softmax router, SequentialMLP experts),
the built-in engine, colocated (engine memory released around training, weights handed over in place),
weight sync after every step.

    python bench/moe_gpu.py [--steps 3] [--out FILE.json]
    python bench/moe_gpu.py --tiny        # CPU, tiny Qwen3-MoE (fp32): checks that it runs
    python bench/moe_gpu.py --grouped-gemm  # the experts as grouped products (--moe-grouped-gemm)

The shape is Qwen3-30B-A3B's scaled down: 24 layers of hidden 1024, 16 query / 4 KV heads of 128,
q/k RMSNorm, 64 routed experts of width 384 per layer, top-8 renormalised (norm_topk_prob), untied
embeddings over Qwen3's vocab (151936): 2.25B parameters, 0.51B active matmul parameters per token. The reward
(`index_reward`) differs inside every group, so every step has a gradient. Prints one line per step,
then the verdict: the trainer/engine log-prob gap (train/rollout_logprob_abs_diff) <= 2e-2 on every
step, weight sync measured on every step. MFU counts the ACTIVE matmul parameters (attention, router,
top-k of the experts, LM head; not the embedding lookup, not attention's s^2 term):
6 x active x tokens / train seconds / 989 TFLOP/s (H200 dense bf16 peak), on perf/train_s (the whole
train phase) and on perf/train_fwd_bwd_s + perf/train_optimizer_s. Tokens per step = samples x
(prompt + response tokens): the prompts are the digit rows of one token length (filtered here), and
a random model over 151936 ids all but never samples the end token, so responses run to the limit
(the mean is read from the step's metrics). Raw JSON (config, counts, rows, MFU) to --out.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import ray_init  # noqa: E402

PEAK_TFLOPS = 989.0  # H200 SXM dense bf16 (the brief's MFU denominator)
GAP_LIMIT = 2e-2  # bf16 trainer vs engine log-prob gap criterion

SHAPES = {
    # Qwen3-30B-A3B (hidden 2048, 48 layers, 128 experts of 768, top-8) scaled to ~2B total
    "2b": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
               num_experts=64, num_experts_per_tok=8, moe_intermediate_size=384, intermediate_size=3072,
               vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, intermediate_size=128,
                 vocab_size=64),
}


def param_counts(s: dict) -> dict[str, int]:
    """Total parameters and active matmul parameters per token of a Qwen3-MoE shape (every layer
    sparse, untied), from the shape alone (checked against the built model in make_checkpoint)."""
    h, layers, hd = s["hidden_size"], s["num_hidden_layers"], s["head_dim"]
    attn = h * s["num_attention_heads"] * hd * 2 + h * s["num_key_value_heads"] * hd * 2  # q, o, k, v
    norms = 2 * h + 2 * hd  # input / post-attention norms, q / k norms
    router = s["num_experts"] * h
    expert = 3 * h * s["moe_intermediate_size"]
    embed = s["vocab_size"] * h
    total = layers * (attn + norms + router + s["num_experts"] * expert) + h + 2 * embed
    active_matmul = layers * (attn + router + s["num_experts_per_tok"] * expert) + embed  # + LM head
    return {"total": total, "active_matmul": active_matmul,
            "active_with_embeddings": active_matmul + embed + layers * norms + h}


def make_checkpoint(shape: str, out: Path, cuda: bool) -> tuple[Path, dict]:
    """Random bf16 (fp32 on CPU) Qwen3-MoE of the shape with the tiny tokenizer (decode only; ids it
    lacks decode to nothing); the router drawn at std 0.1 as make_tiny_model does (decisive routing)."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    sys.path.insert(0, str(ROOT / "tools"))
    from make_tiny_model import make_tiny_model

    make_tiny_model(out, arch="qwen3_moe", seed=0)  # tokenizer files (the model is overwritten below)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = Qwen3MoeConfig(**SHAPES[shape], max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6}, norm_topk_prob=True,
                         decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False, use_sliding_window=False,
                         router_aux_loss_coef=0.001, eos_token_id=63, pad_token_id=61, bos_token_id=None,
                         dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("mlp.gate.weight"):
                    p.normal_(0.0, 0.1)
    counts = param_counts(SHAPES[shape])
    built = sum(p.numel() for p in model.parameters())
    if built != counts["total"]:
        raise AssertionError(f"parameter count {built} != {counts['total']} from the shape (param_counts is wrong)")
    (out / "model.safetensors").unlink()  # the tiny model's: one weights file below, not a second one beside it
    model.save_pretrained(out, safe_serialization=True, max_shard_size="100GB")
    del model
    if cuda:
        torch.cuda.empty_cache()
    return out, counts


def uniform_prompts(ckpt: Path, n: int) -> tuple[list[dict], int]:
    """Digit rows whose prompt is one token length (the most common), and that length."""
    from transformers import AutoTokenizer

    from slime_rl.data.digits import make_rows

    tok = AutoTokenizer.from_pretrained(ckpt)
    rows = make_rows(4 * n, seed=0)
    lengths = [len(tok(r["input"])["input_ids"]) for r in rows]
    mode = collections.Counter(lengths).most_common(1)[0][0]
    keep = [r for r, n_tok in zip(rows, lengths, strict=True) if n_tok == mode]
    return keep, mode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=32, help="prompts per step (x --samples); --tiny: 4")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt; --tiny: 4")
    p.add_argument("--response-len", type=int, default=128, help="--tiny: 8")
    p.add_argument("--micro-batch-size", type=int, default=32, help="samples per micro-batch; --tiny: 8")
    p.add_argument("--disable-cuda-graph", action="store_true",
                   help="the built-in engine decodes eagerly (if capturing transformers' MoE block fails)")
    p.add_argument("--tiny", action="store_true", help="CPU, tiny model: checks that it runs")
    p.add_argument("--grouped-gemm", action="store_true",
                   help="--moe-grouped-gemm: the local experts as two grouped products (trainer/experts.py)")
    p.add_argument("--out", default=None, help="raw JSON here")
    a = p.parse_args()
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
                 ("RAY_AUTH_MODE", "disabled")):
        os.environ.setdefault(k, v)
    import ray

    from slime_rl.config import build_config
    from slime_rl.data.digits import write_jsonl
    from slime_rl.train import preflight, train

    t_start = time.perf_counter()
    cuda = torch.cuda.is_available() and not a.tiny
    shape = "tiny" if a.tiny else "2b"
    if a.tiny:
        a.prompts, a.samples, a.response_len, a.micro_batch_size = 4, 4, 8, 8
    response_len = a.response_len
    work = Path(tempfile.mkdtemp(prefix="moe_gpu_"))
    ckpt, counts = make_checkpoint(shape, work / "model", cuda)
    rows, prompt_len = uniform_prompts(ckpt, 256)
    data = write_jsonl(rows, work / "digits.jsonl")
    t_ckpt = time.perf_counter() - t_start
    print(f"[moe_gpu] {shape}: {counts['total'] / 1e6:.2f}M parameters, {counts['active_matmul'] / 1e6:.2f}M active "
          f"matmul per token ({counts['active_with_embeddings'] / 1e6:.2f}M with embeddings and norms); checkpoint "
          f"in {t_ckpt:.0f}s; prompts of {prompt_len} tokens", flush=True)
    n = a.prompts * a.samples
    argv = ["--hf-checkpoint", str(ckpt), "--prompt-data", str(data), "--run-dir", str(work / "run"),
            "--rollout-batch-size", str(a.prompts), "--n-samples-per-prompt", str(a.samples),
            "--global-batch-size", str(n), "--micro-batch-size", str(min(n, a.micro_batch_size)),
            "--rollout-max-response-len", str(response_len), "--num-rollout", str(a.steps),
            "--custom-rm-path", "tests.plugins.example_reward:index_reward", "--lr", "1e-6",
            "--rollout-num-gpus", "1", "--colocate", "--moe-aux-loss-coeff", "0.001"]
    if cuda:
        argv += ["--bf16"]
    if a.disable_cuda_graph:
        argv += ["--sglang-disable-cuda-graph"]
    if a.grouped_gemm:
        argv += ["--moe-grouped-gemm"]
    ray_init()
    try:
        rows_out = train(*preflight(build_config(argv)))
    finally:
        ray.shutdown()
    steps = []
    for r in rows_out:
        tokens = n * (prompt_len + r["rollout/response_len_mean"])
        flops = 6.0 * counts["active_matmul"] * tokens
        compute_s = r.get("perf/train_fwd_bwd_s", 0.0) + r.get("perf/train_optimizer_s", 0.0)
        step = {"step": r["step"], "tokens": tokens, "train_s": r["perf/train_s"], "fwd_bwd_opt_s": compute_s,
                "mfu_train": flops / r["perf/train_s"] / (PEAK_TFLOPS * 1e12),
                "mfu_fwd_bwd_opt": flops / compute_s / (PEAK_TFLOPS * 1e12) if compute_s else None,
                "gap": r["train/rollout_logprob_abs_diff"], "weight_sync_GBps": r.get("perf/weight_sync_GBps"),
                "weight_sync_s": r.get("perf/weight_sync_s"), "rollout_s": r["perf/rollout_s"],
                "step_s": r["perf/step_s"], "moe_load_balancing_loss": r.get("train/moe_load_balancing_loss")}
        steps.append(step)
        print(json.dumps(step), flush=True)
    wall = time.perf_counter() - t_start
    gaps = [s["gap"] for s in steps]
    sync = [s["weight_sync_GBps"] for s in steps]
    ok = len(steps) == a.steps and all(x is not None and x > 0 for x in sync) and max(gaps) <= GAP_LIMIT
    result = {"shape": shape, "config": SHAPES[shape], "grouped_gemm": a.grouped_gemm, "params": counts,
              "prompt_len": prompt_len, "samples": n,
              "response_len_limit": response_len, "peak_tflops": PEAK_TFLOPS, "bf16": cuda, "steps": steps,
              "rows": rows_out, "wall_s": wall, "checkpoint_s": t_ckpt, "pass": ok,
              "device": torch.cuda.get_device_name() if cuda else "cpu"}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    last = steps[-1]
    mfu = f"{last['mfu_train']:.1%}" if cuda else "n/a on CPU"
    print(f"moe colocated {shape}: {len(steps)} steps in {wall:.0f}s, max log-prob gap {max(gaps):.2e} "
          f"(<= {GAP_LIMIT:g}), last step MFU (active params, train phase) {mfu}, weight_sync_GBps "
          f"{[f'{x:.3g}' for x in sync]}: {'PASS' if ok else 'FAIL'}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
