"""Shared by the benches: Qwen2.5-shape configs, a random-weight checkpoint builder, a free port,
and the bf16 matmul peak measured in the same run (the MFU denominator)."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

# Qwen2.5 shapes (tied embeddings as the 0.5B/1.5B/3B releases; the 4B row is Qwen3-4B's dense shape
# on the Qwen2 block, untied), random weights. "tiny" is for CPU smoke runs.
SHAPES = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True),
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "4b": dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=151936, tie_word_embeddings=False),
}


def ray_init() -> None:
    """Join the Ray of RAY_ADDRESS when one is given (the test suite's session: a Ray start is 4-5 s on
    2 cores), else start a local one for the bench's run."""
    import os

    import ray

    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    else:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(shape: str, out: Path, cuda: bool) -> Path:
    """Random bf16 (fp32 on CPU) Qwen2 of the shape, with the tiny tokenizer (only decode uses it;
    ids it lacks decode to nothing)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, str(ROOT / "tools"))
    from make_tiny_model import make_tiny_model

    make_tiny_model(out, seed=0)  # tokenizer files (and a tiny model that is overwritten below)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=8192, rope_theta=1e6, rms_norm_eps=1e-6,
                      use_sliding_window=False, dtype=str(dtype).removeprefix("torch."))
    torch.manual_seed(0)
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    del model
    if cuda:
        torch.cuda.empty_cache()
    return out


def matmul_peak_tflops(n: int = 8192, iters: int = 50) -> float:
    """bf16 n x n x n matmul throughput on the current GPU (2 n^3 FLOPs each), best of 3 timings."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            a @ b
        torch.cuda.synchronize()
        best = max(best, 2 * n**3 * iters / (time.perf_counter() - t0) / 1e12)
    return best
