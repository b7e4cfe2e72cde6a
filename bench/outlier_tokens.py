"""Where the loop's outlier tokens are: the tokens whose trainer and engine log-probs differ by more than
--threshold, from a run's --save-debug-rollout-data and --save-debug-train-data files (#18).

On the GPU in bf16 one token of about half the steps differs by 0.01-0.27 while the step means stay near
1e-5 (BENCHMARKS.md, 2026-12-03; never in fp32, never on CPU). The later runs of that day ruled out CUDA graphs, the
overlap scheduler, weight sync and the weights' values. This names each such token: its step, sample,
group, position in the response (0: the first response token, whose log-prob the engine takes from the
prefill's logits; later ones from decode steps), the prompt length and absolute position, how the
sample finished, and both values; then counts them by position.

    python bench/outlier_tokens.py --rollout 'DIR/rollout_{rollout_id}.pt' --train 'DIR/train_{rollout_id}_{rank}.pt' \\
        [--threshold 0.01] [--out R.json]

The two templates are the run's flags; the steps and DP ranks found on disk are read. Trained tokens
only (loss mask 1), as `train/rollout_logprob_abs_diff_max` counts them.
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import torch


def _files(template: str) -> dict[tuple[int, int], Path]:
    """{(rollout_id, rank): path} of the files a slime path template matches (rank 0 without {rank})."""
    pattern = (re.escape(template).replace(r"\{rollout_id\}", r"(?P<rollout_id>\d+)")
               .replace(r"\{rank\}", r"(?P<rank>\d+)"))
    found = {}
    for path in glob.glob(template.replace("{rollout_id}", "*").replace("{rank}", "*")):
        m = re.fullmatch(pattern, path)
        if m:
            found[(int(m["rollout_id"]), int(m.groupdict().get("rank") or 0))] = Path(path)
    return found


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def outlier_tokens(rollout: dict[int, dict], train: dict[int, list[dict]], threshold: float) -> dict[str, Any]:
    """rollout: {step: the rollout file's dict}; train: {step: the train files' dicts of that step, one
    per DP rank}. Returns {"tokens": the outliers, one dict each, "summary": counts, "steps": per step}."""
    tokens, steps = [], []
    for step in sorted(train):
        by_tokens = {tuple(s["tokens"]): s for s in rollout[step]["samples"]} if step in rollout else {}
        n_trained, worst, found = 0, 0.0, len(tokens)
        for part in train[step]:
            for s in part["samples"]:
                meta = by_tokens.get(tuple(s["tokens"]), {})
                prompt_len = len(s["tokens"]) - s["response_length"]
                for pos, (mine, theirs, mask) in enumerate(zip(s["log_probs"], s["rollout_log_probs"],
                                                                s["loss_mask"], strict=True)):
                    if not mask:
                        continue
                    n_trained += 1
                    gap = abs(mine - theirs)
                    worst = max(worst, gap)
                    if gap > threshold:
                        tokens.append({
                            "step": step, "rank": part["rank"], "sample": meta.get("index"),
                            "group": meta.get("group_index"), "position": pos,
                            "response_length": s["response_length"], "prompt_length": prompt_len,
                            "absolute_position": prompt_len + pos, "finish_reason": meta.get("finish_reason"),
                            "token": s["response_ids"][pos], "trainer": mine, "engine": theirs, "gap": gap})
        steps.append({"step": step, "trained_tokens": n_trained, "largest_gap": worst,
                      "outliers": len(tokens) - found})
    positions = Counter("first" if t["position"] == 0 else
                        "last" if t["position"] == t["response_length"] - 1 else "middle" for t in tokens)
    summary = {
        "threshold": threshold, "steps": len(steps), "steps_with_outliers": sum(s["outliers"] > 0 for s in steps),
        "outlier_tokens": len(tokens), "trained_tokens": sum(s["trained_tokens"] for s in steps),
        "by_position": dict(positions),
        "median_position": statistics.median(t["position"] for t in tokens) if tokens else None,
        "groups_with_more_than_one": sum(n > 1 for n in Counter((t["step"], t["group"]) for t in tokens).values()),
    }
    return {"summary": summary, "steps": steps, "tokens": tokens}


def report(result: dict[str, Any], out: Path | None) -> None:
    """Print the result's summary as one JSON line; write the whole result to `out` when given."""
    print(json.dumps(result["summary"]))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollout", required=True, help="the run's --save-debug-rollout-data template")
    ap.add_argument("--train", required=True, help="the run's --save-debug-train-data template")
    ap.add_argument("--threshold", type=float, default=0.01)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    rollout_files, train_files = _files(args.rollout), _files(args.train)
    if not train_files:
        raise SystemExit(f"--train {args.train}: no file matches")
    rollout = {step: _load(p) for (step, _), p in rollout_files.items()}
    train: dict[int, list[dict]] = {}
    for (step, _), p in sorted(train_files.items()):
        train.setdefault(step, []).append(_load(p))
    result = outlier_tokens(rollout, train, args.threshold)
    for t in result["tokens"]:
        print(f"step {t['step']} sample {t['sample']} group {t['group']}: position {t['position']} of "
              f"{t['response_length']} (prompt {t['prompt_length']}, absolute {t['absolute_position']}, "
              f"{t['finish_reason']}), token {t['token']}: trainer {t['trainer']:.4f} engine {t['engine']:.4f} "
              f"gap {t['gap']:.3g}")
    report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
