"""--colocate on CPU: each engine shares a trainer rank's bundle, releases its memory while the trainer
trains, and gets the weights in place (shared-memory storages through /update_weights_from_tensor)
instead of by broadcast. Same flow as on one GPU; nothing is faked."""

from __future__ import annotations

import hashlib

import pytest

from slime_rl.config import build_config
from slime_rl.engines.client import EngineClient, EngineError
from slime_rl.observability import REQUIRED_KEYS
from slime_rl.train import preflight, train
from tests.e2e.test_loop import argv
from tests.loop_checks import digit_data_fixture

digit_data = digit_data_fixture(64, seed=4)
COLOCATE = ["--colocate", "--rollout-num-gpus", "2"]  # 2 engines on the 2 trainer ranks' bundles (TP 2)


@pytest.mark.slow
def test_colocated_loop_two_steps(ray_session, tiny_qwen2, digit_data, tmp_path):
    rows = train(*preflight(build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2) + COLOCATE)))
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert not set(REQUIRED_KEYS) - set(row)
        assert row["perf/weight_sync_GBps"] > 0 and row["perf/release_s"] > 0
        # the sync's parts (resume the weights, send, resume the KV cache) are inside its wall time,
        # and the send's own phases inside the send
        parts = [row["perf/resume_weights_s"], row["perf/weight_sync_send_s"], row["perf/resume_kv_cache_s"]]
        assert all(p > 0 for p in parts) and sum(parts) <= row["perf/weight_sync_s"]
        send_phases = sum(row[f"perf/weight_sync_{k}_s"] for k in ("build", "fill", "http_wait"))
        assert send_phases <= row["perf/weight_sync_send_s"]
        print({k: row[k] for k in ("step", "train/rollout_logprob_abs_diff", "perf/weight_sync_GBps", "train/grad_norm",
                                   "rollout/reward_mean", "rollout/response_len_mean", "train/loss",
                                   "perf/weight_sync_s", "perf/release_s")})
    assert rows[0]["train/rollout_logprob_abs_diff"] <= 1e-3  # step 0: the engines hold the checkpoint's weights
    assert rows[1]["train/rollout_logprob_abs_diff"] <= 1e-2  # step 1: generated with the handed-over weights


def _sha(t) -> str:  # as the engine's /weights_checksum: sha256 of each tensor's float32 bytes
    return hashlib.sha256(t.astype("float32").tobytes()).hexdigest()


@pytest.mark.slow
def test_release_train_resume_hand_over(ray_session, tiny_qwen2, digit_data, tmp_path):
    from slime_rl.orchestration.cluster import Cluster

    cfg = build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=1) + COLOCATE
                       + ["--custom-rm-path", "tests.plugins.example_reward:index_reward"])
    cfg, plan = preflight(cfg)
    assert plan.colocated and [s.bundles for s in plan.engines] == [(0,), (1,)] and len(plan.bundles) == 2
    cluster = Cluster(cfg, plan, api_key="k")
    try:
        cluster.start(train_iters=2)
        cluster.generate(0)
        before = {}
        for url in cluster.engine_urls:
            with EngineClient(url, api_key="k") as c:
                before[url] = c._call("GET", "/weights_checksum")["tensors"]
        cluster.release_engines()
        for url in cluster.engine_urls:
            with EngineClient(url, api_key="k") as c:
                assert c.get_server_info()["memory_occupation"]["weights_bytes"] == 0
                with pytest.raises(EngineError, match="503.*resume_memory_occupation"):
                    c.generate([1, 2, 3], {"max_new_tokens": 2})
        cluster.train(0)
        metrics = cluster.sync_weights(version="1")
        assert metrics["perf/weight_sync_GBps"] > 0
        trainer = cluster.trainers.hf_weights()
        for url in cluster.engine_urls:
            with EngineClient(url, api_key="k") as c:
                engine = c._call("GET", "/weights_checksum")
                assert engine["weight_version"] == "1"
                assert {n: engine["tensors"][n] for n in trainer} == {n: _sha(t) for n, t in trainer.items()}
                assert engine["tensors"] != before[url]  # the update moved the weights
                assert c.generate([1, 2, 3], {"max_new_tokens": 2})["meta_info"]["weight_version"] == "1"
    finally:
        cluster.shutdown()
