"""LoRA weight sync: merged weights against the adapters alone (--lora-sync merged | adapter), in one run.

The loop, colocated on one device (Ray, the Megatron trainer, the built-in engine), a random-weight Qwen2.5
shape with rank-8 adapters on every linear (--lora-rank 8), the same steps twice: once per --lora-sync.
Each step's sync is read from the run's rows: `weight_sync/bytes` (what went to the engine),
`perf/weight_sync_send_s` (the trainer's send) and `perf/weight_sync_s` (the whole sync phase: the engine's
memory resumed, the send, the KV cache resumed). Step 0's sync carries the base in adapter mode (the first
one), so the figures are the medians of the later steps; the ratios are merged / adapter.

    python bench/lora_sync.py --shape 1.5b [--steps 5] [--out FILE.json]     # one GPU, bf16
    python bench/lora_sync.py --shape tiny                                   # CPU (fp32): checks that it runs

Also checked per run: the trainer/engine log-prob gap (train/rollout_logprob_abs_diff) stays within 2e-2
(bf16; 1e-3 in fp32) on every step: the engine generated with the adapters it was sent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import SHAPES, make_checkpoint, ray_init  # noqa: E402

KEYS = ("weight_sync/bytes", "perf/weight_sync_send_s", "perf/weight_sync_s")


def run(mode: str, ckpt: Path, data: Path, work: Path, steps: int, cuda: bool) -> list[dict]:
    import ray

    from slime_rl.config import build_config
    from slime_rl.train import preflight, train

    argv = ["--hf-checkpoint", str(ckpt), "--prompt-data", str(data), "--run-dir", str(work / f"run_{mode}"),
            "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--global-batch-size", "32",
            "--micro-batch-size", "8", "--rollout-max-response-len", "16", "--num-rollout", str(steps),
            "--custom-rm-path", "tests.plugins.example_reward:index_reward", "--lr", "1e-4",
            "--rollout-num-gpus", "1", "--colocate", "--lora-rank", "8", "--lora-alpha", "16",
            "--lora-sync", mode, "--seed", "1"]
    if cuda:
        argv += ["--bf16"]
    else:  # the quickstart's CPU layout: two trainer ranks beside one engine
        argv += ["--actor-num-gpus-per-node", "1"]
    ray_init()
    try:
        return train(*preflight(build_config(argv)))
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", default=None, help="raw JSON here")
    a = p.parse_args()
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
                 ("RAY_AUTH_MODE", "disabled")):
        os.environ.setdefault(k, v)
    from slime_rl.data.digits import make_rows, write_jsonl

    cuda = torch.cuda.is_available() and a.shape != "tiny"
    work = Path(tempfile.mkdtemp(prefix="lora_sync_"))
    ckpt = make_checkpoint(a.shape, work / "model", cuda)
    data = write_jsonl(make_rows(256, seed=0), work / "digits.jsonl")
    gap_limit = 2e-2 if cuda else 1e-3
    result: dict = {"shape": a.shape, "config": SHAPES[a.shape], "steps": a.steps, "bf16": cuda, "lora_rank": 8,
                    "device": torch.cuda.get_device_name() if cuda else "cpu", "runs": {}}
    for mode in ("merged", "adapter"):
        t = time.perf_counter()
        rows = run(mode, ckpt, data, work, a.steps, cuda)
        later = rows[1:]
        summary = {k: statistics.median(r[k] for r in later) for k in KEYS}
        summary["adapter_bytes"] = later[-1].get("weight_sync/adapter_bytes")
        summary["max_gap"] = max(r["train/rollout_logprob_abs_diff"] for r in rows)
        summary["wall_s"] = time.perf_counter() - t
        result["runs"][mode] = {"summary": summary, "rows": rows}
        print(f"[lora_sync] {mode}: median of steps 2..{a.steps}: {summary['weight_sync/bytes'] / 1e6:.2f} MB, "
              f"send {summary['perf/weight_sync_send_s']:.3f} s, sync phase {summary['perf/weight_sync_s']:.3f} s; "
              f"max log-prob gap {summary['max_gap']:.2e}", flush=True)
    m, d = result["runs"]["merged"]["summary"], result["runs"]["adapter"]["summary"]
    ratios = {k: m[k] / d[k] for k in KEYS}
    ok = all(r["summary"]["max_gap"] <= gap_limit for r in result["runs"].values()) and d["adapter_bytes"]
    result |= {"ratios_merged_over_adapter": ratios, "gap_limit": gap_limit, "pass": bool(ok)}
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"lora sync {a.shape} ({result['device']}): merged / adapter = bytes {ratios['weight_sync/bytes']:.1f}x, "
          f"send {ratios['perf/weight_sync_send_s']:.1f}x, sync phase {ratios['perf/weight_sync_s']:.1f}x: "
          f"{'PASS' if ok else 'FAIL'}", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
