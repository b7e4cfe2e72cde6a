"""Curves from metrics.jsonl files: reward, response length, KL, entropy, step-time breakdown.

Used by tools/plot_metrics.py; one PNG with a panel per metric, one line per run.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

PANELS = (
    ("rollout/reward_mean", "reward"),
    ("rollout/response_len_mean", "response length"),
    ("train/kl", "KL"),
    ("train/entropy", "entropy"),
    ("train/grad_norm", "grad norm"),
    ("train/rollout_logprob_abs_diff", "|trainer - engine| log-prob"),
)
TIME_KEYS = ("perf/rollout_s", "perf/train_s", "perf/weight_sync_s")


def read_metrics(path: str | Path) -> list[dict]:
    """Rows of a metrics.jsonl (a run folder works too); a bad line raises naming file and line."""
    path = Path(path)
    if path.is_dir():
        path = path / "metrics.jsonl"
    rows = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: line {lineno}: not JSON: {exc}") from exc
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)):
            xs.append(r["step"])
            ys.append(v)
    return xs, ys


def plot_runs(paths: Sequence[str | Path], out: str | Path, labels: Sequence[str] | None = None) -> Path:
    """Write one PNG comparing the runs; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # no display on clusters or CI
    import matplotlib.pyplot as plt

    runs = [read_metrics(p) for p in paths]
    labels = list(labels) if labels else [Path(p).parent.name if Path(p).is_file() else Path(p).name for p in paths]
    fig, axes = plt.subplots(2, 4, figsize=(18, 7))
    axes = axes.flatten()
    for ax, (key, title) in zip(axes, PANELS, strict=False):
        for rows, label in zip(runs, labels, strict=True):
            xs, ys = _series(rows, key)
            if xs:
                ax.plot(xs, ys, label=label)
        ax.set_title(title)
        ax.set_xlabel("step")
        if key == "train/rollout_logprob_abs_diff":
            ax.set_yscale("log")
    # step-time breakdown of the first run, stacked
    ax = axes[len(PANELS)]
    bottom = None
    for key in TIME_KEYS:
        xs, ys = _series(runs[0], key)
        if xs:
            ax.bar(xs, ys, bottom=bottom, label=key.split("/")[1].removesuffix("_s"))
            bottom = ys if bottom is None else [a + b for a, b in zip(bottom, ys, strict=True)]
    ax.set_title(f"step time, s ({labels[0]})")
    ax.legend(fontsize=8)
    axes[-1].axis("off")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
