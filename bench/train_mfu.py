"""Train-phase tokens/s and MFU of our trainer on one GPU, against a bf16 matmul peak measured in
the same run.

The model is a random-weight Qwen2.5-shape checkpoint (default 1.5B, tied embeddings) built here;
the step is the real code path: TrainerWorker (megatron GPTModel, local spec with our SDPA/varlen
core attention, bf16, distributed optimizer), THD-packed micro-batches filled up to a token budget
(default 4096), the policy-loss step (GRPO clip loss from vocab-parallel log-probs), Adam.

    python bench/train_mfu.py [--shape 1.5b] [--tokens-per-mb 4096] [--sample-len 1024] [--mbs 8]
                              [--steps 3] [--profile] [--out FILE.json]
    python bench/train_mfu.py --smoke      # CPU, tiny model: checks that it runs

FLOPs per step: 6 * N * T + 12 * L * H * sum_i s_i^2 (N: matmul parameters including the LM head,
T: tokens, s_i: the packed samples' lengths; attention counted without the causal halving, as
Megatron and FACTS.md do). Prints the timing lines, the profile (with --profile) and the MFU last.
"""

from __future__ import annotations

import argparse
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
from common import SHAPES, free_port, make_checkpoint, matmul_peak_tflops  # noqa: E402


def make_batch(n: int, sample_len: int, prompt_len: int, vocab: int, seed: int) -> dict:
    """n RL samples of sample_len tokens (prompt_len prompt + response), random ids, GRPO fields."""
    g = torch.Generator().manual_seed(seed)
    resp = sample_len - prompt_len
    tokens = torch.randint(0, vocab, (n, sample_len), generator=g).tolist()
    adv = (torch.randn(n, generator=g)).tolist()
    return {"tokens": tokens, "response_lengths": [resp] * n, "loss_masks": [[1] * resp for _ in range(n)],
            "advantages": adv, "rollout_logprobs": [[-1.0] * resp for _ in range(n)], "rewards": adv}


def step_flops(cfg: dict, n_matmul: int, n_samples: int, sample_len: int) -> float:
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    return 6.0 * n_matmul * n_samples * sample_len + 12.0 * layers * hidden * n_samples * sample_len**2


def matmul_params(model: torch.nn.Module, cfg: dict) -> int:
    """Parameters that take part in a matmul per token: every 2-D weight but the embedding lookup,
    plus the LM head (which is the embedding when tied)."""
    n = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2 and "embedding" not in name)
    return n + (cfg["vocab_size"] * cfg["hidden_size"] if cfg["tie_word_embeddings"] else 0)


def _category(name: str) -> str:
    name = name.lower()
    return ("gemm" if any(k in name for k in ("gemm", "cutlass", "nvjet", "sm90_xmma", "aten::mm", "addmm")) else
            "attention" if any(k in name for k in ("flash", "attention", "fmha", "sdpa")) else
            "nccl" if "nccl" in name else
            "optimizer" if any(k in name for k in ("adam", "multi_tensor", "foreach")) else
            "reduce/softmax" if any(k in name for k in ("reduce", "softmax", "logsumexp")) else
            "elementwise/copy")


def profile_table(fn, cuda: bool, rows: int = 15) -> str:
    """One call of fn under torch.profiler: the busy time per category and the top kernels (CUDA:
    kernel events only, so nothing is counted twice; CPU: ops' self time), then the top ops by the
    device time of the kernels they launch themselves, and the kernel count."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=acts) as prof:
        fn()
        if cuda:
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    avg = prof.key_averages()
    if cuda:
        leaves = [e for e in avg if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
        ops = [e for e in avg if e.device_type == DeviceType.CPU and e.self_device_time_total > 0]
        key = "self_device_time_total"
    else:
        leaves = ops = [e for e in avg if e.self_cpu_time_total > 0]
        key = "self_cpu_time_total"
    busy = sum(getattr(e, key) for e in leaves) / 1e6
    cats: dict[str, float] = {}
    for e in leaves:
        cats[_category(e.key)] = cats.get(_category(e.key), 0.0) + getattr(e, key) / 1e6
    ranked = sorted(cats.items(), key=lambda x: -x[1])
    lines = [f"profiled step {wall:.3f} s wall, {busy:.3f} s busy ({'kernels' if cuda else 'ops'}), "
             f"{sum(e.count for e in leaves)} {'kernels' if cuda else 'ops'}",
             "busy time by category: " + " ".join(f"{k}={v:.3f}s" for k, v in ranked)]
    tables = [("top kernels", leaves), ("top ops (their own kernels)", ops)] if cuda else [("top ops", ops)]
    for title, events in tables:
        lines.append(title + ":")
        for e in sorted(events, key=lambda e: -getattr(e, key))[:rows]:
            lines.append(f"  {getattr(e, key) / 1e3:9.2f} ms x{e.count:<6} {e.key[:110]}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--tokens-per-mb", type=int, default=4096, help="packed tokens per micro-batch")
    p.add_argument("--sample-len", type=int, default=1024, help="tokens per sample (prompt + response)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--mbs", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    p.add_argument("--profile", action="store_true", help="print a kernel profile of one more step")
    p.add_argument("--model", default=None, help="an HF folder to train instead of the random --shape")
    p.add_argument("--fp32-lm-head", action="store_true", help="fp32 logits (--sglang-enable-fp32-lm-head)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, one step")
    a = p.parse_args()
    if a.smoke:
        a.shape, a.tokens_per_mb, a.sample_len, a.prompt_len, a.mbs, a.steps = "tiny", 64, 32, 8, 2, 1
    if a.tokens_per_mb % a.sample_len:
        raise SystemExit(f"--tokens-per-mb {a.tokens_per_mb} must be a multiple of --sample-len {a.sample_len}")

    from slime_rl.config import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainerConfig
    from slime_rl.trainer.model import unwrap
    from slime_rl.trainer.worker import TrainerWorker

    cuda = torch.cuda.is_available()
    # measured before and after the training steps, the higher one counts: at the very start of
    # a run the clocks may still be ramping (726 TFLOP/s there vs 777-788 seen on warm H200s)
    peak = matmul_peak_tflops() if cuda else float("nan")
    if cuda:
        os.environ.setdefault("LOCAL_RANK", "0")
    cfg = SHAPES[a.shape]
    if a.model:
        raw = json.loads((Path(a.model) / "config.json").read_text())
        cfg = {k: raw[k] for k in SHAPES["tiny"]}
        a.shape = Path(a.model).name
    ckpt = Path(a.model) if a.model else make_checkpoint(a.shape, Path(tempfile.mkdtemp(prefix="mfu_")) / "model", cuda)
    n_samples = a.mbs * a.tokens_per_mb // a.sample_len
    worker = TrainerWorker(0, 1, "127.0.0.1", free_port(), ParallelConfig(), BatchConfig(1, n_samples),
                           OptimizerConfig(lr=1e-6),
                           ModelConfig(str(ckpt), bf16=cuda, fp32_lm_head=a.fp32_lm_head), AlgoConfig(),
                           train_iters=a.steps + 3,
                           trainer=TrainerConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=a.tokens_per_mb))
    n_matmul = matmul_params(unwrap(worker.gpt), cfg)
    flops = step_flops(cfg, n_matmul, n_samples, a.sample_len)
    batch = make_batch(n_samples, a.sample_len, a.prompt_len, cfg["vocab_size"], seed=1)
    old = [[-1.0] * (a.sample_len - a.prompt_len) for _ in range(n_samples)]

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def train_step() -> None:
        worker.forward_backward(batch, old)
        worker.optimizer_step()

    train_step()  # warm-up (allocator, kernels' autotuning)
    times, logprob_times = [], []
    for _ in range(a.steps):
        sync()
        t0 = time.perf_counter()
        train_step()
        sync()
        times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        worker.compute_logprobs(batch)  # the RL step's other pass: old log-probs, forward only
        sync()
        logprob_times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    lp_s = sorted(logprob_times)[len(logprob_times) // 2]
    tokens = n_samples * a.sample_len
    tflops = flops / step_s / 1e12
    mem = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    print(f"{a.shape}: {n_matmul / 1e9:.3f} B matmul params | {a.mbs} micro-batches of {a.tokens_per_mb} packed "
          f"tokens ({a.tokens_per_mb // a.sample_len} samples of {a.sample_len}) per step", flush=True)
    print(f"train step (fwd+bwd+adam) {step_s:.3f} s: {tokens / step_s:,.0f} tokens/s, {tflops:.1f} TFLOP/s, "
          f"peak mem {mem:.1f} GiB | log-prob forward {lp_s:.3f} s ({tokens / lp_s:,.0f} tokens/s)", flush=True)
    prof = profile_table(train_step, cuda) if a.profile or a.smoke else ""
    if prof:
        print("profile of one train step:\n" + prof, flush=True)
    if cuda:
        peak_before, peak = peak, max(peak, matmul_peak_tflops())
        print(f"bf16 matmul peak (8192^3, same run): {peak:.0f} TFLOP/s (before the steps {peak_before:.0f})",
              flush=True)
    mfu = tflops / peak if cuda else float("nan")
    result = {"shape": a.shape, "matmul_params": n_matmul, "tokens_per_step": tokens, "step_s": step_s,
              "tokens_per_s": tokens / step_s, "tflops": tflops, "peak_tflops": peak, "mfu": mfu,
              "logprob_forward_s": lp_s, "peak_mem_gib": mem, "profile": prof, "args": vars(a),
              "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    worker.shutdown()
    print(f"MFU {mfu:.3f} ({tflops:.1f} / {peak:.0f} TFLOP/s)")


if __name__ == "__main__":
    main()
