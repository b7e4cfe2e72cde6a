"""Weight-sync bandwidth: the full path against a raw broadcast of the same bytes, in one run.

Full path: Megatron params (trainer, GPU 0) -> gather -> HF names -> flattened buckets -> broadcast
-> the built-in engine (GPU 1) unpacks and copies into its HF model, driven over SGLang's HTTP
endpoints. Raw: the same bucket sizes broadcast between the same two GPUs by bare processes.

    python bench/weight_sync.py --shapes 0.5b 1.5b 4b [--repeats 3] [--bucket-mb 512] [--out FILE.json]
    python bench/weight_sync.py --smoke     # CPU (gloo), tiny model: checks that it runs

Prints one line per shape and the ratio raw_time / full_time (1.0 = the sync costs nothing beyond
the wire) last, after a per-phase breakdown of the host's time. On a CPU-only machine it runs the
same code on gloo with `--shapes tiny`.
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
sys.path.insert(0, str(ROOT / "bench"))
from common import SHAPES, free_port, make_checkpoint  # noqa: E402


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


def check_engine_weights(url: str, worker) -> int:
    """The engine holds exactly the trainer's weights after the sync: compare the last tensor of
    every layer kind and the first and last 2-D ones (two rows each: /get_weights_by_name truncates
    rows), bit for bit. Returns how many tensors were compared."""
    from slime_rl.engines.client import EngineClient

    named = list(worker.iter_hf_weights())
    pick = {n: t for n, t in named if t.dim() == 1}  # the last bias/norm of each name pattern
    pick = dict(list(pick.items())[-4:]) | {named[0][0]: named[0][1], named[-1][0]: named[-1][1]}
    with EngineClient(url) as client:
        for name, t in pick.items():
            got = torch.tensor(client.get_weights_by_name(name, truncate_size=2), dtype=torch.float32)
            want = t[:2].float().cpu()
            if not torch.equal(got, want):
                raise AssertionError(f"engine weight {name} differs from the trainer's after the sync")
    return len(pick)


def run_shape(shape: str, repeats: int, bucket_mb: float) -> dict:
    from slime_rl.config import AlgoConfig, BatchConfig, ModelConfig, OptimizerConfig, ParallelConfig
    from slime_rl.config.builtin_engine import ServerConfig
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
        embedded_command(ServerConfig(str(ckpt), "127.0.0.1", port, device="cuda" if cuda else "cpu",
                                      dtype="bfloat16" if cuda else "float32")),
        env=engine_env, stdout=open(work / "engine.log", "w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        if cuda:
            os.environ["LOCAL_RANK"] = "0"
        worker = TrainerWorker(0, 1, "127.0.0.1", free_port(), ParallelConfig(), BatchConfig(1, 1), OptimizerConfig(),
                               ModelConfig(str(ckpt), bf16=cuda), AlgoConfig(), train_iters=1)
        wait_healthy(url, timeout=600, process=engine, log_path=work / "engine.log")
        bucket = int(bucket_mb * 1024**2)
        sync = WeightBroadcaster([EngineTarget(url, 1)], WeightSyncConfig(bucket), True, "127.0.0.1", free_port(), 2,
                                 backend)
        sync.connect()
        full, phases = [], []
        for r in range(repeats + 1):  # the first one warms NCCL up and is not counted
            if cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            sync.pause_engines()
            t1 = time.perf_counter()
            out = sync.sync(worker.iter_hf_sources(), version=str(r))  # ends with the bytes sent
            t2 = time.perf_counter()
            sync.continue_engines()
            full.append(time.perf_counter() - t0)
            phases.append({"pause": t1 - t0, "continue": full[-1] - (t2 - t0),
                           **{k.removeprefix("weight_sync/").removesuffix("_seconds"): v
                              for k, v in out.items() if k.endswith("_seconds")}})
        nbytes = int(out["weight_sync/bytes"])
        checked = check_engine_weights(url, worker)
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
    median_run = 1 + full[1:].index(full_s)
    return {"shape": shape, "bytes": nbytes, "buckets": len(sizes), "full_s": full_s, "raw_s": raw_s,
            "phases_s": phases[median_run], "bucket_mb": bucket_mb, "checked_tensors": checked,
            "full_GBps": nbytes / full_s / 1e9, "raw_GBps": nbytes / raw_s / 1e9, "ratio": raw_s / full_s,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu (gloo)"}


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--raw-receiver":
        raw_receiver(int(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b", "4b"], choices=sorted(SHAPES))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--bucket-mb", type=float, default=512)
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU smoke run: the tiny shape, one repeat")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.smoke:
        a.shapes, a.repeats, a.bucket_mb = ["tiny"], 1, 0.02  # 20 KiB: several buckets
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
        print(f"{shape:>5}: {r['bytes'] / 1e9:.2f} GB in {r['buckets']} buckets | full {r['full_s']:.4f} s "
              f"({r['full_GBps']:.1f} GB/s) | raw {r['raw_s']:.4f} s ({r['raw_GBps']:.1f} GB/s) | "
              f"ratio {r['ratio']:.3f}", flush=True)
        # host-side phases of the median run: pause/continue are one HTTP call each; build = making
        # the HF tensors (gather, renaming) and bucketing; fill = copying into the flat buffer and
        # starting the broadcast; http_wait = waiting for the engine's answers; device_wait = the
        # GPU finishing what was queued (the wire time not hidden behind the host's work)
        print("       phases (ms): " + " ".join(f"{k}={v * 1e3:.2f}" for k, v in r["phases_s"].items()),
              flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=2))
    print("ratio (raw / full) " + " ".join(f"{r['shape']}={r['ratio']:.3f}" for r in results))


if __name__ == "__main__":
    main()
