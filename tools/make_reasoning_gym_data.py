"""Write a prompt file from a reasoning-gym task, for `--rm-type reasoning_gym`.

    python tools/make_reasoning_gym_data.py --task chain_sum --n 2000 --seed 0 --out data/chain_sum.jsonl \
        [--config num_terms=2 --config max_digits=2] [--suffix "Answer with the number only."]

Why reasoning-gym: procedural tasks with the library's own verifier (`score_answer`), no download,
difficulty set by the task's config. Each row is what the default flags read:

    {"input": [{"role": "user", "content": question + suffix}], "label": answer,
     "reasoning_gym": <the entry's metadata>}

- `input` (`--input-key` default) is a message list, so recipes set `--apply-chat-template`.
- `label` (`--label-key` default) is the entry's reference answer.
- `reasoning_gym` becomes `sample.metadata["reasoning_gym"]` (every key that is neither input nor
  label is metadata); its `source_dataset` names the task whose `score_answer` the reward calls, and
  the rest is what that verifier reads (some tasks check against metadata, not only the answer).

`--exclude FILE` drops every row whose question also appears in FILE, so a held-out evaluation set
and the training file share no question; the tool draws more rows until `--n` remain and says how
many it dropped. Draw the held-out file FIRST and write the training file with `--exclude HELDOUT`:
the held-out rows are then a plain sample of the task. The other way round (held-out `--exclude
TRAIN`) drops the questions the task draws most often, which are its easiest (basic_arithmetic
with 2-3 terms of 1-2 digits: 2 of 200 held-out rows with two 1-digit terms instead of about 50),
and measures the model on a harder set than it trains on. Another `--seed` alone does NOT make a
held-out set: reasoning-gym draws row i of seed s from `Random(s + i)`, so seed 777's rows are seed
0's rows 777, 778, ... (a 5,000-row training file of seed 0 contains the first 4,223 of them).

`--config key=value` sets the task's config fields (values parsed as JSON when they parse, e.g.
`min_terms=2`, `allow_negation=false`); the default `--suffix` asks for a bare number, which is
the format a 135M instruct model can meet (see `rewards/reasoning_gym.py` for the extraction).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from slime_rl.data import write_records

DEFAULT_SUFFIX = "Answer with the number only."
# tasks picked for SmolLM2-135M-Instruct: greedy accuracy between 0 and 0.5 at these configs
# (tools/eval_greedy.py, fp32, 100 prompts of seed 0, 24 new tokens): chain_sum 0.17,
# basic_arithmetic 0.10, products 0.33 (products of one-digit numbers only: 0.65, too easy)
PRESETS: dict[str, dict[str, Any]] = {
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
    "basic_arithmetic": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1},
    "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
}


def parse_config(items: list[str]) -> dict[str, Any]:
    """`["a=1", "b=x"]` -> {"a": 1, "b": "x"}; a bad item names `--config`."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--config {item!r}: expected key=value")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def make_rows(task: str, n: int, seed: int, config: dict[str, Any] | None = None,
              suffix: str = DEFAULT_SUFFIX) -> list[dict[str, Any]]:
    """`n` rows of `task` (reasoning-gym's generator at `seed` with `config`, which overrides the
    preset for the task, if any)."""
    import reasoning_gym

    merged = {**PRESETS.get(task, {}), **(config or {})}
    try:
        dataset = reasoning_gym.create_dataset(task, size=n, seed=seed, **merged)
    except (ValueError, TypeError, AssertionError) as exc:
        raise SystemExit(f"--task {task!r} with --config {merged}: reasoning-gym refused: {exc}") from exc
    rows = []
    for entry in dataset:
        question = entry["question"].rstrip()
        content = f"{question} {suffix}" if suffix else question
        # JSON round trip: tuples in the metadata become lists now, not at some later write
        meta = json.loads(json.dumps(entry["metadata"]))
        rows.append({"input": [{"role": "user", "content": content}], "label": str(entry["answer"]),
                     "reasoning_gym": meta})
    return rows


def question_of(row: dict[str, Any]) -> str:
    """The text a row asks (the last message's content, or the input string)."""
    prompt = row["input"]
    return prompt[-1]["content"] if isinstance(prompt, list) else str(prompt)


def make_heldout_rows(task: str, n: int, seed: int, exclude: list[dict[str, Any]], config: dict[str, Any] | None = None,
                      suffix: str = DEFAULT_SUFFIX) -> tuple[list[dict[str, Any]], int]:
    """`n` rows of `task` at `seed` none of whose questions occurs in `exclude`; returns (rows, dropped).
    Draws 2n, 4n, ... rows until n survive (a task with few distinct questions raises)."""
    seen = {question_of(r) for r in exclude}
    size = 2 * n
    while True:
        kept, dropped = [], 0
        for row in make_rows(task, size, seed, config, suffix):
            if question_of(row) in seen:
                dropped += 1
            else:
                kept.append(row)
                if len(kept) == n:
                    return kept, dropped
        if size >= 64 * n:
            raise SystemExit(f"--exclude: only {len(kept)} of {size} rows of {task!r} are not in the excluded "
                             f"file; cannot make {n} held-out rows")
        size *= 2


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", required=True, help="a reasoning-gym dataset name, e.g. chain_sum")
    ap.add_argument("--n", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help=".jsonl, .json or .parquet")
    ap.add_argument("--config", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--suffix", default=DEFAULT_SUFFIX, help="appended to every question")
    ap.add_argument("--exclude", type=Path, default=None,
                    help="a prompt file (e.g. the held-out set, drawn first): drop rows whose question appears in it")
    args = ap.parse_args(argv)
    if args.n <= 0:
        raise SystemExit(f"--n {args.n}: must be positive")
    config = parse_config(args.config)
    dropped = 0
    if args.exclude is not None:
        if not args.exclude.is_file():
            raise SystemExit(f"--exclude {args.exclude}: no such file")
        from slime_rl.data import read_records

        excluded = [record for _, record in read_records(str(args.exclude))]
        rows, dropped = make_heldout_rows(args.task, args.n, args.seed, excluded, config, args.suffix)
    else:
        rows = make_rows(args.task, args.n, args.seed, config, args.suffix)
    write_records(rows, args.out)
    note = f" ({dropped} dropped: their question is in {args.exclude})" if args.exclude is not None else ""
    print(f"wrote {len(rows)} rows of {args.task} to {args.out}{note}")


if __name__ == "__main__":
    main()
