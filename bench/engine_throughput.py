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

STAT_KEYS = ("decode_forwards", "graph_captures", "graph_replays", "static_eager_steps")


def engine_run(ckpt: Path, prompts: list[list[int]], new_tokens: int, cuda: bool, log: Path,
               graphs: bool) -> dict:
    from slime_rl.engines.launch import embedded_command, wait_healthy
    from slime_rl.rollout.client import EngineClient

    port = free_port()
    argv = embedded_command(ckpt, "127.0.0.1", port, device="cuda" if cuda else "cpu",
                            dtype="bfloat16" if cuda else "float32", disable_cuda_graph=not graphs)
    argv += ["--max-running-requests", str(len(prompts))]
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
            t0 = time.perf_counter()
            outs = client.generate(prompts, params, return_logprob=False)
            seconds = time.perf_counter() - t0
            state = client.get_server_info()["internal_states"][0]
        return {"s": seconds, "tokens": sum(len(o["output_ids"]) for o in outs), "first_run_s": first,
                **{k: state[k] for k in STAT_KEYS if k in state}}
    finally:
        proc.terminate()
        proc.wait(timeout=60)


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
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, a few tokens")
    a = p.parse_args()
    if a.smoke:
        a.shape, a.prompts, a.prompt_len, a.new_tokens = "tiny", 4, 8, 8
    cuda = torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="engine_tp_"))
    ckpt = make_checkpoint(a.shape, work / "model", cuda)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, SHAPES[a.shape]["vocab_size"], (a.prompts, a.prompt_len), generator=g).tolist()

    runs = {}
    for name, graphs in [("engine", True)] + ([] if a.skip_eager else [("engine_eager", False)]):
        r = runs[name] = engine_run(ckpt, prompts, a.new_tokens, cuda, work / f"{name}.log", graphs)
        stats = ", ".join(f"{k} {r[k]}" for k in STAT_KEYS if k in r)
        print(f"{name}: {r['tokens']} tokens in {r['s']:.2f} s = {r['tokens'] / r['s']:,.0f} tokens/s "
              f"(first run {r['first_run_s']:.2f} s; counters over both runs: {stats})", flush=True)
    h_s, h_tok = hf_run(ckpt, prompts, a.new_tokens, cuda)
    print(f"HF generate: {h_tok} tokens in {h_s:.2f} s = {h_tok / h_s:,.0f} tokens/s", flush=True)
    expected = a.prompts * a.new_tokens
    counts = {name: r["tokens"] for name, r in runs.items()} | {"hf": h_tok}
    if any(n != expected for n in counts.values()):
        raise SystemExit(f"token counts differ from prompts x new tokens ({expected}): {counts}")
    ratios = {name: (r["tokens"] / r["s"]) / (h_tok / h_s) for name, r in runs.items()}
    if a.out:
        Path(a.out).write_text(json.dumps({
            "shape": a.shape, "prompts": a.prompts, "prompt_len": a.prompt_len, "new_tokens": a.new_tokens,
            **{f"{name}_{k}": v for name, r in runs.items() for k, v in r.items()},
            **{f"{name}_tokens_per_s": r["tokens"] / r["s"] for name, r in runs.items()},
            "hf_s": h_s, "hf_tokens_per_s": h_tok / h_s, "ratio_eager": ratios.get("engine_eager"),
            "ratio": ratios["engine"], "device": torch.cuda.get_device_name(0) if cuda else "cpu"}, indent=2))
    if "engine_eager" in ratios:
        print(f"ratio (engine without CUDA graphs / HF generate tokens/s) {ratios['engine_eager']:.2f}")
    print(f"ratio (engine / HF generate tokens/s) {ratios['engine']:.2f}")


if __name__ == "__main__":
    main()
