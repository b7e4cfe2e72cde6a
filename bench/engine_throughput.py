"""Built-in engine generation throughput against HF `generate`, same model, prompts and sampling
settings, in one run.

Engine: `python -m slime_rl.engines.embedded` on the GPU, driven over SGLang's /generate with all
prompts in one batched request (its scheduler runs them as one continuous batch); by default it
decodes on its static KV cache with CUDA graphs, and a second engine with `--disable-cuda-graph`
(the eager, dynamic-cache path) is measured too unless --skip-eager. Each engine serves the whole
batch twice: the first run captures the CUDA graphs it needs (SGLang captures at start-up) and is
reported as "first run"; the second is the measurement. HF: the same checkpoint loaded with
transformers in this process, `model.generate` on the same prompts (left padding is not needed:
every prompt has the same length). All sample at temperature 1 with no top-k/top-p and ignore EOS,
so all produce exactly prompts x new-tokens tokens.

    python bench/engine_throughput.py [--shape 1.5b] [--prompts 64] [--prompt-len 128] [--new-tokens 256]
                                      [--skip-eager] [--out FILE.json]
    python bench/engine_throughput.py --smoke     # CPU, tiny model: checks that it runs (the "graph"
                                                  # engine runs the static cache without graphs there)

Decode step vs the memory roofline (`--decode-batches 64,256`): for each batch size b the engine
(default path) decodes b prompts together; its scheduler's own timers (decode_s / decode_forwards in
/get_server_info; each step ends with the device->host copy of a step's tokens: its own, or with the
overlap scheduler, on by default, the previous step's, read while this one runs) give the step time;
the output says whether overlap was on (`--disable-overlap-schedule` turns it off). The
roofline step reads every weight once plus each row's KV cache (the mean context over the run) at
the device bandwidth measured in this run (a large device-to-device copy: read + write bytes / s).
`--out` then holds decode_step_s_b{b}, roofline_step_s_b{b}, step_over_roofline_b{b} and
prefill_tokens_per_s (prompt tokens the prefill forwards computed / their time).

Prints one line per run and the ratio engine (CUDA graphs) / HF tokens per second last.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import SHAPES, free_port, make_checkpoint  # noqa: E402

STAT_KEYS = ("overlap", "overlapped_steps", "decode_forwards", "graph_captures", "graph_replays",
             "static_eager_steps", "compiled_forwards")
TIMER_KEYS = ("decode_s", "decode_forwards", "prefill_s", "prefill_tokens")


def engine_run(ckpt: Path, prompts: list[list[int]], new_tokens: int, cuda: bool, log: Path,
               graphs: bool, overlap: bool = True, compile_max_bs: int = 0, extra: tuple[str, ...] = ()) -> dict:
    from slime_rl.config.builtin_engine import ServerConfig
    from slime_rl.engines.client import EngineClient
    from slime_rl.engines.launch import embedded_command, wait_healthy

    port = free_port()
    argv = embedded_command(ServerConfig(str(ckpt), "127.0.0.1", port, device="cuda" if cuda else "cpu",
                                         dtype="bfloat16" if cuda else "float32", disable_cuda_graph=not graphs,
                                         disable_overlap_schedule=not overlap))
    argv += ["--max-running-requests", str(len(prompts))]
    if compile_max_bs:
        argv += ["--enable-torch-compile", "--torch-compile-max-bs", str(compile_max_bs)]
    argv += list(extra)
    if graphs and not cuda:
        argv += ["--static-kv-cache"]  # CPU smoke: the same static path, without graph capture
    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout=600, process=proc, log_path=log)
        params = {"max_new_tokens": new_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": -1,
                  "ignore_eos": True}
        with EngineClient(url) as client:
            t0 = time.perf_counter()
            client.generate(prompts, params, return_logprob=False)  # first run: captures the graphs
            first = time.perf_counter() - t0
            before = client.get_server_info()["internal_states"][0]
            t0 = time.perf_counter()
            outs = client.generate(prompts, params, return_logprob=False)
            seconds = time.perf_counter() - t0
            state = client.get_server_info()["internal_states"][0]
        # the measured (second) run only
        timers = {k: state[k] - before[k] for k in TIMER_KEYS if k in state}
        return {"s": seconds, "tokens": sum(len(o["output_ids"]) for o in outs), "first_run_s": first,
                **{k: state[k] for k in STAT_KEYS if k in state}, **{f"run_{k}": v for k, v in timers.items()}}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def device_bandwidth(cuda: bool) -> float:
    """Bytes per second of a large copy (read + write), best of 3: the roofline's denominator."""
    n = (2 << 30) if cuda else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = 0.0
    for _ in range(3):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        if cuda:
            torch.cuda.synchronize()
        best = max(best, 2 * n * 5 / (time.perf_counter() - t0))
    del src, dst
    return best


def step_bytes(ckpt: Path, batch: int, context: float, elem: int) -> tuple[int, float]:
    """(weight bytes, KV bytes) one decode step reads: every parameter once (tied counted once) and
    each row's keys and values over `context` tokens in every layer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(ckpt)
    with torch.device("meta"):
        params = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = batch * context * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * elem
    return params * elem, kv


def hf_run(ckpt: Path, prompts: list[list[int]], new_tokens: int, cuda: bool) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    device = "cuda" if cuda else "cpu"
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16 if cuda else torch.float32).to(device)
    model.eval()
    ids = torch.tensor(prompts, device=device)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0, eos_token_id=None)

    def gen(x: torch.Tensor, n: int) -> torch.Tensor:
        with torch.no_grad():
            return model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n, **kw)

    gen(ids[:4], 8)  # warm-up
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = gen(ids, new_tokens)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    produced = (out.shape[1] - ids.shape[1]) * out.shape[0]
    return seconds, produced


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="1.5b", choices=sorted(SHAPES))
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--skip-eager", action="store_true", help="do not measure the engine with --disable-cuda-graph")
    p.add_argument("--decode-batches", default="64,256",
                   help="batch sizes whose decode step is compared with the memory roofline ('' = none)")
    p.add_argument("--skip-hf", action="store_true", help="do not measure HF generate")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="run the engines with SGLang's --disable-overlap-schedule (each step's tokens read "
                        "before the next step is launched)")
    p.add_argument("--enable-torch-compile", action="store_true",
                   help="run the engines with SGLang's --enable-torch-compile (the decode step's RMSNorms, MLPs "
                        "and RoPE compiled; the first run pays the compile) and --torch-compile-max-bs covering "
                        "every batch")
    p.add_argument("--enable-deterministic-inference", action="store_true",
                   help="run the engines with --enable-deterministic-inference (on CUDA: flash decode attention "
                        "over a time-major slot cache and varlen prefill, the trainer's kernels)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few tokens")
    a = p.parse_args()
    if a.smoke:
        a.shape, a.prompts, a.prompt_len, a.new_tokens = "tiny", 4, 8, 8
        a.decode_batches = "4"  # the main run's batch: its figures, without one more engine start
    cuda = torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="engine_tp_"))
    ckpt = make_checkpoint(a.shape, work / "model", cuda)
    g = torch.Generator().manual_seed(0)

    batches = [int(b) for b in a.decode_batches.split(",") if b.strip()]
    n_prompts = max([a.prompts] + batches)
    prompts = torch.randint(0, SHAPES[a.shape]["vocab_size"], (n_prompts, a.prompt_len), generator=g).tolist()
    main_prompts = prompts[:a.prompts]
    compile_bs = n_prompts if a.enable_torch_compile else 0

    runs = {}
    for name, graphs in [("engine", True)] + ([] if a.skip_eager else [("engine_eager", False)]):
        r = runs[name] = engine_run(ckpt, main_prompts, a.new_tokens, cuda, work / f"{name}.log", graphs,
                                    overlap=not a.disable_overlap_schedule, compile_max_bs=compile_bs,
                                    extra=extra_flags(a))
        stats = ", ".join(f"{k} {r[k]}" for k in STAT_KEYS if k in r)
        print(f"{name}: {r['tokens']} tokens in {r['s']:.2f} s = {r['tokens'] / r['s']:,.0f} tokens/s "
              f"(first run {r['first_run_s']:.2f} s; counters over both runs: {stats})", flush=True)
    result = {"shape": a.shape, "prompts": a.prompts, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
              "device": torch.cuda.get_device_name(0) if cuda else "cpu",
              # the engine's overlap scheduler (its /get_server_info)
              "overlap": runs["engine"].get("overlap"), "torch_compile": a.enable_torch_compile,
              "deterministic_inference": a.enable_deterministic_inference}
    result.update(roofline(ckpt, prompts, batches, runs["engine"], a, cuda, work, compile_bs))
    expected = a.prompts * a.new_tokens
    counts = {name: r["tokens"] for name, r in runs.items()}
    if not a.skip_hf:
        h_s, h_tok = hf_run(ckpt, main_prompts, a.new_tokens, cuda)
        print(f"HF generate: {h_tok} tokens in {h_s:.2f} s = {h_tok / h_s:,.0f} tokens/s", flush=True)
        counts["hf"] = h_tok
        ratios = {name: (r["tokens"] / r["s"]) / (h_tok / h_s) for name, r in runs.items()}
        result.update({"hf_s": h_s, "hf_tokens_per_s": h_tok / h_s, "ratio_eager": ratios.get("engine_eager"),
                       "ratio": ratios["engine"]})
    if any(n != expected for n in counts.values()):
        raise SystemExit(f"token counts differ from prompts x new tokens ({expected}): {counts}")
    result.update({f"{name}_{k}": v for name, r in runs.items() for k, v in r.items()})
    result.update({f"{name}_tokens_per_s": r["tokens"] / r["s"] for name, r in runs.items()})
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    if "ratio_eager" in result and result["ratio_eager"] is not None:
        print(f"ratio (engine without CUDA graphs / HF generate tokens/s) {result['ratio_eager']:.2f}")
    if "ratio" in result:
        print(f"ratio (engine / HF generate tokens/s) {result['ratio']:.2f}")


def extra_flags(a: argparse.Namespace) -> tuple[str, ...]:
    return ("--enable-deterministic-inference",) if a.enable_deterministic_inference else ()


# the H200's memory bandwidth by its datasheet (bytes/s): the second denominator printed beside the
# measured copy bandwidth (a copy reaches about 4.2 TB/s of it)
SPEC_BYTES_PER_S = 4.8e12


def roofline(ckpt: Path, prompts: list[list[int]], batches: list[int], main_run: dict, a: argparse.Namespace,
             cuda: bool, work: Path, compile_bs: int) -> dict:
    """decode_step_s_b{b} (the default engine path, b rows decoding together), roofline_step_s_b{b},
    their ratio, and prefill_tokens_per_s; prints one line per batch size."""
    out: dict = {}
    if not batches:
        return out
    bw = device_bandwidth(cuda)
    elem = 2 if cuda else 4  # bf16 on CUDA, fp32 on CPU (engine_run's --dtype)
    context = a.prompt_len + a.new_tokens / 2  # mean tokens in a row's cache over its decode steps
    out["device_copy_bytes_per_s"] = bw
    print(f"device copy bandwidth {bw / 1e12:.3f} TB/s (read + write)", flush=True)
    prefill_s = prefill_tok = 0.0
    for b in batches:
        r = main_run if b == a.prompts else engine_run(ckpt, prompts[:b], a.new_tokens, cuda,
                                                       work / f"engine_b{b}.log", True,
                                                       overlap=not a.disable_overlap_schedule,
                                                       compile_max_bs=compile_bs, extra=extra_flags(a))
        step = r["run_decode_s"] / max(r["run_decode_forwards"], 1)
        weights, kv = step_bytes(ckpt, b, context, elem)
        ideal = (weights + kv) / bw
        spec = (weights + kv) / SPEC_BYTES_PER_S
        out.update({f"decode_step_s_b{b}": step, f"roofline_step_s_b{b}": ideal,
                    f"step_over_roofline_b{b}": step / ideal, f"step_bytes_b{b}": weights + kv,
                    f"step_over_spec_b{b}": step / spec})
        prefill_s += r["run_prefill_s"]
        prefill_tok += r["run_prefill_tokens"]
        print(f"decode batch {b}: {1e3 * step:.3f} ms per step, roofline {1e3 * ideal:.3f} ms "
              f"({(weights + kv) / 1e9:.2f} GB: weights {weights / 1e9:.2f}, KV {kv / 1e9:.2f}) -> "
              f"{step / ideal:.1f}x the roofline, {step / spec:.1f}x at the H200's 4.8 TB/s "
              f"(overlap {'on' if r.get('overlap') else 'off'})", flush=True)
    out["prefill_tokens_per_s"] = prefill_tok / prefill_s if prefill_s else None
    print(f"prefill: {prefill_tok:.0f} prompt tokens in {prefill_s:.3f} s = {out['prefill_tokens_per_s']:,.0f} "
          f"tokens/s", flush=True)
    return out

if __name__ == "__main__":
    main()
