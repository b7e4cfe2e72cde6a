"""Which side the loop's bf16 outlier tokens come from: the trainer's and the engine's log-probs of a run's
trained tokens against a float64 reference of the same weights (#18).

The 2026-12-03 runs saw one token on about half of the bf16 steps whose trainer and engine log-probs differ by
0.01-0.27 (never in fp32). `bench/outlier_tokens.py` names those tokens; this says which of the two values is
the wrong one. For each step it runs the weights that generated that step's rollout through transformers'
own model in float64 (bf16 weights upcast exactly, eager attention, fp64 log-softmax of logits / T) and
compares both sides' values with it: per step the mean and largest |trainer - ref| and |engine - ref|, and
per outlier (|trainer - engine| > --threshold) the three values and the side farther from the reference.

    python bench/outlier_reference.py --train 'DIR/train_{rollout_id}_{rank}.pt' --model HF_DIR \\
        [--weights 'DIR/hf_{rollout_id}'] [--temperature 1.0] [--threshold 0.01] [--device cuda] [--out R.json]

Step 0's rollout came from --model (the run's --hf-checkpoint); step k's from the weights saved after step
k - 1, i.e. --weights with rollout_id k - 1 (the run's --save-hf template with --save-interval 1). Steps
whose weights are not on disk are skipped and counted. The reference is transformers' model, not either
side's code: the trainer is Megatron-core's, the engine runs transformers' modules in bf16 with its own
cache and kernels.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from bench.outlier_tokens import _files, _load, report


def reference_logprobs(model: torch.nn.Module, tokens: list[int], response_length: int,
                       temperature: float = 1.0) -> list[float]:
    """log p(token_t | tokens_<t) of the response's tokens under `model` (a transformers causal LM), in the
    model's dtype: one forward over the whole sequence, logits / temperature, log-softmax."""
    device = next(model.parameters()).device
    ids = torch.tensor([tokens], device=device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0]
    prompt_len = len(tokens) - response_length
    pred = logits[prompt_len - 1: len(tokens) - 1] / temperature
    logp = torch.log_softmax(pred, dim=-1)
    target = ids[0, prompt_len:]
    return logp.gather(-1, target[:, None])[:, 0].tolist()


def compare(samples: list[dict], reference: list[list[float]], threshold: float) -> dict[str, Any]:
    """One step: `samples` the train dumps' samples (log_probs: the trainer's, rollout_log_probs: the
    engine's, loss_mask), `reference` each sample's reference log-probs. Trained tokens only."""
    d_trainer, d_engine, outliers = [], [], []
    for i, (s, ref) in enumerate(zip(samples, reference, strict=True)):
        for pos, (mine, theirs, r, mask) in enumerate(zip(s["log_probs"], s["rollout_log_probs"], ref,
                                                          s["loss_mask"], strict=True)):
            if not mask:
                continue
            d_trainer.append(abs(mine - r))
            d_engine.append(abs(theirs - r))
            if abs(mine - theirs) > threshold:
                outliers.append({"sample": i, "position": pos, "response_length": s["response_length"],
                                 "reference": r, "trainer": mine, "engine": theirs,
                                 "trainer_error": mine - r, "engine_error": theirs - r,
                                 "off": "engine" if abs(theirs - r) > abs(mine - r) else "trainer"})
    n = len(d_trainer)
    return {"trained_tokens": n,
            "trainer_mean": sum(d_trainer) / n if n else 0.0, "trainer_max": max(d_trainer, default=0.0),
            "engine_mean": sum(d_engine) / n if n else 0.0, "engine_max": max(d_engine, default=0.0),
            "trainer_over": sum(x > threshold for x in d_trainer), "engine_over": sum(x > threshold for x in d_engine),
            "outliers": outliers}


def load_model(path: str | Path, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="eager")
    return model.to(device).eval()


def run(train_template: str, model_dir: str, weights_template: str | None, temperature: float,
        threshold: float, dtype: torch.dtype, device: str) -> dict[str, Any]:
    train: dict[int, list[dict]] = {}
    for (step, _), p in sorted(_files(train_template).items()):
        train.setdefault(step, []).extend(_load(p)["samples"])
    if not train:
        raise SystemExit(f"--train {train_template}: no file matches")
    steps, skipped = [], []
    for step in sorted(train):
        weights = model_dir if step == 0 else (
            weights_template.format(rollout_id=step - 1) if weights_template else None)
        if weights is None or not (Path(weights) / "config.json").exists():
            skipped.append(step)
            continue
        model = load_model(weights, dtype, device)
        ref = [reference_logprobs(model, s["tokens"], s["response_length"], temperature) for s in train[step]]
        del model
        result = compare(train[step], ref, threshold)
        result.update(step=step, weights=str(weights))
        steps.append(result)
        print(f"step {step}: {result['trained_tokens']} tokens; |trainer-ref| mean {result['trainer_mean']:.3g} "
              f"max {result['trainer_max']:.3g}; |engine-ref| mean {result['engine_mean']:.3g} max "
              f"{result['engine_max']:.3g}; outliers {len(result['outliers'])} "
              f"(engine off {sum(o['off'] == 'engine' for o in result['outliers'])})", flush=True)
    outliers = [dict(o, step=s["step"]) for s in steps for o in s["outliers"]]
    n = sum(s["trained_tokens"] for s in steps)
    summary = {
        "threshold": threshold, "dtype": str(dtype), "steps": len(steps), "steps_skipped": skipped,
        "trained_tokens": n,
        # over every trained token of every step (each step's mean weighted by its tokens)
        "trainer_mean": sum(s["trainer_mean"] * s["trained_tokens"] for s in steps) / n if n else None,
        "engine_mean": sum(s["engine_mean"] * s["trained_tokens"] for s in steps) / n if n else None,
        "trainer_max": max((s["trainer_max"] for s in steps), default=None),
        "engine_max": max((s["engine_max"] for s in steps), default=None),
        "tokens_trainer_over_threshold": sum(s["trainer_over"] for s in steps),
        "tokens_engine_over_threshold": sum(s["engine_over"] for s in steps),
        "outliers": len(outliers), "outliers_engine_off": sum(o["off"] == "engine" for o in outliers),
        "outliers_trainer_off": sum(o["off"] == "trainer" for o in outliers),
    }
    return {"summary": summary, "steps": steps}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train", required=True, help="the run's --save-debug-train-data template")
    ap.add_argument("--model", required=True, help="the run's --hf-checkpoint (step 0's weights)")
    ap.add_argument("--weights", default=None,
                    help="the run's --save-hf template (saved every step): step k's weights are rollout_id k-1")
    ap.add_argument("--temperature", type=float, default=1.0, help="the run's --rollout-temperature")
    ap.add_argument("--threshold", type=float, default=0.01)
    ap.add_argument("--dtype", choices=["float64", "float32"], default="float64")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    result = run(args.train, args.model, args.weights, args.temperature, args.threshold,
                 getattr(torch, args.dtype), args.device)
    for s in result["steps"]:
        for o in s["outliers"]:
            print(f"step {s['step']} sample {o['sample']} position {o['position']} of {o['response_length']}: "
                  f"ref {o['reference']:.4f} trainer {o['trainer']:.4f} engine {o['engine']:.4f} -> {o['off']} off")
    report(result, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
