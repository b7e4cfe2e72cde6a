"""The shipped 1-GPU recipes against TRL's GRPOTrainer, two tasks x seeds, on the same prompts per step.

    python bench/recipe_pair.py --model DIR --out bench/results/recipe_pair_1xH200_DATE.json \
        [--steps 150] [--seeds 1234 1] [--tasks basic_arithmetic chain_sum] [--dry-run]

Each task runs its recipe file as shipped (`configs/smollm2_<task>_grpo_1gpu.yaml`, its learning rate
too) through bench/peer_trl.py (`--skip-trl`), and TRL 1.16 on the same training file, lr, batch and
seed (`--skip-ours`); both read the prompts in file order (`--in-order`), so step k of each trains on
the same 16 prompts. TRL runs in fp32 without autocast: its best learner on these tasks (its bf16
autocast went NaN on basic_arithmetic, BENCHMARKS.md). All runs go at once on the one GPU: the curves
are what this measures; the step-time ratio comes from the speed pair (`bench/gpu_session.sh
trl-best`), one side at a time on the idle GPU.

Per task the held-out file (200 rows, reasoning-gym seed 100000) is drawn first and the training file
(5,000 rows, seed 0) leaves its questions out. Greedy held-out accuracy (tools/eval_greedy.py, fp32,
64 new tokens) of the starting model and of each side's model after the last step.

`--out` gets, per task and seed: last-20 train reward and held-out gain of both sides, our
engine/trainer log-prob gap over the run (`train/rollout_logprob_abs_diff`, its per-step max), and
whether each of the issue's targets holds (reward and gain >= TRL's - 0.03, gap mean <= 1e-3).
Each run's own result JSON and log stay in `--work` (default /tmp/recipe_pair).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# basic_arithmetic's 1-digit config (2 terms, + - *, no parentheses or negation): the recipe file's
# second documented config and the one BENCHMARKS.md's paired runs use; chain_sum: the task's default
TASK_CONFIGS = {
    "basic_arithmetic": ["--config", "min_terms=2", "--config", "max_terms=2", "--config", "max_digits=1",
                         "--config", 'operators=["+","-","*"]', "--config", "allow_parentheses=false",
                         "--config", "allow_negation=false"],
    "chain_sum": [],
}
TOLERANCE = 0.03  # reward and held-out gain may trail TRL's by this much
GAP_TARGET = 1e-3  # mean |engine - trainer| log-prob over a run, bf16
LAST = 20


RECIPE = "configs/smollm2_{task}_grpo_1gpu.yaml"


def recipe(task: str, template: str = RECIPE) -> Path:
    return ROOT / template.format(task=task)


def recipe_lr(path: Path) -> float:
    import yaml

    return float(yaml.safe_load(path.read_text())["lr"])


def accuracy(line: str) -> float:
    """acc=... from tools/eval_greedy.py's last line."""
    m = re.search(r"\bacc=([0-9.]+)", line)
    if m is None:
        raise ValueError(f"no acc= in eval output {line!r}")
    return float(m.group(1))


def plan(args: argparse.Namespace) -> dict[str, Any]:
    """Every command, by phase: data, start evals, runs (at once), end evals (at once)."""
    py, work = sys.executable, args.work
    data, start, runs, end = [], {}, {}, {}
    for task in args.tasks:
        heldout, train = work / f"heldout_{task}.jsonl", work / f"train_{task}.jsonl"
        data += [[py, "tools/make_reasoning_gym_data.py", "--task", task, "--n", str(args.heldout), "--seed", "100000",
                  *TASK_CONFIGS[task], "--out", str(heldout)],
                 [py, "tools/make_reasoning_gym_data.py", "--task", task, "--n", "5000", "--seed", "0",
                  *TASK_CONFIGS[task], "--exclude", str(heldout), "--out", str(train)]]
        evaluate = [py, "tools/eval_greedy.py", "--data", str(heldout), "--n", str(args.heldout), "--max-new-tokens",
                    str(args.max_new_tokens), "--batch", "200", "--show", "0"]
        start[task] = [*evaluate, "--model", str(args.model)]
        lr = recipe_lr(recipe(task, args.recipe))
        for seed in args.seeds:
            common = [py, "bench/peer_trl.py", "--model", str(args.model), "--task", task, "--data", str(train),
                      "--prompts", str(args.prompts), "--group", str(args.group), "--max-new-tokens",
                      str(args.max_new_tokens), "--steps", str(args.steps), "--warmup", str(args.warmup),
                      "--lr", str(lr), "--seed", str(seed), "--in-order", *args.peer_args]
            key = f"{task}_seed{seed}"
            ours_hf, trl_hf = work / f"{key}_ours_hf", work / f"{key}_trl_hf"
            runs[f"{key}_ours"] = [*common, "--skip-trl", "--ours-config", str(recipe(task, args.recipe)),
                                   "--out", str(work / f"{key}_ours.json"),
                                   "--ours-extra", "--save-hf", str(ours_hf), "--save-interval", str(args.steps)]
            runs[f"{key}_trl"] = [*common, "--skip-ours", "--trl-no-autocast", "--trl-save", str(trl_hf),
                                  "--out", str(work / f"{key}_trl.json")]
            end[f"{key}_ours"] = [*evaluate, "--model", str(ours_hf)]
            end[f"{key}_trl"] = [*evaluate, "--model", str(trl_hf)]
    return {"data": data, "start": start, "runs": runs, "end": end}


def run_all(cmds: dict[str, list[str]], work: Path, deadline: float) -> dict[str, int | None]:
    """Start every command at once (logs in work/NAME.log); wait until all end or the deadline passes."""
    procs = {}
    for name, cmd in cmds.items():
        log = (work / f"{name}.log").open("w")
        procs[name] = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    codes: dict[str, int | None] = {}
    for name, p in procs.items():
        try:
            codes[name] = p.wait(timeout=max(deadline - time.time(), 1))
        except subprocess.TimeoutExpired:
            p.kill()
            codes[name] = None
            print(f"{name}: still running at the deadline; killed", flush=True)
    return codes


def last_line(path: Path) -> str:
    lines = [line for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return lines[-1] if lines else ""


def summarize(args: argparse.Namespace, cmds: dict[str, Any]) -> dict[str, Any]:
    work: Path = args.work
    out: dict[str, Any] = {"settings": {"steps": args.steps, "seeds": args.seeds, "tasks": args.tasks,
                        "recipes": {t: str(recipe(t, args.recipe).relative_to(ROOT)) for t in args.tasks},
                        "trl": "TRL 1.16 GRPOTrainer, fp32 weights without autocast, HF generate",
                        "commands": cmds["runs"]},
           "runs": {}}
    start = {t: accuracy(last_line(work / f"start_{t}.log")) for t in args.tasks}
    for task in args.tasks:
        for seed in args.seeds:
            key = f"{task}_seed{seed}"
            row: dict[str, Any] = {"task": task, "seed": seed, "heldout_start": start[task]}
            for side in ("ours", "trl"):
                f = work / f"{key}_{side}.json"
                if not f.exists():
                    row[side] = {"error": last_line(work / f"{key}_{side}.log")}
                    continue
                r = json.loads(f.read_text())
                rewards = [x for x in r[f"{side}_reward"] if x is not None]
                s: dict[str, Any] = {"steps": len(rewards), "last20_reward": statistics.fmean(rewards[-LAST:]),
                                     "reward_0_49": statistics.fmean(rewards[:50]),
                                     "step_s_shared_gpu": r[f"{side}_step_s"]}
                try:
                    s["heldout_end"] = accuracy(last_line(work / f"end_{key}_{side}.log"))
                    s["heldout_gain"] = s["heldout_end"] - start[task]
                except ValueError as e:
                    s["heldout_error"] = str(e)
                if side == "ours":
                    gaps = [g for g in r["ours_logprob_abs_diff"] if g is not None]
                    maxes = [g for g in r["ours_logprob_abs_diff_max"] if g is not None]
                    s |= {"gap_mean": statistics.fmean(gaps) if gaps else None, "gap_max": max(maxes, default=None),
                          "steps_with_a_token_over_0.01": sum(m > 0.01 for m in maxes)}
                row[side] = s
            o, t = row.get("ours", {}), row.get("trl", {})
            if "last20_reward" in o and "last20_reward" in t:
                row["reward_target"] = o["last20_reward"] >= t["last20_reward"] - TOLERANCE
            if "heldout_gain" in o and "heldout_gain" in t:
                row["heldout_target"] = o["heldout_gain"] >= t["heldout_gain"] - TOLERANCE
            if o.get("gap_mean") is not None:
                row["gap_target"] = o["gap_mean"] <= GAP_TARGET
            out["runs"][key] = row
    return out


def table(summary: dict[str, Any]) -> str:
    lines = ["run | ours last-20 | TRL last-20 | ours held-out | TRL held-out | gap mean / max | targets"]
    def f(d: dict, k: str, fmt: str = "{:.3f}") -> str:
        return fmt.format(d[k]) if d.get(k) is not None else "-"

    for key, row in summary["runs"].items():
        o, t = row.get("ours", {}), row.get("trl", {})
        start = row["heldout_start"]

        def held(d: dict, start: float = start) -> str:
            return f"{start:.3f}->{f(d, 'heldout_end')}"

        targets = " ".join(f"{k[:-7]}:{'ok' if row[k] else 'MISS'}" for k in ("reward_target", "heldout_target",
                                                                             "gap_target") if k in row)
        lines.append(f"{key} | {f(o, 'last20_reward')} | {f(t, 'last20_reward')} | {held(o)} | {held(t)} | "
                     f"{f(o, 'gap_mean', '{:.1e}')} / {f(o, 'gap_max', '{:.2f}')} | {targets}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True, help="the bf16 HF import of SmolLM2-135M-Instruct")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--work", type=Path, default=Path("/tmp/recipe_pair"))
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--seeds", type=int, nargs="+", default=[1234, 1])
    ap.add_argument("--tasks", nargs="+", default=list(TASK_CONFIGS), choices=list(TASK_CONFIGS))
    ap.add_argument("--recipe", default=RECIPE, help="our recipe per task ({task} is filled in)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64, help="training and held-out budget of new tokens")
    ap.add_argument("--heldout", type=int, default=200, help="held-out rows per task")
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the step-time means")
    ap.add_argument("--peer-args", type=str.split, default=[], help="more bench/peer_trl.py flags for every "
                    "run, one string (e.g. --peer-args='--device cpu' for a CPU smoke run)")
    ap.add_argument("--time-limit", type=float, default=3000, help="seconds the training runs may take in all")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--summarize-only", action="store_true", help="only read --work and write --out")
    args = ap.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    cmds = plan(args)
    if args.dry_run:
        print(json.dumps(cmds, indent=1))
        return
    if not args.summarize_only:
        for cmd in cmds["data"]:
            subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        t0 = time.time()
        # the starting evals beside the runs: they read the starting model, not the runs' outputs
        run_all({f"start_{t}": c for t, c in cmds["start"].items()} | cmds["runs"], args.work,
                t0 + args.time_limit)
        print(f"runs done in {time.time() - t0:.0f} s", flush=True)
        ready = {f"end_{k}": c for k, c in cmds["end"].items() if Path(c[c.index("--model") + 1]).exists()}
        run_all(ready, args.work, time.time() + 600)
    summary = summarize(args, cmds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(table(summary), flush=True)


if __name__ == "__main__":
    main()
