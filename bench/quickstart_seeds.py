"""The CPU quickstart over training seeds x data seeds: does it learn for every seed?

    python bench/quickstart_seeds.py --out-dir runs/seeds [--seeds 1234 7 2026 4242 1] \
        [--data-seeds 0 7] [--threshold 0.9] [-- EXTRA TRAIN FLAGS]

Each run is what `bash launch/quickstart_cpu.sh --seed S` runs (configs/quickstart_cpu.yaml, the
tiny model of `tools/make_tiny_model.py --seed 0`), on the prompts of `tools/make_digit_data.py --n
1000 --seed D`, one run at a time. Per run it prints and appends to `<out-dir>/results.jsonl`: the
seed, the data seed, the first (0-based) step whose `rollout/reward_mean` >= threshold, the mean of
the last 5 steps, and the run's wall time (the whole command: Ray, engine and trainer start-up
included). A run already in results.jsonl is skipped, so the grid can be resumed.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def summarize(rows: list[dict[str, Any]], threshold: float) -> dict[str, Any]:
    """First step with reward >= threshold (None: never) and the mean of the last 5 steps' rewards."""
    rewards = [(r["step"], r["rollout/reward_mean"]) for r in rows if r["step"] >= 0]
    first = next((s for s, v in rewards if v >= threshold), None)
    last = [v for _, v in rewards[-5:]]
    return {"first_step_at_threshold": first, "last5_mean": sum(last) / len(last) if last else None,
            "steps": len(rewards)}


def run_one(out: Path, seed: int, data_seed: int, extra: list[str], threshold: float) -> dict[str, Any]:
    py = sys.executable
    model, data = out / "model", out / f"digits_seed{data_seed}.jsonl"
    if not (model / "config.json").is_file():
        subprocess.run([py, str(ROOT / "tools/make_tiny_model.py"), "--out", str(model), "--seed", "0"], check=True)
    if not data.is_file():
        subprocess.run([py, str(ROOT / "tools/make_digit_data.py"), "--out", str(data), "--n", "1000",
                        "--seed", str(data_seed)], check=True)
    run_dir = out / f"run_seed{seed}_data{data_seed}"
    cmd = [py, "-m", "slime_rl.cli", "train", "--config", str(ROOT / "configs/quickstart_cpu.yaml"),
           "--hf-checkpoint", str(model), "--prompt-data", str(data), "--run-dir", str(run_dir),
           "--seed", str(seed), *extra]
    print("+", " ".join(cmd), flush=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - start
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {"seed": seed, "data_seed": data_seed, **summarize(rows, threshold), "wall_s": round(wall, 1),
            "extra": extra}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--seeds", type=int, nargs="+", default=[1234, 7, 2026, 4242, 1])
    p.add_argument("--data-seeds", type=int, nargs="+", default=[0, 7])
    p.add_argument("--threshold", type=float, default=0.9)
    args, extra = p.parse_known_args(argv)
    extra = [x for x in extra if x != "--"]
    out = Path(args.out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = {(r["seed"], r["data_seed"]) for r in map(json.loads, results.read_text().splitlines())} \
        if results.is_file() else set()
    for data_seed in args.data_seeds:
        for seed in args.seeds:
            if (seed, data_seed) in done:
                continue
            res = run_one(out, seed, data_seed, extra, args.threshold)
            print(json.dumps(res), flush=True)
            with results.open("a") as f:
                f.write(json.dumps(res) + "\n")
    print(f"| seed | data seed | first step >= {args.threshold:.2f} | mean of last 5 | wall s |")
    print("|---|---|---|---|---|")
    for r in map(json.loads, results.read_text().splitlines()):
        print(f"| {r['seed']} | {r['data_seed']} | {r['first_step_at_threshold']} | {r['last5_mean']:.3f} "
              f"| {r['wall_s']} |")


if __name__ == "__main__":
    main()
