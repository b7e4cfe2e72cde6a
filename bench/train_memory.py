"""Peak GPU memory of the trainer's step against the `--dry-run` estimate (orchestration/estimate.py).

One random-weight Qwen2.5-shape checkpoint (bench/common.py; kept under --ckpt-dir between runs), one
TrainerWorker (TP=1, DP=1, bf16, distributed optimizer), THD-packed micro-batches of --tokens-per-mb
tokens, two optimizer steps (the first allocates Adam's states); the peak is torch's
max_memory_allocated over those steps. The estimate is computed for the same settings from the
checkpoint's config.json. One setting per process (a Megatron rank per process):

    python bench/train_memory.py --shape 1.5b --tokens-per-mb 4096 --sample-len 1024 --mbs 8 [--recompute full]
    python bench/train_memory.py --smoke        # CPU, tiny model: runs end to end, no memory figures

Prints the measured and estimated GiB and the relative error last; --out appends one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import SHAPES, free_port, make_checkpoint  # noqa: E402
from train_mfu import make_batch  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--tokens-per-mb", type=int, default=4096)
    p.add_argument("--sample-len", type=int, default=1024)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--mbs", type=int, default=8, help="micro-batches per optimizer step")
    p.add_argument("--recompute", choices=("none", "full"), default="none", help="full: uniform, 1 layer")
    p.add_argument("--ckpt-dir", default=None, help="keep the checkpoint here (reused when present)")
    p.add_argument("--out", default=None, help="append the result as one JSON line")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model")
    a = p.parse_args()
    if a.smoke:
        a.shape, a.tokens_per_mb, a.sample_len, a.prompt_len, a.mbs = "tiny", 64, 32, 8, 2

    from slime_rl.config import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig, TrainerConfig
    from slime_rl.orchestration.estimate import GiB, TrainerLayout, estimate_memory, model_shape
    from slime_rl.trainer import attention
    from slime_rl.trainer.convert import read_hf_config
    from slime_rl.trainer.worker import TrainerWorker

    cuda = torch.cuda.is_available()
    if cuda:
        os.environ.setdefault("LOCAL_RANK", "0")
    ckpt = Path(a.ckpt_dir or tempfile.mkdtemp(prefix="mem_")) / a.shape
    if not (ckpt / "done").exists():
        make_checkpoint(a.shape, ckpt, cuda)
        (ckpt / "done").touch()
    n = a.mbs * a.tokens_per_mb // a.sample_len
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1) \
        if a.recompute == "full" else {}
    worker = TrainerWorker(0, 1, "127.0.0.1", free_port(), ParallelConfig(), BatchConfig(1, n),
                           OptimizerConfig(lr=1e-6), ModelConfig(str(ckpt), bf16=cuda), AlgoConfig(),
                           train_iters=5, trainer=TrainerConfig(use_dynamic_batch_size=True,
                                                                 max_tokens_per_gpu=a.tokens_per_mb, **recompute))
    batch = make_batch(n, a.sample_len, a.prompt_len, SHAPES[a.shape]["vocab_size"], seed=1)
    old = [[-1.0] * (a.sample_len - a.prompt_len) for _ in range(n)]
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        worker.forward_backward(batch, old)
        worker.optimizer_step()
    measured = static = reserved_peak = device_total = non_torch = float("nan")
    if cuda:
        torch.cuda.synchronize()
        measured, static = torch.cuda.max_memory_allocated() / GiB, torch.cuda.memory_allocated() / GiB
        # what a fit verdict must add to the allocated peak: the caching allocator's reserve above it
        # (fragmentation), and memory the process holds outside torch's allocator (CUDA context,
        # cuBLAS workspaces, NCCL buffers) = used on the device - reserved by torch, both read now
        reserved_peak = torch.cuda.max_memory_reserved() / GiB
        free, device_total = (x / GiB for x in torch.cuda.mem_get_info())
        non_torch = device_total - free - torch.cuda.memory_reserved() / GiB
    worker.shutdown()

    shape = model_shape(read_hf_config(ckpt))
    # k/v are expanded to the query heads when torch's varlen attention has no GQA (attention.py)
    flash = attention.varlen()
    lay = TrainerLayout(bf16=cuda, tokens_per_micro_batch=a.tokens_per_mb, gqa_expanded=not (flash and flash[2]),
                        **recompute)
    est = estimate_memory(shape, lay)
    result = {"shape": a.shape, "tokens_per_mb": a.tokens_per_mb, "sample_len": a.sample_len, "mbs": a.mbs,
              "recompute": a.recompute, "measured_peak_gib": measured, "measured_static_gib": static,
              "estimate_gib": est.total / GiB, "estimate_static_gib": (est.weights + est.grads + est.optimizer) / GiB,
              "estimate_activations_gib": est.activations / GiB, "estimate_logits_gib": est.logits / GiB,
              "error": est.total / GiB / measured - 1, "measured_reserved_peak_gib": reserved_peak,
              "device_total_gib": device_total, "non_torch_gib": non_torch, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu"}
    if a.out:
        with open(a.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    print(f"{a.shape}, {a.tokens_per_mb}-token micro-batches, recompute {a.recompute}: static {static:.2f} GiB "
          f"(estimate {result['estimate_static_gib']:.2f}), activations {result['estimate_activations_gib']:.2f} + "
          f"logits {result['estimate_logits_gib']:.2f} GiB estimated")
    print(f"reserved peak {reserved_peak:.2f} GiB, outside torch's allocator {non_torch:.2f} GiB, "
          f"device {device_total:.2f} GiB")
    print(f"peak {measured:.2f} GiB, estimate {result['estimate_gib']:.2f} GiB, error {result['error']:+.3f}")


if __name__ == "__main__":
    main()
