"""PNG curves from one or more runs: `python tools/plot_metrics.py RUN_DIR_OR_JSONL [...] --out curves.png`."""

from __future__ import annotations

import argparse

from slime_rl.observability.plot import plot_runs


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("runs", nargs="+", help="metrics.jsonl files or run folders")
    p.add_argument("--out", default="curves.png")
    p.add_argument("--labels", nargs="*", default=None)
    a = p.parse_args(argv)
    print(f"wrote {plot_runs(a.runs, a.out, a.labels)}")


if __name__ == "__main__":
    main()
