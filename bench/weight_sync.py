"""Weight-sync bandwidth: the full path against a raw broadcast of the same bytes, in one run.

Full path: Megatron params (trainer, GPU 0) -> gather -> HF names -> flattened buckets -> broadcast
-> the built-in engine (GPU 1) unpacks and copies into its HF model, driven over SGLang's HTTP
endpoints. Raw: the same bucket sizes broadcast between the same two GPUs by bare processes.

    python bench/weight_sync.py --shapes 0.5b 1.5b 4b [--repeats 3] [--bucket-mb 512] [--out FILE.json]

Prints one line per shape and the ratio raw_time / full_time (1.0 = the sync costs nothing beyond
the wire) last. On a CPU-only machine it runs the same code on gloo with `--shapes tiny`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Qwen2.5 shapes (tied embeddings as the 0.5B/1.5B/3B releases; the 4B row is Qwen3-4B's dense shape
# on the Qwen2 block, untied), random weights.
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_checkpoint(shape: str, out: Path, cuda: bool) -> Path:
    """Random bf16 (fp32 on CPU) Qwen2 of the shape, with the tiny tokenizer (only decode uses it)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    sys.path.insert(0, str(ROOT / "tools"))
    from make_tiny_model import make_tiny_model

    make_tiny_model(out, seed=0)  # tokenizer files (and a tiny model that is overwritten below)
    dtype = torch.bfloat16 if cuda else torch.float32
    cfg = Qwen2Config(**SHAPES[shape], max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6,
                      use_sliding_window=False, dtype=str(dtype).removeprefix("torch."))
    with torch.device("cuda" if cuda else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.save_pretrained(out, safe_serialization=True)
    return out


def raw_receiver(port: int, sizes: list[int], repeats: int, backend: str) -> None:
    from slime_rl.engines.dist_group import broadcast, init_custom_group

    device = "cuda" if backend == "nccl" else "cpu"
    group = init_custom_group("127.0.0.1", port, 1, 2, "raw", backend)
    bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    for _ in range(repeats + 1):
        for b in bufs:
            broadcast(group, b, 0)
    if device == "cuda":
        torch.cuda.synchronize()


def run_shape(shape: str, repeats: int, bucket_mb: int) -> dict:
    from slime_rl.config import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from slime_rl.config.groups import WeightSyncConfig
    from slime_rl.engines.dist_group import broadcast, init_custom_group
    from slime_rl.engines.launch import embedded_command, wait_healthy
    from slime_rl.trainer.worker import TrainerWorker
    from slime_rl.weight_sync.broadcast import EngineTarget, WeightBroadcaster, buckets

    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    work = Path(tempfile.mkdtemp(prefix=f"bench_{shape}_"))
    ckpt = make_checkpoint(shape, work / "model", cuda)
    if cuda:
        torch.cuda.empty_cache()
    engine_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "1"} if cuda else dict(os.environ)
    port = free_port()
    engine = subprocess.Popen(
        embedded_command(ckpt, "127.0.0.1", port, device="cuda" if cuda else "cpu",
                         dtype="bfloat16" if cuda else "float32"),
        env=engine_env, stdout=open(work / "engine.log", "w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        if cuda:
            os.environ["LOCAL_RANK"] = "0"
        worker = TrainerWorker(0, 1, "127.0.0.1", free_port(), ParallelConfig(), BatchConfig(1, 1), OptimizerConfig(),
                               ModelConfig(str(ckpt), bf16=cuda), AlgoConfig(), train_iters=1)
        wait_healthy(url, timeout=600, process=engine, log_path=work / "engine.log")
        bucket = bucket_mb * 1024**2
        sync = WeightBroadcaster([EngineTarget(url, 1)], WeightSyncConfig(bucket), True, "127.0.0.1", free_port(), 2,
                                 backend)
        sync.connect()
        full = []
        for r in range(repeats + 1):  # the first one warms NCCL up and is not counted
            t0 = time.perf_counter()
            sync.pause_engines()
            out = sync.sync(worker.iter_hf_weights(), version=str(r))
            sync.continue_engines()
            full.append(time.perf_counter() - t0)
        nbytes = int(out["weight_sync/bytes"])
        sizes = [sum(t.numel() * t.element_size() for _, t in b) for b in buckets(worker.iter_hf_weights(), bucket)]
        raw_port = free_port()
        recv = subprocess.Popen([sys.executable, __file__, "--raw-receiver", str(raw_port), json.dumps(sizes),
                                 str(repeats), backend], env=engine_env, cwd=ROOT)
        group = init_custom_group("127.0.0.1", raw_port, 0, 2, "raw", backend)
        device = "cuda" if cuda else "cpu"
        bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
        raw = []
        for _ in range(repeats + 1):
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for b in bufs:
                broadcast(group, b, 0)
            if cuda:
                torch.cuda.synchronize()
            raw.append(time.perf_counter() - t0)
        recv.wait(timeout=300)
        sync.close()
        worker.shutdown()
    finally:
        engine.terminate()
        engine.wait(timeout=60)
    full_s, raw_s = sorted(full[1:])[len(full[1:]) // 2], sorted(raw[1:])[len(raw[1:]) // 2]  # medians
    return {"shape": shape, "bytes": nbytes, "buckets": len(sizes), "full_s": full_s, "raw_s": raw_s,
            "full_GBps": nbytes / full_s / 1e9, "raw_GBps": nbytes / raw_s / 1e9, "ratio": raw_s / full_s,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu (gloo)"}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-receiver":
        raw_receiver(int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b", "4b"], choices=sorted(SHAPES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--out", default=None)
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:  # one shape per process: the trainer's process groups are set up once per process
        print("RESULT " + json.dumps(run_shape(a.shapes[0], a.repeats, a.bucket_mb)), flush=True)
        return
    results = []
    for shape in a.shapes:
        proc = subprocess.run([sys.executable, __file__, "--one", "--shapes", shape, "--repeats", str(a.repeats),
                               "--bucket-mb", str(a.bucket_mb)], capture_output=True, text=True, cwd=ROOT)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n")
            raise SystemExit(f"shape {shape} failed (exit {proc.returncode})")
        r = json.loads(lines[-1][len("RESULT "):])
        results.append(r)
        print(f"{shape:>5}: {r['bytes'] / 1e9:.2f} GB in {r['buckets']} buckets | full {r['full_s']:.3f} s "
              f"({r['full_GBps']:.1f} GB/s) | raw {r['raw_s']:.3f} s ({r['raw_GBps']:.1f} GB/s) | "
              f"ratio {r['ratio']:.3f}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))
    print("ratio (raw / full) " + " ".join(f"{r['shape']}={r['ratio']:.3f}" for r in results))


if __name__ == "__main__":
    main()
