"""--optimizer-cpu-offload against the trainer's default optimizer, side by side on one GPU.

One random-weight Qwen2.5-shape checkpoint (bench/common.py), one TrainerWorker (TP=1, DP=1, bf16,
distributed optimizer), the same GRPO batches; each variant runs in its own process (a Megatron rank per
process), one after the other:

  gpu       3 optimizer steps, Adam on the GPU (the default)
  offload   3 steps with --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d (megatron-core's
            HybridDeviceOptimizer: fp32 main params, grads and Adam states in pinned host memory, torch's
            AdamW on the CPU); saves a checkpoint after step 1
  resume    loads that checkpoint (offload) and runs step 2 again: it must repeat the offload run's step 2

Per variant: each step's loss and grad norm, the weights after the last step (sha256 per tensor, and the
largest difference from the gpu variant), Adam's step counts and a strided sample of its states and fp32
main params (relative differences between the variants), torch's peak allocated GPU memory, the host's
resident memory before and after the first step, and the time of each optimizer step. The memory
estimate of `--dry-run` for both settings is printed beside the measured figures.

    python bench/optimizer_offload.py --shape 0.5b --out bench/results/optimizer_offload.json
    python bench/optimizer_offload.py --smoke        # CPU, tiny model: runs end to end (nothing to offload)

Prints `ratio (offload / gpu peak GPU memory) <shape>=<r>` last.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import SHAPES, free_port, make_checkpoint  # noqa: E402
from train_mfu import make_batch  # noqa: E402

STEPS = 3
SAMPLE_STRIDE = 997  # optimizer states are compared on every 997th element of each parameter's shard


def rss_gib() -> float:
    """This process's resident memory now."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def optimizer_states(worker) -> dict:
    """Adam's step counts and a strided sample of exp_avg, exp_avg_sq and the fp32 main params, in the
    optimizer's parameter order (the CPU sub-optimizers' under --optimizer-cpu-offload)."""
    from slime_rl.trainer.checkpoint import _inner_optimizers

    steps, parts = [], {"exp_avg": [], "exp_avg_sq": [], "param": []}
    for opt in _inner_optimizers(worker.optimizer):
        inner = opt.optimizer
        for sub in getattr(inner, "sub_optimizers", [inner]):
            for group in sub.param_groups:
                for param in group["params"]:
                    state = sub.state[param]
                    steps.append(float(state["step"]))
                    parts["param"].append(param.detach().float().flatten()[::SAMPLE_STRIDE].cpu())
                    for k in ("exp_avg", "exp_avg_sq"):
                        parts[k].append(state[k].detach().float().flatten()[::SAMPLE_STRIDE].cpu())
    return {"steps": steps, **{k: torch.cat(v) for k, v in parts.items()}}


def run_variant(a: argparse.Namespace, variant: str, ckpt: Path, work: Path) -> dict:
    """In this process: one rank, the variant's steps; returns its figures (weights to work/<variant>.pt)."""
    from slime_rl.config import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainerConfig
    from slime_rl.trainer.worker import TrainerWorker

    cuda = torch.cuda.is_available()
    if cuda:
        os.environ.setdefault("LOCAL_RANK", "0")
    offload = variant in ("offload", "resume")
    optim = OptimizerConfig(lr=1e-5, cpu_offload=offload, overlap_cpu_d2h_h2d=offload, precision_aware=offload)
    worker = TrainerWorker(0, 1, "127.0.0.1", free_port(), ParallelConfig(), BatchConfig(1, a.samples), optim,
                           ModelConfig(str(ckpt), bf16=cuda), AlgoConfig(), train_iters=10,
                           trainer=TrainerConfig(use_dynamic_batch_size=True, max_tokens_per_gpu=a.tokens_per_mb))
    vocab = SHAPES[a.shape]["vocab_size"]
    first = 0
    if variant == "resume":
        worker.load_latest_checkpoint(str(work / "ckpt"))
        first = 2
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    rss_before = rss_gib()
    steps = []
    for step in range(first, STEPS):
        batch = make_batch(a.samples, a.sample_len, a.prompt_len, vocab, seed=step)
        old = [[-1.0] * (a.sample_len - a.prompt_len) for _ in range(a.samples)]
        stats = worker.forward_backward(batch, old)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        grad_norm, lr = worker.optimizer_step()
        if cuda:
            torch.cuda.synchronize()
        steps.append({"step": step, "loss": stats["loss"], "grad_norm": grad_norm, "lr": lr,
                      "optimizer_step_s": time.perf_counter() - t0, "host_rss_gib": rss_gib()})
        if variant == "offload" and step == 1:
            worker.save_checkpoint(str(work / "ckpt"), step, {})
    weights = {name: t.detach().float().cpu().clone() for name, t in worker.iter_hf_weights()}
    torch.save(weights, work / f"{variant}.pt")
    torch.save(optimizer_states(worker), work / f"{variant}_states.pt")
    out = {"variant": variant, "steps": steps, "host_rss_before_steps_gib": rss_before,
           "sha256": {n: hashlib.sha256(t.numpy().tobytes()).hexdigest() for n, t in weights.items()},
           "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}
    if cuda:
        out["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["gpu_allocated_after_gib"] = torch.cuda.memory_allocated() / 2**30
    worker.shutdown()
    return out


def estimates(a: argparse.Namespace, ckpt: Path) -> dict:
    from slime_rl.orchestration.estimate import GiB, TrainerLayout, estimate_memory, model_shape
    from slime_rl.trainer.convert import read_hf_config

    shape = model_shape(read_hf_config(ckpt))
    out = {}
    for name, off in (("gpu", 0.0), ("offload", 1.0)):
        mem = estimate_memory(shape, TrainerLayout(tokens_per_micro_batch=a.tokens_per_mb, optimizer_offload=off))
        out[name] = {"total_gib": mem.total / GiB, "optimizer_gib": mem.optimizer / GiB,
                     "host_optimizer_gib": mem.host_optimizer / GiB}
    return out


def compare(a: argparse.Namespace, ckpt: Path, work: Path) -> dict:
    """Each variant in its own process, one after the other, then their figures side by side."""
    results = {}
    for variant in ("gpu", "offload", "resume"):
        cmd = [sys.executable, __file__, "--shape", a.shape, "--samples", str(a.samples), "--sample-len",
               str(a.sample_len), "--prompt-len", str(a.prompt_len), "--tokens-per-mb", str(a.tokens_per_mb),
               "--ckpt-dir", str(ckpt.parent), "--variant", variant, "--work", str(work)]
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, cwd=ROOT)
        results[variant] = json.loads((work / f"{variant}.json").read_text())
        results[variant]["process_s"] = time.perf_counter() - t0
    ref = torch.load(work / "gpu.pt")
    off = torch.load(work / "offload.pt")
    # the two optimizers' arithmetic differs (CPU vs GPU kernels) and so does the GPU backward from run to run:
    # the bf16 weights after 3 steps are compared by their largest difference, not bit for bit
    max_diff = max(float((ref[n] - off[n]).abs().max()) for n in ref)
    resumed = results["resume"]
    # the resumed step against the offload run's own step 2: the same weights and batch, so the same update
    # up to the GPU backward's run-to-run differences (atomic adds, bf16 accumulation orders: measured up to 1%
    # of Adam's states); a CPU optimizer whose states were not restored would differ by their own size
    st = {v: torch.load(work / f"{v}_states.pt") for v in ("gpu", "offload", "resume")}

    def rel(x: torch.Tensor, y: torch.Tensor) -> float:
        return float((x - y).norm() / y.norm()) if x.shape == y.shape else float("nan")

    states = {f"{a}_vs_{b}": {k: rel(st[a][k], st[b][k]) for k in ("exp_avg", "exp_avg_sq", "param")}
              for a, b in (("resume", "offload"), ("offload", "gpu"))}
    states["steps"] = {v: sorted(set(st[v]["steps"])) for v in st}
    report = {
        "shape": a.shape, "samples": a.samples, "sample_len": a.sample_len, "device": torch.cuda.get_device_name()
        if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
        "variants": results, "estimate": estimates(a, ckpt),
        "max_abs_weight_diff_offload_vs_gpu": max_diff,
        "optimizer_states_relative_diff": states,
        "resume_weights_equal_offload": resumed["sha256"] == results["offload"]["sha256"],
    }
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.5b", choices=sorted(SHAPES))
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--sample-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens-per-mb", type=int, default=4096)
    p.add_argument("--ckpt-dir", default=None, help="keep the random checkpoint here (reused when present)")
    p.add_argument("--out", default=None, help="write the result as JSON")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    p.add_argument("--variant", default=None, help=argparse.SUPPRESS)  # one variant, in a child process
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        a.shape, a.samples, a.sample_len, a.prompt_len, a.tokens_per_mb = "tiny", 4, 32, 8, 64
    ckpt = Path(a.ckpt_dir or tempfile.mkdtemp(prefix="offload_ckpt_")) / a.shape
    if a.variant:
        result = run_variant(a, a.variant, ckpt, Path(a.work))
        (Path(a.work) / f"{a.variant}.json").write_text(json.dumps(result))
        return
    if not (ckpt / "done").exists():
        make_checkpoint(a.shape, ckpt, torch.cuda.is_available())
        (ckpt / "done").touch()
    with tempfile.TemporaryDirectory(prefix="offload_work_") as tmp:  # weights, states, a checkpoint: GBs
        report = compare(a, ckpt, Path(tmp))
    if a.ckpt_dir is None:
        shutil.rmtree(ckpt.parent)
    results = report["variants"]
    max_diff, states = report["max_abs_weight_diff_offload_vs_gpu"], report["optimizer_states_relative_diff"]
    for v in ("gpu", "offload"):
        r = results[v]
        print(f"{v:8s} loss {[round(s['loss'], 6) for s in r['steps']]} grad_norm "
              f"{[round(s['grad_norm'], 6) for s in r['steps']]} optimizer step s "
              f"{[round(s['optimizer_step_s'], 3) for s in r['steps']]} peak GPU "
              f"{r.get('gpu_peak_allocated_gib', float('nan')):.2f} GiB (estimate "
              f"{report['estimate'][v]['total_gib']:.2f}), host RSS "
              f"+{r['steps'][0]['host_rss_gib'] - r['host_rss_before_steps_gib']:.2f} "
              f"GiB after the first step (estimate {report['estimate'][v]['host_optimizer_gib']:.2f})")
    print(f"weights after {STEPS} steps: max |offload - gpu| {max_diff:.3g}; optimizer states, relative "
          f"difference: {states}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))
    ratio = results["offload"].get("gpu_peak_allocated_gib", float("nan")) / \
        results["gpu"].get("gpu_peak_allocated_gib", float("nan"))
    print(f"ratio (offload / gpu peak GPU memory) {a.shape}={ratio:.3f}")


if __name__ == "__main__":
    main()
