"""The GPU benches' CPU smoke modes: each script runs end to end on a tiny model (gloo, CPU) and
prints its ratio line last. Timings are never asserted: only that the figures are there and sane."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from tests import ray_zygote
from tests.procs import run_python

ROOT = Path(__file__).resolve().parents[2]


def run_smoke(script: str, tmp_path: Path) -> tuple[str, dict]:
    """The script's --smoke run; its ratio line and its JSON. A test that takes `ray_session` has the built-in
    engines the script starts forked from the session's warm interpreter (SLIME_RL_ENGINE_PYTHON, which the
    scripts launch engines with, as the product does)."""
    import json

    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = run_python([sys.executable, str(ROOT / "bench" / script), "--smoke", "--out", str(out)], env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return lines[-1], json.loads(out.read_text())


def test_weight_sync_smoke(ray_session, tmp_path):
    last, result = run_smoke("weight_sync.py", tmp_path)
    assert re.fullmatch(r"ratio \(raw / full\) tiny=\d+\.\d{3}", last), last
    (r,) = result
    assert r["buckets"] >= 2 and r["bytes"] > 0  # 1 MiB buckets: the tiny model does not fit in one
    assert set(r["phases_s"]) >= {"pause", "continue", "build", "fill", "http_wait", "device_wait"}
    assert 0 < r["ratio"] and r["full_s"] > 0 and r["raw_s"] > 0


def test_train_mfu_smoke(tmp_path):
    last, result = run_smoke("train_mfu.py", tmp_path)
    assert last.startswith("MFU nan"), last  # no GPU, so no peak: the ratio line is still printed
    assert result["tokens_per_step"] == 2 * 64 and result["step_s"] > 0
    assert result["profile"].startswith("profiled step") and "busy time by category" in result["profile"]


@pytest.mark.parametrize("script", ["engine_throughput.py"])
def test_engine_throughput_smoke(ray_session, tmp_path, script):
    last, result = run_smoke(script, tmp_path)
    assert re.fullmatch(r"ratio \(engine / HF generate tokens/s\) \d+\.\d\d", last), last
    assert result["engine_tokens_per_s"] > 0 and result["hf_tokens_per_s"] > 0
    # the overlap scheduler is on by default, and its steps were overlapped
    assert result["overlap"] is True and result["engine_overlapped_steps"] > 0
    b = 4  # the smoke mode's decode batch (its main run's)
    assert result[f"decode_step_s_b{b}"] > 0 and result[f"roofline_step_s_b{b}"] > 0
    assert result[f"step_over_roofline_b{b}"] == result[f"decode_step_s_b{b}"] / result[f"roofline_step_s_b{b}"]
    assert not any(k.endswith("_b2") for k in result)
    # bytes a step reads, by hand for the tiny shape (bench/common.py): 2 layers, hidden 64, MLP 128,
    # vocab 64 tied, 2 KV heads of 16 dims; fp32; contexts of 8 prompt + 8 / 2 decode tokens
    params = 64 * 64 + 2 * (2 * 64 + (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128) + 64
    kv = 4 * 12 * 2 * 2 * 2 * 16
    assert result["step_bytes_b4"] == 4 * params + 4 * kv
    assert result["prefill_tokens_per_s"] > 0 and result["device_copy_bytes_per_s"] > 0


def session_address() -> str:
    """The address of the suite's Ray session, for a bench run in a subprocess to join (bench/common.ray_init)."""
    import ray

    return ray.get_runtime_context().gcs_address


@pytest.mark.slow
def test_gpu_e2e_smoke(ray_session, tmp_path):
    """The GPU end-to-end script on CPU, in its fully-async mode (the mode the GPU comparison adds to the
    synchronous loop, which the other whole-loop tests run): 3 steps of the real loop, its metrics, the raw
    JSON and the verdict line."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "RAY_AUTH_MODE": "disabled",
           "RAY_ADDRESS": session_address(), **ray_zygote.job_env()}
    cmd = [sys.executable, str(ROOT / "bench" / "gpu_e2e.py"), "--smoke", "--out", str(tmp_path / "run"),
           "--modes", "fully_async", "--json", str(tmp_path / "raw.json")]
    proc = run_python(cmd, env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1]
    assert last.startswith("disaggregated fully_async tiny: 3 steps") and last.endswith("PASS"), last
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["perf/weight_sync_GBps"] > 0 for r in rows)
    assert all(r["rollout/staleness_max"] <= 2 and r["perf/trainer_wait_s"] >= 0 for r in rows)
    raw = json.loads((tmp_path / "raw.json").read_text())
    assert raw["modes"] == {"fully_async": ["--fully-async", "--max-staleness", "2"]}
    assert raw["results"]["fully_async"]["summary"]["step_s"] > 0


@pytest.mark.slow
def test_moe_gpu_smoke(ray_session, tmp_path):
    """bench/moe_gpu.py --tiny on CPU: 3 colocated steps of the real loop with a Qwen3-MoE (weights
    refilled by expert name after every release), the parameter counts and the verdict."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "RAY_AUTH_MODE": "disabled",
           "RAY_ADDRESS": session_address(), **ray_zygote.job_env()}
    out = tmp_path / "moe.json"
    cmd = [sys.executable, str(ROOT / "bench" / "moe_gpu.py"), "--tiny", "--out", str(out)]
    proc = run_python(cmd, env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1]
    assert last.startswith("moe colocated tiny: 3 steps") and last.endswith("PASS"), last
    result = json.loads(out.read_text())
    # tiny: h 64, 2 layers, q 4x16 / kv 2x16, 8 experts of 32, top-2, vocab 64 untied, by hand:
    attn = 64 * 64 * 2 + 64 * 32 * 2  # q, o, k, v
    experts = 8 * 3 * 64 * 32
    assert result["params"]["total"] == 2 * (attn + 2 * 64 + 2 * 16 + 8 * 64 + experts) + 64 + 2 * 64 * 64
    assert result["params"]["active_matmul"] == 2 * (attn + 8 * 64 + 2 * 3 * 64 * 32) + 64 * 64
    assert [s["step"] for s in result["steps"]] == [0, 1, 2]
    assert all(s["weight_sync_GBps"] > 0 and s["gap"] <= 2e-2 for s in result["steps"])


@pytest.mark.slow
def test_profile_engine_smoke(ray_session, tmp_path):
    """bench/profile_engine.py on CPU: the phase table, from the scheduler thread's profiler too."""
    last, result = run_smoke("profile_engine.py", tmp_path)
    assert last.startswith("over HTTP (engine process, one /generate per group): 64 tokens"), last
    r = result["in_process"]
    assert r["tokens"] == 4 * 2 * 8 and r["decode_steps"] == 7  # the first token of each comes from prefill
    assert r["engine.decode_calls"] == 7 and r["prefill_forwards"] >= 1
    for label in ("engine.prefill", "engine.decode", "engine.sample", "engine.record"):
        assert r[f"{label}_host_s"] > 0, label  # the profiler saw the scheduler thread's ranges
    # one read of tokens per prefill forward and per decode step
    assert result["overlap"] is True and r["engine.record_calls"] == r["prefill_forwards"] + r["decode_steps"]
    assert result["http"]["tokens"] == result["http_grouped"]["tokens"] == 64


def test_train_memory_smoke(tmp_path):
    """CPU: no allocator figures, but the run and the estimate for the same settings go through."""
    import json

    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    out = tmp_path / "mem.jsonl"
    proc = run_python([sys.executable, str(ROOT / "bench" / "train_memory.py"), "--smoke", "--out", str(out),
                       "--ckpt-dir", str(tmp_path)], env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    last = [ln for ln in proc.stdout.splitlines() if ln.strip()][-1]
    assert re.fullmatch(r"peak nan GiB, estimate \d+\.\d\d GiB, error \+?nan", last), last
    (result,) = [json.loads(line) for line in out.read_text().splitlines()]
    # the tiny shape in fp32 (bench/common.py): weights 4 + grads 4 + Adam 8 bytes per parameter
    params = 64 * 64 + 2 * (2 * 64 + (64 * 64 + 64) + 2 * (64 * 32 + 32) + 64 * 64 + 3 * 64 * 128) + 64
    assert result["estimate_static_gib"] * 2**30 == pytest.approx(16 * params)


def test_quickstart_seeds_summary_by_hand():
    """bench/quickstart_seeds.py's figures: the first 0-based step at the threshold, the last 5 steps' mean
    (the eval line of step -1 is not a step)."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from quickstart_seeds import summarize
    finally:
        sys.path.remove(str(ROOT / "bench"))
    rewards = [0.1, 0.5, 0.95, 0.85, 0.9, 1.0, 0.9, 0.8]
    rows = [{"step": -1, "eval/x/reward_mean": 1.0}] + [{"step": k, "rollout/reward_mean": r}
                                                         for k, r in enumerate(rewards)]
    rows[0]["rollout/reward_mean"] = 0.99  # step -1 would be "first" if it counted
    out = summarize(rows, 0.9)
    assert out["first_step_at_threshold"] == 2 and out["steps"] == 8
    assert out["last5_mean"] == pytest.approx((0.85 + 0.9 + 1.0 + 0.9 + 0.8) / 5)
    assert summarize(rows[:3], 0.9)["first_step_at_threshold"] is None
