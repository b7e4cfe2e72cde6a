"""This project vs TRL's GRPOTrainer on the same model, data, reward and settings, one GPU, one run.

    python bench/peer_trl.py --out bench/results/peer_trl_16x8x64.json [--prompts 16 --group 8 \
        --max-new-tokens 64 --steps 30 --warmup 5 --lr 5e-6] [--model DIR] [--skip-trl|--skip-ours]

Why: issue #18 measured TRL at 2.1 s per step against our 10.2 s on SmolLM2-135M. This puts both
on identical work so the ratio can be tracked: the same reasoning-gym prompts (one jsonl, each side
shuffles it its own way), the same reward (`slime_rl.rewards.reasoning_gym.reasoning_gym_reward`,
called by both), `--prompts` x `--group` samples and one optimizer step per step, `--max-new-tokens`,
temperature, lr (constant), AdamW (0.9, 0.999), no weight decay, grad clip 1, clip 0.2 both sides,
token-mean loss over the batch (TRL's loss_type "dapo"), group-std advantages, no KL (beta 0), bf16.

- ours: `python -m slime_rl.cli train --config configs/smollm2_chain_sum_grpo_1gpu.yaml ...` (the real
  entry point, colocated on the one GPU) in a subprocess; per-step figures from its metrics.jsonl
  (`perf/step_s`, `rollout/reward_mean`).
- TRL: `GRPOTrainer` in this process after ours has exited (HF generate, no vLLM); per-step wall time
  from a callback (on_step_begin -> on_step_end, one optimizer step each), reward from the reward
  function's own calls (one per generation batch = one per optimizer step).

`--out F.json`: ours_step_s and trl_step_s (means over steps warmup..steps-1), ratio = trl / ours,
the settings and both reward series; the raw files (our run dir's metrics.jsonl, TRL's per-step
records) go next to it, with a PNG of both reward curves. On CPU (`--device cpu`, a smoke run:
fp32, the CPU recipe) use e.g. --prompts 2 --group 2 --max-new-tokens 8 --steps 2 --warmup 1.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slime_rl.data import Sample, write_records  # noqa: E402
from slime_rl.rewards.reasoning_gym import METADATA_KEY, reasoning_gym_reward  # noqa: E402


def make_data(task: str, n: int, seed: int, out: Path) -> list[dict[str, Any]]:
    from tools.make_reasoning_gym_data import make_rows

    rows = make_rows(task, n, seed)
    write_records(rows, out)
    return rows


def shared_reward(response: str, label: str, meta: dict[str, Any], index: int = 0) -> float:
    """The one reward both sides use: reasoning-gym's verifier on the response text."""
    sample = Sample(index=index, group_index=index, prompt="", prompt_ids=[], label=label, response=response,
                    metadata={METADATA_KEY: meta})
    return reasoning_gym_reward(sample)["score"]


def run_ours(args: argparse.Namespace, model: Path, data: Path, run_dir: Path) -> list[dict[str, Any]]:
    recipe = args.ours_config or ROOT / "configs" / ("smollm2_chain_sum_cpu.yaml" if args.device == "cpu" else
                                                     "smollm2_chain_sum_grpo_1gpu.yaml")
    if args.in_order:
        recipe = in_order_recipe(recipe, run_dir.parent / f"{run_dir.name}_recipe.yaml")
    batch = args.prompts * args.group
    cmd = [sys.executable, "-m", "slime_rl.cli", "train", "--config", str(recipe), "--hf-checkpoint", str(model),
           "--prompt-data", str(data), "--run-dir", str(run_dir), "--num-rollout", str(args.steps),
           "--rollout-batch-size", str(args.prompts), "--n-samples-per-prompt", str(args.group),
           "--global-batch-size", str(batch), "--rollout-max-response-len", str(args.max_new_tokens),
           "--lr", str(args.lr), "--rollout-temperature", str(args.temperature), "--seed", str(args.seed),
           "--eps-clip-high", str(args.eps_clip_high), *args.ours_extra]
    if args.device == "cpu":
        cmd += ["--micro-batch-size", str(batch)]
    print("ours:", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def in_order_recipe(recipe: Path, out: Path) -> Path:
    """A copy of `recipe` that reads the prompts in file order (rollout-shuffle false), as TRL does with
    shuffle_dataset=False: step k of both sides then trains on the file's prompts 16k..16k+15 (TRL's
    RepeatSampler without shuffle yields them in order; ours reads them in order without a shuffle)."""
    import yaml

    data = yaml.safe_load(recipe.read_text())
    data["rollout-shuffle"] = False
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def run_trl(args: argparse.Namespace, model_dir: Path, rows: list[dict[str, Any]], out_dir: Path,
            progress: Path | None = None) -> list[dict]:
    """TRL GRPOTrainer on the same rows; returns one record per optimizer step (each also appended to
    `progress` as it ends, so a run stopped by a time limit keeps its steps)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    # the metadata dicts differ between rows (Arrow wants one schema): carried as JSON text
    dataset = Dataset.from_list([{"prompt": r["input"], "label": r["label"], "rg_meta": json.dumps(r[METADATA_KEY])}
                                 for r in rows])
    rewards: list[float] = []
    lengths: list[float] = []
    reward_fn = trl_reward(rewards, lengths)
    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, _args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, _args, state, control, **kwargs):
            steps.append({"step": state.global_step - 1, "step_s": time.perf_counter() - self.start})
            if progress is not None:  # the reward of this step was recorded by its generation batch
                record = steps[-1] | ({"reward_mean": rewards[len(steps) - 1]} if len(rewards) >= len(steps) else {})
                record |= {"response_len_mean": lengths[len(steps) - 1]} if len(lengths) >= len(steps) else {}
                with progress.open("a") as f:
                    f.write(json.dumps(record) + "\n")

    batch = args.prompts * args.group
    micro = min(batch, args.trl_micro_batch)
    if batch % micro:
        raise SystemExit(f"--trl-micro-batch {micro} must divide --prompts x --group = {batch}")
    cpu = args.device == "cpu"
    config = GRPOConfig(
        output_dir=str(out_dir / "trl"), per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        num_generations=args.group, max_completion_length=args.max_new_tokens, temperature=args.temperature,
        learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, beta=0.0, epsilon=0.2,
        epsilon_high=args.eps_clip_high,
        loss_type="dapo", scale_rewards="group", weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999,
        max_grad_norm=1.0, max_steps=args.steps, logging_steps=1, save_strategy="no", report_to="none",
        shuffle_dataset=not args.in_order,
        bf16=not cpu and not args.trl_no_autocast, use_cpu=cpu, seed=args.seed, use_vllm=False,
        cache_implementation=args.trl_cache_implementation,
        use_transformers_continuous_batching=args.trl_continuous_batching)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    # fp32 weights + bf16 autocast (the HF Trainer's mixed precision) by default, like our fp32 main
    # params: pure bf16 weights would round away AdamW updates of lr ~5e-6 and barely learn
    dtype = torch.bfloat16 if args.trl_dtype == "bf16" and not cpu else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    trainer = GRPOTrainer(model=model, reward_funcs=reward_fn, args=config, train_dataset=dataset,
                          processing_class=tok, callbacks=[StepTimer()])
    trainer.train()
    if args.trl_save is not None:
        trainer.save_model(str(args.trl_save))
        tok.save_pretrained(str(args.trl_save))
    for record, reward in zip(steps, rewards, strict=False):
        record["reward_mean"] = reward
    for record, length in zip(steps, lengths, strict=False):
        record["response_len_mean"] = length
    return steps


def trl_reward(rewards: list[float], lengths: list[float]) -> Callable[..., list[float]]:
    """TRL's reward function: reasoning-gym's verifier on each completion (shared_reward), appending each
    generation batch's mean reward to `rewards` and, from the completion ids TRL passes its reward
    functions, its mean completion length in tokens to `lengths`."""
    def reward_fn(completions, label, rg_meta, completion_ids=None, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        scores = [shared_reward(t, lab, json.loads(m), i)
                  for i, (t, lab, m) in enumerate(zip(texts, label, rg_meta, strict=True))]
        rewards.append(statistics.fmean(scores))
        if completion_ids is not None:
            lengths.append(statistics.fmean(len(ids) for ids in completion_ids))
        return scores

    return reward_fn


def scored_reward_mean(row: dict[str, Any]) -> float:
    """A step's reward over every scored group, as TRL's: with a dynamic-sampling filter (--ours-extra
    --dynamic-sampling-filter-path ...) `rollout/reward_mean` is the kept groups' mean, biased by it."""
    value = row.get("rollout/reward_mean_before_filter", math.nan)
    return row["rollout/reward_mean"] if math.isnan(value) else value


def mean_after(values: list[float], warmup: int) -> float:
    if len(values) <= warmup:
        raise SystemExit(f"--warmup {warmup} leaves no steps of {len(values)} to average")
    return statistics.fmean(values[warmup:])


def plot(ours: list[float], trl: list[float], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    if ours:
        ax.plot(range(len(ours)), ours, label="slime_rl")
    if trl:
        ax.plot(range(len(trl)), trl, label="TRL GRPOTrainer")
    ax.set(xlabel="step", ylabel="reward mean", title=title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_concurrent(args: argparse.Namespace, argv: list[str]) -> None:
    """This script twice at once, `--skip-trl` on GPU 0 and `--skip-ours` on GPU 1, merged into --out."""
    import os

    # one GPU: both sides on it at once (a 135M model leaves most of an H200 idle); the learning curves
    # are unchanged, the step times are not each side's alone and the ratio is not reported as one
    shared = torch.cuda.device_count() < 2
    rest = [a for a in argv if a != "--concurrent"]
    parts = {}
    procs = []
    for side, gpu, skip in (("ours", "0", "--skip-trl"), ("trl", "0" if shared else "1", "--skip-ours")):
        parts[side] = args.out.with_name(f"{args.out.stem}_{side}.json")
        cmd = [sys.executable, __file__, skip, *_replace_out(rest, parts[side])]  # before a --ours-extra tail
        procs.append(subprocess.Popen(cmd, env=os.environ | {"CUDA_VISIBLE_DEVICES": gpu}))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"--concurrent: exit codes {codes} (ours, trl)")
    result = json.loads(parts["ours"].read_text())
    trl = json.loads(parts["trl"].read_text())
    result |= {k: v for k, v in trl.items() if k.startswith("trl_")}
    result["ratio"] = result["trl_step_s"] / result["ours_step_s"]
    result["settings"]["concurrent"] = ("ours and TRL on GPU 0 at the same time (step times are shared-GPU "
                                        "figures)" if shared else "ours on GPU 0, TRL on GPU 1, at the same time")
    args.out.write_text(json.dumps(result, indent=2))
    plot(result["ours_reward"], result["trl_reward"], args.out.with_name(f"{args.out.stem}_reward.png"),
         f"{args.task}: {args.prompts}x{args.group}, <= {args.max_new_tokens} new tokens, lr {args.lr}")
    print(json.dumps({k: result.get(k) for k in ("ours_step_s", "trl_step_s", "ratio")}))


def _replace_out(argv: list[str], out: Path) -> list[str]:
    argv = list(argv)
    for i, a in enumerate(argv):
        if a == "--out":
            argv[i + 1] = str(out)
            return argv
        if a.startswith("--out="):
            argv[i] = f"--out={out}"
            return argv
    raise AssertionError("--out is required")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--model", type=Path, default=None, help="HF folder (default: import the SmolLM2 GGUF)")
    ap.add_argument("--task", default="chain_sum")
    ap.add_argument("--n-data", type=int, default=5000)
    ap.add_argument("--data", type=Path, default=None, help="training prompts (default: --n-data rows of --task, "
                                                            "seed 0)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--lr", type=float, default=5e-6)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--eps-clip-high", type=float, default=0.2,
                    help="upper clip of the ratio on both sides (ours --eps-clip-high, TRL epsilon_high; "
                         "DAPO's clip-higher is 0.28); the lower one stays 0.2")
    ap.add_argument("--trl-micro-batch", type=int, default=64, help="TRL per_device_train_batch_size (completions)")
    ap.add_argument("--trl-dtype", default="fp32", choices=["fp32", "bf16"],
                    help="TRL's weights (GPU: bf16 autocast unless --trl-no-autocast); fp32 = mixed precision as ours")
    ap.add_argument("--trl-no-autocast", action="store_true",
                    help="TRL without bf16 autocast on the GPU (GRPOConfig bf16=False; with --trl-dtype fp32: all "
                         "fp32). Its bf16-autocast run on basic_arithmetic went NaN (grad_norm nan, then a "
                         "sampling assert) at step 44 of one seed and 51 of another (2026-12-03)")
    ap.add_argument("--trl-cache-implementation", default=None,
                    help="TRL GRPOConfig cache_implementation for HF generate (e.g. static; TRL passes "
                         "disable_compile=True to generate, so a static cache runs uncompiled)")
    ap.add_argument("--trl-continuous-batching", action="store_true",
                    help="TRL GRPOConfig use_transformers_continuous_batching: transformers' paged, "
                         "continuously batched generate instead of model.generate")
    ap.add_argument("--trl-save", type=Path, default=None,
                    help="save TRL's trained model here (an HF folder, for tools/eval_greedy.py)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--skip-ours", action="store_true")
    ap.add_argument("--concurrent", action="store_true",
                    help="two GPUs: ours on GPU 0 and TRL on GPU 1 at the same time (each side alone on its GPU; "
                         "the host's cores are shared), then one JSON as usual; one GPU: both on it at once "
                         "(for learning curves; the step times are then shared-GPU figures)")
    ap.add_argument("--ours-config", type=Path, default=None,
                    help="our side's recipe (default: configs/smollm2_chain_sum_grpo_1gpu.yaml, on CPU "
                         "smollm2_chain_sum_cpu.yaml); e.g. a copy with bf16: false for ours in fp32 beside "
                         "TRL's --trl-no-autocast (a YAML true cannot be turned off from the command line)")
    ap.add_argument("--in-order", action="store_true",
                    help="both sides read the training prompts in file order (TRL shuffle_dataset=False, ours "
                         "rollout-shuffle false), so step k trains on the same prompts on both sides: the "
                         "reward curves are then paired (a step's prompts vary in difficulty)")
    ap.add_argument("--ours-extra", nargs=argparse.REMAINDER, default=[], help="more flags for slime-rl train")
    args = ap.parse_args(argv)
    out_dir = args.out.parent
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out.stem
    work = Path(tempfile.mkdtemp(prefix="peer_trl_"))
    model = args.model
    if model is None:
        from tools.import_gguf import import_gguf

        model = import_gguf(work / "model", dtype="fp32" if args.device == "cpu" else "bf16")
    data = work / f"{args.task}.jsonl"
    if args.data is not None:  # a training file made beforehand (e.g. so a held-out file can exclude it)
        from slime_rl.data import read_records

        rows = [record for _, record in read_records(str(args.data))]
        write_records(rows, data)
    else:
        rows = make_data(args.task, args.n_data, 0, data)
    if args.concurrent:
        return run_concurrent(args, argv if argv is not None else sys.argv[1:])
    result: dict[str, Any] = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()
                                           if k not in ("out", "ours_extra")}
                              | {"model": str(model), "ours_extra": args.ours_extra}}
    ours_rewards, trl_rewards = [], []
    if not args.skip_ours:
        run_dir = out_dir / f"{stem}_ours_run"
        metrics = [r for r in run_ours(args, model, data, run_dir) if r["step"] >= 0]
        ours_rewards = [scored_reward_mean(r) for r in metrics]
        result |= {"ours_step_s": mean_after([r["perf/step_s"] for r in metrics], args.warmup),
                   "ours_step_s_series": [r["perf/step_s"] for r in metrics], "ours_reward": ours_rewards,
                   "ours_rollout_s": mean_after([r["perf/rollout_s"] for r in metrics], args.warmup),
                   "ours_train_s": mean_after([r["perf/train_s"] for r in metrics], args.warmup),
                   "ours_logprob_abs_diff": [r.get("train/rollout_logprob_abs_diff") for r in metrics],
                   "ours_logprob_abs_diff_max": [r.get("train/rollout_logprob_abs_diff_max") for r in metrics],
                   "ours_reward_kept": [r["rollout/reward_mean"] for r in metrics],
                   "ours_prompts_drawn": [r.get("rollout/prompts_drawn") for r in metrics],
                   "ours_response_len": [r.get("rollout/response_len_mean") for r in metrics]}
    if not args.skip_trl:
        steps_file = out_dir / f"{stem}_trl_steps.jsonl"
        steps_file.unlink(missing_ok=True)
        trl_steps = run_trl(args, model, rows, work, progress=steps_file.with_suffix(".partial.jsonl"))
        steps_file.write_text("".join(json.dumps(s) + "\n" for s in trl_steps))
        trl_rewards = [s.get("reward_mean") for s in trl_steps]
        result |= {"trl_step_s": mean_after([s["step_s"] for s in trl_steps], args.warmup),
                   "trl_step_s_series": [s["step_s"] for s in trl_steps], "trl_reward": trl_rewards,
                   "trl_response_len": [s.get("response_len_mean") for s in trl_steps]}
    if "ours_step_s" in result and "trl_step_s" in result:
        result["ratio"] = result["trl_step_s"] / result["ours_step_s"]
    args.out.write_text(json.dumps(result, indent=2))
    plot(ours_rewards, trl_rewards, out_dir / f"{stem}_reward.png",
         f"{args.task}: {args.prompts}x{args.group}, <= {args.max_new_tokens} new tokens, lr {args.lr}")
    print(json.dumps({k: result.get(k) for k in ("ours_step_s", "trl_step_s", "ratio")}))


if __name__ == "__main__":
    main()
