"""Train-reward curves of several peer_trl runs in one figure, with their window means (#18's side-by-side
learning curves in BENCHMARKS.md).

    python bench/plot_curves.py --out FIG.png [--title T] [--window 5] LABEL=RESULT.json ...

Each RESULT.json is a `bench/peer_trl.py --out` file; its `ours_reward` or `trl_reward` series is read
(whichever it has). Prints per curve the means over steps 0-49, 50-99, 100-149 and the last 20 steps, and
per pair the correlation of the per-step rewards (the runs paired by `--in-order` read the same prompts
at each step).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def read_curve(path: Path) -> list[float]:
    data = json.loads(path.read_text())
    for key in ("ours_reward", "trl_reward"):
        if data.get(key):
            return [float(x) for x in data[key]]
    raise SystemExit(f"{path}: neither ours_reward nor trl_reward holds a series")


def window_means(values: list[float], window: int) -> list[float]:
    """The mean of each step's last `window` values (fewer at the start)."""
    return [statistics.fmean(values[max(0, i + 1 - window): i + 1]) for i in range(len(values))]


def summary(values: list[float]) -> dict[str, float]:
    out = {f"steps_{a}_{a + 49}": statistics.fmean(values[a:a + 50]) for a in range(0, len(values), 50)
           if values[a:a + 50]}
    out["last_20"] = statistics.fmean(values[-20:])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--title", default="train reward per step")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("curves", nargs="+", help="LABEL=peer_trl result JSON")
    args = ap.parse_args(argv)
    curves: dict[str, list[float]] = {}
    for spec in args.curves:
        label, sep, path = spec.partition("=")
        if not sep:
            raise SystemExit(f"{spec}: expected LABEL=FILE.json")
        curves[label] = read_curve(Path(path))
    for label, values in curves.items():
        print(label, json.dumps({k: round(v, 3) for k, v in summary(values).items()}))
    labels = list(curves)
    for i, a in enumerate(labels):
        for b in labels[i + 1:]:
            n = min(len(curves[a]), len(curves[b]))
            r = statistics.correlation(curves[a][:n], curves[b][:n])
            diff = statistics.fmean(curves[a][:n]) - statistics.fmean(curves[b][:n])
            print(f"{a} vs {b}: correlation {r:.2f}, mean difference {diff:+.3f}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, values in curves.items():
        line, = ax.plot(values, alpha=0.25, linewidth=0.8)
        ax.plot(window_means(values, args.window), color=line.get_color(), label=f"{label} ({args.window}-step mean)")
    ax.set_xlabel("step")
    ax.set_ylabel("train reward")
    ax.set_title(args.title)
    ax.legend()
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
