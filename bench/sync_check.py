"""After every weight sync of a real run: does every engine hold, bit for bit, what the trainer holds?

#18's outlier tokens (BENCHMARKS.md, 2026-12-03: on the GPU, in bf16, one token of a step off by
0.01-0.27 on some steps; neither CUDA graphs nor the overlap scheduler) ask
first whether the two sides hold the same weights after a sync. CI checks it in fp32 on CPU with the
distributed broadcast (tests/e2e/test_real_model.py); this runs the loop as a recipe does (bf16,
colocated on the GPU: the in-place CUDA IPC hand-over) and after each sync compares every engine's
/weights_checksum (sha256 of each parameter's float32 bytes) with the trainer's tensors hashed the
same way. It prints, per step, the log-prob gap (mean and largest token) and how many tensors differ,
naming them, and writes the series to --out.

  python bench/sync_check.py --model /tmp/smol-bf16 --data F.jsonl --steps 30 --out R.json -- \\
      --config configs/smollm2_basic_arithmetic_grpo_1gpu.yaml [more slime-rl train flags]

Everything after `--` is slime-rl train's flags (the recipe, --lr, ...); --model and --data become
--hf-checkpoint and --prompt-data. On CPU, fp32, it is the CI test's check over more steps."""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slime_rl.config import build_config  # noqa: E402
from slime_rl.engines.client import EngineClient  # noqa: E402
from slime_rl.train import preflight  # noqa: E402

KEY = "sync-check-key"


def sha_f32(t: np.ndarray) -> str:
    """As the engine's /weights_checksum: sha256 of the tensor's float32 bytes."""
    return hashlib.sha256(np.ascontiguousarray(t, dtype=np.float32).tobytes()).hexdigest()


def differing(trainer: dict[str, str], engine: dict[str, str]) -> list[str]:
    """Names whose checksums differ, and trainer names the engine lacks (the engine may also hold
    a tied lm_head.weight, the embedding's other name)."""
    return sorted(n for n in trainer if engine.get(n) != trainer[n])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(ours)
    from slime_rl.orchestration.cluster import Cluster

    run_dir = args.run_dir or str(args.out.with_suffix("")) + "_run"
    cfg, plan = preflight(build_config([*rest, "--hf-checkpoint", args.model, "--prompt-data", args.data,
                                        "--run-dir", run_dir, "--num-rollout", str(args.steps)]))
    cluster = Cluster(cfg, plan, api_key=KEY)
    rows: list[dict] = []
    try:
        cluster.start(train_iters=args.steps)
        for step in range(args.steps):
            metrics = cluster.generate(step)
            if cfg.engine.colocate:
                cluster.release_engines()
            metrics |= cluster.train(step)
            cluster.sync_weights(version=str(step + 1))
            trainer = {name: sha_f32(t) for name, t in cluster.trainers.hf_weights().items()}
            bad: dict[str, list[str]] = {}
            for url in cluster.engine_urls:
                with EngineClient(url, api_key=KEY) as client:
                    info = client._call("GET", "/weights_checksum")
                names = differing(trainer, info["tensors"])
                if names:
                    bad[url] = names
            row = {"step": step, "lp_diff": metrics.get("train/rollout_logprob_abs_diff"),
                   "lp_diff_max": metrics.get("train/rollout_logprob_abs_diff_max"),
                   "reward": metrics.get("rollout/reward_mean"), "tensors": len(trainer),
                   "differing": bad}
            rows.append(row)
            print(f"step {step}: lp_diff {row['lp_diff']:.2e} max {row['lp_diff_max']:.2e} | "
                  f"tensors differing after the sync: {sum(map(len, bad.values()))} of {len(trainer)}"
                  + (f" {next(iter(bad.values()))[:5]}" if bad else ""), flush=True)
    finally:
        cluster.shutdown()
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"argv": argv, "steps": rows}, indent=1))
    return 1 if any(r["differing"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
