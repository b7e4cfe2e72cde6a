"""--colocate on CPU: each engine shares its trainer ranks' bundles, releases its memory while the trainer
trains, and gets the weights in place (shared-memory storages through /update_weights_from_tensor)
instead of by broadcast. Same flow as on GPUs; nothing is faked. An engine of two devices
(--rollout-num-gpus-per-engine 2) gets one request with a handle from each of its two trainer ranks;
the built-in engine, which has no tensor parallel, reads the first (engines/embedded/weights.py)."""

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
# one engine over both trainer ranks' devices
OVER_TWO = COLOCATE + ["--rollout-num-gpus-per-engine", "2", "--rollout-backend", "embedded"]


@pytest.mark.slow
def test_colocated_loop_two_steps(ray_session, tiny_qwen2, digit_data, tmp_path):
    """slime's layout: a TP-2 trainer and an engine of two devices beside its two ranks."""
    cfg, plan = preflight(build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=2) + OVER_TWO))
    assert [s.bundles for s in plan.engines] == [(0, 1)]
    rows = train(cfg, plan)
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


# (flags, each engine's trainer bundles): two engines of one device each beside the TP-2 trainer's two
# ranks; and PP 2 (each rank holds one stage; the sync broadcasts each stage's buckets to the other
# rank) with one engine over both ranks' devices
LAYOUTS = {
    "engine_per_rank": (COLOCATE, [(0,), (1,)]),
    "pp2_engine_over_two_ranks": (OVER_TWO + ["--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size",
                                              "2"], [(0, 1)]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_release_train_resume_hand_over(ray_session, tiny_qwen2, digit_data, tmp_path, layout):
    from slime_rl.orchestration.cluster import Cluster

    flags, spans = LAYOUTS[layout]
    cfg = build_config(argv(tiny_qwen2, digit_data, tmp_path / "run", steps=1) + flags
                       + ["--custom-rm-path", "tests.plugins.example_reward:index_reward"])
    cfg, plan = preflight(cfg)
    assert plan.colocated and [s.bundles for s in plan.engines] == spans and len(plan.bundles) == 2
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
                info = c.get_server_info()
                # it takes one serialized_named_tensors entry per device, and refuses any other count
                assert info["colocated_devices"] == len(spans[0])
                assert info["memory_occupation"]["weights_bytes"] == 0
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
