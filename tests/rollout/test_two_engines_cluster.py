"""Two built-in engines under Ray, the whole orchestration path (Cluster: placement, engine actors,
RolloutManager, trainer, weight broadcast), with sglang-router in front: the rollout's requests reach
both engines (each engine's own count), and both receive every weight update (same weight_version,
every tensor equal to the trainer's, bit for bit). Nothing is faked. The same without a router (the
rollout's own routing) is checked in the fault test's last step, tests/e2e/test_fault.py, whose two
engines are back by then."""

from __future__ import annotations

import importlib.util

import pytest

from slime_rl.config import build_config
from slime_rl.engines.client import EngineClient
from slime_rl.train import preflight
from tests.loop_checks import digit_data_fixture, one_step_then_compare_weights

KEY = "two-engines-secret"




digit_data = digit_data_fixture(32, seed=3)


def test_both_engines_serve_requests_and_get_every_weight_update(ray_session, tiny_qwen2, digit_data, tmp_path):
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (pip install slime_rl[router])")
    from slime_rl.orchestration.cluster import Cluster

    argv = ["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(digit_data), "--run-dir", str(tmp_path / "run"),
            "--rollout-num-gpus", "2", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
            "--global-batch-size", "16", "--micro-batch-size", "4", "--rollout-max-response-len", "6",
            "--num-rollout", "2", "--rm-type", "digit", "--lr", "0.003", "--update-weight-buffer-size", "20000",
            "--custom-rm-path", "tests.plugins.example_reward:index_reward", "--sglang-server-concurrency", "2",
            "--use-sglang-router", "--router-policy", "round_robin", "--router-log-level", "warn"]
    cluster = Cluster(*preflight(build_config(argv)), api_key=KEY)
    try:
        one_step_then_compare_weights(cluster, api_key=KEY, version="1")  # every engine: version 1, equal tensors
        assert len(cluster.engine_urls) == 2 and cluster.router_url is not None
        served = []
        for url in cluster.engine_urls:
            with EngineClient(url, api_key=KEY) as client:
                served.append(client.get_server_info()["internal_states"][0]["requests_finished"])
        assert all(n > 0 for n in served) and sum(served) == 16, served  # 4 groups x 4 samples, both engines
        cluster.sync_weights(version="2")  # a second update reaches both as well
        for url in cluster.engine_urls:
            with EngineClient(url, api_key=KEY) as client:
                assert client.get_model_info()["weight_version"] == "2"
        import httpx  # the router sees both engines

        workers = httpx.get(cluster.router_url + "/workers", headers={"Authorization": f"Bearer {KEY}"}).json()
        assert sorted(w["url"] for w in workers["workers"]) == sorted(cluster.engine_urls)
    finally:
        cluster.shutdown()
