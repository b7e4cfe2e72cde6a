"""The whole loop on GPUs with a Qwen2.5-shape model (random weights) built here: Ray, the Megatron
trainer (bf16), the built-in engine, weight sync after every step. Disaggregated (default): trainer on
GPU 0, engine on GPU 1, NCCL broadcast. `--colocate`: both on GPU 0 (engine memory released around
training, weights handed over in place).

    python bench/gpu_e2e.py [--shape 0.5b] [--steps 3] [--colocate] [--out DIR]
    python bench/gpu_e2e.py --modes sync,async,fully_async [--steps 8] [--response-len 256] [--json FILE]
    python bench/gpu_e2e.py --smoke      # CPU, tiny model: checks that it runs

`--modes`: the same run once per loop mode, one after another in this call: sync (the default),
async (`--async`, one step off) and fully_async (`--fully-async --max-staleness 2`); with more than one,
the last line gives each mode's steps per second relative to the first, over the steps after the first
(step 0 pays start-up costs), and --json gets the raw rows. The fully-async figures per step: the
trainer's wait for its batch (perf/trainer_wait_s), the engines' idle time (rollout/engine_idle_s), the
staleness trained at, the groups a weight update interrupted.

The reward (`index_reward`: differs inside every group) gives every step a gradient, since a random
model's text never solves anything. Writes DIR/<mode>/metrics.jsonl and prints one line per step, then the
checks issue #9 asks for: the trainer/engine log-prob gap <= 2e-2 (bf16) and perf/weight_sync_GBps
on every step.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import make_checkpoint, ray_init  # noqa: E402

MODES = {"sync": [], "async": ["--async"], "fully_async": ["--fully-async", "--max-staleness", "2"]}


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def summarize(rows: list[dict]) -> dict[str, float]:
    """Per-step means over the steps after the first (all of them when there is one)."""
    rest = rows[1:] or rows
    out = {k.split("/")[-1]: _mean([r[k] for r in rest])
           for k in ("perf/step_s", "perf/rollout_s", "perf/train_s", "perf/weight_sync_s")}
    if "rollout/engine_idle_s" in rest[0]:
        out |= {k.split("/")[-1]: _mean([r[k] for r in rest])
                for k in ("perf/trainer_wait_s", "rollout/engine_idle_s", "rollout/staleness_mean")}
        out["groups_continued_after_update"] = sum(r["rollout/groups_continued_after_update"] for r in rows)
        out["stale_groups_dropped"] = sum(r["rollout/stale_groups_dropped"] for r in rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="0.5b")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--colocate", action="store_true")
    p.add_argument("--modes", default="sync", help=f"comma-separated, of {', '.join(MODES)}")
    p.add_argument("--response-len", type=int, default=128)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None, help="raw rows and summaries of every mode")
    a = p.parse_args()
    modes = [m.strip() for m in a.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or not modes:
        p.error(f"--modes {a.modes}: each must be one of {', '.join(MODES)}")
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"),
                 ("RAY_AUTH_MODE", "disabled")):
        os.environ.setdefault(k, v)
    import ray

    from slime_rl.config import build_config
    from slime_rl.data.digits import make_rows, write_jsonl
    from slime_rl.train import preflight, train

    cuda = torch.cuda.is_available() and not a.smoke
    work = Path(tempfile.mkdtemp(prefix="gpu_e2e_"))
    out = Path(a.out) if a.out else work / "run"
    ckpt = make_checkpoint("tiny" if a.smoke else a.shape, work / "model", cuda)
    data = write_jsonl(make_rows(1024, seed=0), work / "digits.jsonl")
    argv = ["--hf-checkpoint", str(ckpt), "--prompt-data", str(data),
            "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "128",
            "--micro-batch-size", "16", "--rollout-max-response-len", "8" if a.smoke else str(a.response_len),
            "--num-rollout", str(a.steps), "--custom-rm-path", "tests.plugins.example_reward:index_reward",
            "--lr", "1e-6", "--rollout-num-gpus", "1"]
    if cuda:
        argv += ["--bf16"]
    if a.colocate:
        argv += ["--colocate"]
    placement = "colocated" if a.colocate else "disaggregated"
    shape = a.shape if not a.smoke else "tiny"
    results, verdicts, ok_all = {}, [], True
    for mode in modes:
        run_dir = out if len(modes) == 1 else out / mode
        ray_init()
        try:
            rows = train(*preflight(build_config(argv + MODES[mode] + ["--run-dir", str(run_dir)])))
        finally:
            ray.shutdown()
        for r in rows:
            print(json.dumps({k: r.get(k) for k in ("step", "train/rollout_logprob_abs_diff", "perf/weight_sync_GBps",
                                                     "perf/step_s", "train/grad_norm")}), flush=True)
        gaps = [r["train/rollout_logprob_abs_diff"] for r in rows]
        sync = [r.get("perf/weight_sync_GBps") for r in rows]
        ok = len(rows) == a.steps and all(s is not None and s > 0 for s in sync) and max(gaps) <= 2e-2
        ok_all = ok_all and ok
        results[mode] = {"summary": summarize(rows), "rows": rows}
        name = placement if mode == "sync" else f"{placement} {mode}"
        verdicts.append(f"{name} {shape}: {len(rows)} steps, max log-prob gap {max(gaps):.2e}, weight_sync_GBps "
                        f"{[f'{s:.3g}' for s in sync]}, metrics {run_dir / 'metrics.jsonl'}: "
                        f"{'PASS' if ok else 'FAIL'}")
        print(f"{mode}: {json.dumps(results[mode]['summary'])}", flush=True)
    for line in verdicts:
        print(line, flush=True)
    if a.json:
        device = torch.cuda.get_device_name(0) if cuda else "cpu"
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps({"date": datetime.date.today().isoformat(), "commit": commit,
                                            "device": device, "gpus": torch.cuda.device_count() if cuda else 0,
                                            "shape": shape, "steps": a.steps, "argv": argv,
                                            "modes": {m: MODES[m] for m in modes}, "results": results},
                                           indent=1, default=str))
    if len(modes) > 1:
        first = results[modes[0]]["summary"]["step_s"]
        print(f"steps/s relative to {modes[0]} ({shape}, {a.steps} steps, steps after the first): "
              + ", ".join(f"{m} {first / results[m]['summary']['step_s']:.2f}x" for m in modes), flush=True)
    sys.exit(0 if ok_all else 1)


if __name__ == "__main__":
    main()
