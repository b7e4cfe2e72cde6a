"""The router under its Ray actor, as the Cluster runs it: pinned to the driver's node, waited on
until both engines are healthy behind it, its log lines reach the driver prefixed "[router]", and
stop() ends it gracefully (exit code 0 on SIGTERM)."""

from __future__ import annotations

import time

import httpx
import pytest
import ray
from rollout_testlib import start_server

from slime_rl.config import build_config

pytest.importorskip("sglang_router.launch_router", reason="sglang-router is not installed "
                    "(pip install slime_rl[router])")
KEY = "router-actor-key"


def test_router_actor_starts_routes_logs_and_stops(ray_session, tiny_qwen2, tmp_path, capfd):
    from slime_rl.orchestration.router import start_router

    data = tmp_path / "d.jsonl"
    data.write_text('{"input": "1", "label": "1"}\n')
    cfg = build_config(["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(data), "--rollout-batch-size", "1",
                        "--num-rollout", "1", "--rm-type", "digit", "--use-sglang-router",
                        "--router-policy", "round_robin", "--router-log-level", "info"])
    servers = [start_server(tiny_qwen2, random_seed=k, api_key=KEY) for k in range(2)]
    try:
        actor, url = start_router(cfg, [s.url for s in servers], KEY, timeout=60)
        before = [s.engine.stats["requests_finished"] for s in servers]
        with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
            for _ in range(4):
                r = c.post("/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
                assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
        assert [s.engine.stats["requests_finished"] - b for s, b in zip(servers, before, strict=True)] == [2, 2]
        assert ray.get(actor.stop.remote()) == 0
        with pytest.raises(httpx.HTTPError):
            httpx.get(url + "/health", timeout=2)
        deadline = time.monotonic() + 20
        out = ""
        while "[router]" not in out and time.monotonic() < deadline:  # Ray forwards worker output with a delay
            time.sleep(0.5)
            out += capfd.readouterr().out
        assert any("[router]" in line and "/generate" in line for line in out.splitlines()), out[-2000:]
    finally:
        for s in servers:
            s.shutdown()
