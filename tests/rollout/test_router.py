"""sglang-router (the PyPI binary wheel, CPU is enough) in front of two real built-in engines: the
rollout's /generate goes through the router and reaches both engines (counted by each engine
itself), and an abort, which the router has no route for, names each live request by its exact rid
and goes to every engine directly (the engine that does not hold a rid drops it, as SGLang 0.5.23's
tokenizer manager does). launch/setup.sh installs sglang-router (the `dev` extra)."""

from __future__ import annotations

import asyncio
import subprocess
import time

import httpx
import pytest
from rollout_testlib import row, start_server

from slime_rl.config import RolloutConfig
from slime_rl.data import Sample
from slime_rl.engines.client import AsyncRouterClient
from slime_rl.engines.launch import router_command, wait_healthy
from slime_rl.rollout.generate import generate_groups
from slime_rl.rollout.routing import ClientPool

pytest.importorskip("sglang_router.launch_router", reason="sglang-router is not installed "
                    "(pip install slime_rl[router])")

KEY = "router-test-key"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def routed(tiny_qwen2, tmp_path_factory):
    """(router URL, [two embedded servers]) with the engines requiring the run's API key."""
    servers = [start_server(tiny_qwen2, random_seed=21 + k, max_running_requests=16, api_key=KEY) for k in range(2)]
    port = _free_port()
    log = tmp_path_factory.mktemp("router") / "router.log"
    cmd = router_command("127.0.0.1", port, [s.url for s in servers], api_key=KEY,
                         extra={"policy": "round_robin", "prometheus_port": _free_port(), "log_level": "warn"})
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, timeout=60, process=proc, log_path=log)
        from slime_rl.orchestration.router import wait_workers

        wait_workers(url, [s.url for s in servers], timeout=60, api_key=KEY)
        yield url, servers
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM: the router shuts down gracefully
        for s in servers:
            s.shutdown()


def stat(server, key: str) -> int:
    return server.engine.stats[key]


def run(url, servers, body):
    async def main():
        client = AsyncRouterClient(url, [s.url for s in servers], api_key=KEY, timeout=120)
        try:
            return await body(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_generate_through_the_router_reaches_both_engines(routed):
    url, servers = routed
    before = [stat(s, "requests_finished") for s in servers]
    cfg = RolloutConfig(n_samples_per_prompt=4, max_response_len=6, concurrency_per_engine=2)
    tok = servers[0].tokenizer

    async def body(client):
        pool = ClientPool([client], tok, per_engine=2)
        groups = await generate_groups([client], [row(k) for k in range(4)], cfg, lambda s: 0.0, tok,
                                       progress=False, pool=pool)
        return groups, pool

    groups, pool = run(url, servers, body)
    assert sum(len(g) for g in groups) == 16
    assert all(len(s.response_ids) > 0 and len(s.rollout_logprobs) == len(s.response_ids) for g in groups for s in g)
    # what each engine counted itself: both served requests, together exactly the 16 sent
    served = [stat(s, "requests_finished") - b for s, b in zip(servers, before, strict=True)]
    assert all(n > 0 for n in served) and sum(served) == 16, served
    (counter,) = pool.counters()
    assert counter["sent"] == 16 and counter["in_flight"] == 0 and 2 < counter["peak"] <= 4  # cap: 2 per engine


def test_an_abort_reaches_every_engine_behind_the_router(routed):
    url, servers = routed
    tok = servers[0].tokenizer
    aborted_before = [stat(s, "requests_aborted") for s in servers]

    async def body(client):
        pool = ClientPool([client], tok, per_engine=8)
        samples = [Sample(group_index=7, index=i, prompt="p", prompt_ids=row(i).prompt_ids) for i in range(6)]
        params = {"max_new_tokens": 4000, "ignore_eos": True, "temperature": 1.0}
        tasks = [asyncio.create_task(pool.generate(s, s.prompt_ids, params)) for s in samples]
        deadline = time.monotonic() + 60
        def held(s) -> int:
            return s.engine.load()["num_running_reqs"] + s.engine.load()["num_waiting_reqs"]

        # all 6 have reached an engine, and both engines hold some (an abort cannot catch a request
        # still on its way; the rollout re-aborts for that, see rollout.dynamic)
        while not (sum(held(s) for s in servers) == 6 and all(held(s) > 0 for s in servers)):
            assert time.monotonic() < deadline, [s.engine.load() for s in servers]
            await asyncio.sleep(0.05)
        calls = await pool.abort_groups([7])
        return calls, await asyncio.gather(*tasks)

    calls, outs = run(url, servers, body)
    # one call per live request on the router client (its exact rid), each fanned out to both engines:
    # the router chose the engine, so the client cannot know which one holds the rid
    assert calls == 6
    assert all(o["meta_info"]["finish_reason"]["type"] == "abort" for o in outs)
    assert all(len(o["output_ids"]) < 4000 for o in outs)
    aborted = [stat(s, "requests_aborted") - b for s, b in zip(servers, aborted_before, strict=True)]
    assert all(n > 0 for n in aborted) and sum(aborted) == 6, aborted


def test_the_router_has_no_route_for_abort_and_forwards_our_key(routed):
    """Why the client sends aborts to the engines: the router answers 404 for /abort_request. With
    --api-key the router also asks its callers for the key, and passes /generate on to the engines."""
    url, _ = routed
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=url, timeout=60) as c:
        assert c.post("/abort_request", json={"rid": "x"}, headers=auth).status_code == 404
        assert c.post("/generate", json=body).status_code == 401
        assert c.post("/generate", json=body, headers=auth).status_code == 200
