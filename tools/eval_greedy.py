"""Greedy accuracy of an HF checkpoint on a prompt file, scored by a built-in reward (`--rm-type`).

    python tools/eval_greedy.py --model DIR --data FILE.jsonl [--n 100] [--max-new-tokens 32] \
        [--rm-type reasoning_gym] [--batch 50] [--show 3]

Why: a task is worth RL only when the starting model sometimes solves it (a reward above 0 gives
GRPO a signal) and often fails (below 0.5 leaves room). This measures that with plain HF
`generate` (greedy, fp32, the chat template of the folder), independent of our engine and trainer,
with the same reward function the training run uses. Prints mean reward and exact accuracy
(`acc`, reward 1) over the first `--n` rows.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from slime_rl.data import Sample, read_records
from slime_rl.rewards import BUILTIN, resolve_reward


def generate_greedy(model_dir: Path, prompts: list[list[dict]], max_new_tokens: int, batch: int,
                    device: str = "cpu") -> list[str]:
    """Greedy completions of chat prompts (left-padded batches), decoded without special tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir), padding_side="left")
    if tok.pad_token is None:  # e.g. SmolLM2's GGUF tokenizer: left padding is masked, any id will do
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    out: list[str] = []
    for i in range(0, len(prompts), batch):
        texts = [tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True) for m in prompts[i:i + batch]]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
        with torch.no_grad():
            ids = model.generate(**enc, do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id)
        out += tok.batch_decode(ids[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--rm-type", default="reasoning_gym", choices=sorted(BUILTIN))
    ap.add_argument("--batch", type=int, default=50)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where HF generate runs (fp32 either way)")
    ap.add_argument("--show", type=int, default=3, help="print this many (prompt, response, reward)")
    args = ap.parse_args(argv)
    rows = [record for _, record in read_records(str(args.data))][: args.n]
    prompts = [r["input"] if isinstance(r["input"], list) else [{"role": "user", "content": r["input"]}] for r in rows]
    start = time.perf_counter()
    responses = generate_greedy(args.model, prompts, args.max_new_tokens, args.batch, args.device)
    scores, accs = [], []
    for i, (row, response) in enumerate(zip(rows, responses, strict=True)):
        meta = {k: v for k, v in row.items() if k not in ("input", "label")}
        sample = Sample(index=i, group_index=i, prompt=prompts[i][-1]["content"], prompt_ids=[], label=row["label"],
                        response=response, metadata=meta)
        result = resolve_reward(BUILTIN[args.rm_type](sample))
        scores.append(result.score)
        accs.append(result.metrics.get("acc", float(result.score >= 1.0)))
        if i < args.show:
            print(f"--- {prompts[i][-1]['content']!r}\n    -> {response!r} "
                  f"(label {row['label']!r}, reward {result.score})")
    n = len(rows)
    print(f"{args.data.name}: n={n} reward_mean={sum(scores) / n:.3f} acc={sum(accs) / n:.3f} "
          f"max_new_tokens={args.max_new_tokens} ({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
