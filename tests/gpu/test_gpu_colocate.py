"""--colocate on ONE GPU: the trainer rank and the built-in engine share the device (half a GPU each
in Ray's eyes); the engine releases its weights and KV cache while the trainer trains, and gets the
new weights by CUDA IPC (/update_weights_from_tensor). Marked `gpu` (skipped without CUDA)."""

from __future__ import annotations

import hashlib
import json

import pytest

from slime_rl.config import build_config
from slime_rl.engines.client import EngineClient, EngineError
from slime_rl.observability import REQUIRED_KEYS
from slime_rl.train import preflight, train

pytestmark = pytest.mark.gpu


def argv(model, data, run_dir, steps):
    return ["--hf-checkpoint", str(model), "--prompt-data", str(data), "--run-dir", str(run_dir), "--colocate",
            "--rollout-batch-size", "16", "--n-samples-per-prompt", "8", "--global-batch-size", "64",
            "--micro-batch-size", "32", "--rollout-max-response-len", "8", "--num-rollout", str(steps),
            "--rm-type", "digit", "--lr", "0.002", "--bf16"]


def _data(tmp_path, seed):
    from slime_rl.data.digits import make_rows, write_jsonl

    return write_jsonl(make_rows(64, seed=seed), tmp_path / "d.jsonl")


def test_gpu_colocated_loop_three_steps(ray_one_gpu, wider_model, tmp_path):
    cfg, plan = preflight(build_config(argv(wider_model, _data(tmp_path, 5), tmp_path / "run", steps=3)))
    assert plan.use_gpu and plan.colocated and len(plan.bundles) == 1 and plan.actor_gpu == 0.5
    rows = train(cfg, plan)
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines == rows and len(rows) == 3
    for row in rows:
        assert not set(REQUIRED_KEYS) - set(row)
        assert row["perf/weight_sync_GBps"] > 0  # every step hands the weights over (IPC)
        print(json.dumps({k: row[k] for k in REQUIRED_KEYS}))
    diffs = [r["train/rollout_logprob_abs_diff"] for r in rows]
    assert max(diffs) <= 2e-2, diffs  # bf16


def _sha(t) -> str:  # as the engine's /weights_checksum: sha256 of each tensor's float32 bytes
    return hashlib.sha256(t.astype("float32").tobytes()).hexdigest()


def test_gpu_release_frees_the_engine_weights_and_ipc_refills_them(ray_one_gpu, wider_model, tmp_path):
    from slime_rl.orchestration.cluster import Cluster

    cfg = build_config(argv(wider_model, _data(tmp_path, 6), tmp_path / "run", steps=1))
    cluster = Cluster(*preflight(cfg), api_key="k")
    try:
        cluster.start(train_iters=2)
        cluster.generate(0)
        (url,) = cluster.engine_urls
        with EngineClient(url, api_key="k") as c:
            before = c.get_server_info()["memory_occupation"]
            cluster.release_engines()
            after = c.get_server_info()["memory_occupation"]
            print(json.dumps({"before": before, "after": after}))
            assert before["weights_bytes"] > 0 and after["weights_bytes"] == 0
            # the engine process's allocated CUDA memory fell by at least its weights
            assert before["cuda_allocated_bytes"] - after["cuda_allocated_bytes"] >= before["weights_bytes"]
            with pytest.raises(EngineError, match="503"):
                c.generate([1, 2, 3], {"max_new_tokens": 2})
            cluster.train(0)
            assert cluster.sync_weights(version="1")["perf/weight_sync_GBps"] > 0
            resumed = c.get_server_info()["memory_occupation"]
            assert resumed["weights_bytes"] == before["weights_bytes"] and resumed["weights_to_refill"] == 0
            engine = c._call("GET", "/weights_checksum")
            trainer = cluster.trainers.hf_weights()
            assert {n: engine["tensors"][n] for n in trainer} == {n: _sha(t) for n, t in trainer.items()}
            assert c.generate([1, 2, 3], {"max_new_tokens": 2})["meta_info"]["weight_version"] == "1"
    finally:
        cluster.shutdown()
