"""The engine/trainer log-prob gap of several runs side by side, from `bench/peer_trl.py` results.

On the deterministic engine most steps of a run score every trained token within ~1e-5 of the
engine, but some steps hold one token off by 0.01-0.27 (BENCHMARKS.md, 2026-12-03). This prints, per
run, how many steps hold such a token, so runs that differ in one engine switch (the overlap
scheduler, CUDA graphs, ...) show which one the outliers come with:

    python bench/logprob_gap_summary.py RUN_A_ours.json RUN_B_ours.json [--threshold 1e-2] [--out F.json]

Each input is a peer_trl `--out` JSON with `ours_logprob_abs_diff` (mean |Δlogp| of a step) and
`ours_logprob_abs_diff_max` (its largest); the name of a run is its file's stem.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def summarize(result: dict[str, Any], threshold: float) -> dict[str, Any]:
    """Counts and quantiles of one run's per-step gaps (steps without a value are skipped)."""
    means = [v for v in result.get("ours_logprob_abs_diff") or [] if v is not None]
    series = result.get("ours_logprob_abs_diff_max") or []
    maxes = [v for v in series if v is not None]
    if not maxes:
        raise SystemExit("no ours_logprob_abs_diff_max in the result: run peer_trl.py with ours (not --skip-ours)")
    over = [i for i, v in enumerate(series) if v is not None and v > threshold]
    return {"steps": len(maxes), "steps_over": len(over), "first_steps_over": over[:10],
            "max_median": statistics.median(maxes), "max_max": max(maxes),
            "mean_median": statistics.median(means) if means else None,
            "mean_mean": statistics.fmean(means) if means else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--threshold", type=float, default=1e-2, help="a step counts when one token's gap passes it")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rows = {}
    for path in args.results:
        if not path.exists():  # a run that failed (gpu_session.sh gap-bisect keeps its log's tail)
            print(f"{path}: no result, left out")
            continue
        try:
            rows[path.stem] = summarize(json.loads(path.read_text()), args.threshold)
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"{path}: {e}") from e
    if not rows:
        raise SystemExit("no results to summarize")
    width = max(len(n) for n in rows)
    print(f"{'run':<{width}}  steps  steps with a token > {args.threshold:g}  per-step max: median / max  "
          f"per-step mean: median")
    for name, r in rows.items():
        mean_median = "-" if r["mean_median"] is None else f"{r['mean_median']:.1e}"
        print(f"{name:<{width}}  {r['steps']:>5}  {r['steps_over']:>5} ({r['steps_over'] / r['steps']:.0%})"
              f"{'':>19}{r['max_median']:.1e} / {r['max_max']:.2g}{'':>10}{mean_median}")
    if args.out:
        args.out.write_text(json.dumps({"threshold": args.threshold, "runs": rows}, indent=2))


if __name__ == "__main__":
    main()
