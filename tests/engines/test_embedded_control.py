"""Control endpoints: abort, the three pause modes, continue, API key, health and model info."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import httpx
import pytest
from engine_testlib import prompt_of, start_server

LONG = {"max_new_tokens": 200, "ignore_eos": True}
# a short request that always runs its 2 tokens: the engine's sampler is shared, so its state (and
# whether EOS comes first) depends on how many steps earlier requests ran
SHORT = {"max_new_tokens": 2, "ignore_eos": True}


def in_thread(fn: Callable[[], httpx.Response]) -> tuple[threading.Thread, dict]:
    box: dict = {}

    def run() -> None:
        box["response"] = fn()

    t = threading.Thread(target=run)
    t.start()
    return t, box


def post(url: str, path: str, body: dict) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=120) as c:
        return c.post(path, json=body)


def wait_for(cond: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def running(server) -> int:
    return server.engine.load()["num_running_reqs"]


@pytest.fixture()
def fresh(tiny_qwen2):
    """A server of its own: these tests pause it, and a paused shared server would stall others."""
    s = start_server(tiny_qwen2, random_seed=5)
    yield s
    s.shutdown()


def test_abort_request_drops_a_rid_prefix_and_aborts_the_exact_rid(fresh):
    t, box = in_thread(lambda: post(fresh.url, "/generate", {"input_ids": prompt_of(5), "rid": "group7-sample0",
                                                              "sampling_params": LONG, "return_logprob": True}))
    wait_for(lambda: fresh.engine.load()["decode_forwards"] >= 3)
    # SGLang 0.5.23's tokenizer manager forwards an abort only for a rid it holds: a prefix is dropped
    r = post(fresh.url, "/abort_request", {"rid": "group7"})
    assert r.status_code == 200 and r.content == b""
    steps = fresh.engine.load()["decode_forwards"]
    wait_for(lambda: fresh.engine.load()["decode_forwards"] >= steps + 3)
    assert "response" not in box and running(fresh) == 1
    r = post(fresh.url, "/abort_request", {"rid": "group7-sample0"})
    assert r.status_code == 200 and r.content == b""
    t.join()
    out = box["response"].json()
    assert box["response"].status_code == 200
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    n = len(out["output_ids"])
    assert 0 < n < LONG["max_new_tokens"] and len(out["meta_info"]["output_token_logprobs"]) == n


def test_an_exact_live_rid_aborts_what_starts_with_it_as_sglangs_scheduler(fresh):
    # past the tokenizer manager's exact check SGLang's scheduler matches by prefix: "job-1" also
    # aborts "job-10"; "job-2" is untouched
    threads = {rid: in_thread(lambda rid=rid: post(fresh.url, "/generate", {
        "input_ids": prompt_of(4), "rid": rid, "sampling_params": LONG}))
        for rid in ("job-1", "job-10", "job-2")}
    wait_for(lambda: running(fresh) == 3)
    post(fresh.url, "/abort_request", {"rid": "job-1"})
    reasons = {}
    for rid, (t, box) in threads.items():
        t.join()
        reasons[rid] = box["response"].json()["meta_info"]["finish_reason"]["type"]
    assert reasons == {"job-1": "abort", "job-10": "abort", "job-2": "length"}


def test_pause_in_place_holds_requests_and_continue_resumes_them(fresh):
    t, box = in_thread(lambda: post(fresh.url, "/generate", {"input_ids": prompt_of(4), "sampling_params": LONG}))
    wait_for(lambda: fresh.engine.load()["decode_forwards"] >= 2)
    r = post(fresh.url, "/pause_generation", {"mode": "in_place"})
    assert r.json() == {"message": "Generation paused successfully.", "status": "ok"}
    steps = fresh.engine.load()["decode_forwards"]
    t2, box2 = in_thread(lambda: post(fresh.url, "/generate", {"input_ids": prompt_of(3),
                                                               "sampling_params": SHORT}))
    time.sleep(0.3)
    assert fresh.engine.load()["decode_forwards"] <= steps + 1  # at most the step already under way
    assert "response" not in box and "response" not in box2 and running(fresh) == 1
    assert post(fresh.url, "/continue_generation", {}).json()["status"] == "ok"
    t.join()
    t2.join()
    assert box["response"].json()["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    assert box2["response"].status_code == 200


def test_pause_abort_mode_aborts_in_flight_and_holds_new_ones(fresh):
    t, box = in_thread(lambda: post(fresh.url, "/generate", {"input_ids": prompt_of(4), "sampling_params": LONG}))
    wait_for(lambda: running(fresh) == 1)
    post(fresh.url, "/pause_generation", {})  # default mode is "abort"
    assert running(fresh) == 0  # pause returns once nothing runs
    t.join()
    assert box["response"].json()["meta_info"]["finish_reason"]["type"] == "abort"
    t2, box2 = in_thread(lambda: post(fresh.url, "/generate", {"input_ids": prompt_of(3),
                                                               "sampling_params": SHORT}))
    time.sleep(0.2)
    assert "response" not in box2
    post(fresh.url, "/continue_generation", {})
    t2.join()
    assert box2["response"].json()["meta_info"]["finish_reason"]["type"] == "length"


def test_pause_retract_requeues_and_recomputes_without_changing_the_sample(fresh):
    body = {"input_ids": prompt_of(6, salt=9), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 120, "ignore_eos": True, "sampling_seed": 3}}
    plain = post(fresh.url, "/generate", body).json()
    t, box = in_thread(lambda: post(fresh.url, "/generate", body))
    wait_for(lambda: running(fresh) == 1 and fresh.engine.load()["decode_forwards"] > 0)
    post(fresh.url, "/pause_generation", {"mode": "retract"})
    assert running(fresh) == 0 and fresh.engine.load()["num_waiting_reqs"] == 1
    post(fresh.url, "/continue_generation", {})
    t.join()
    out = box["response"].json()
    assert out["meta_info"]["num_retractions"] == 1
    assert out["output_ids"] == plain["output_ids"]  # re-prefilled KV cache, same weights, same seed


def test_api_key_guards_everything_but_health(tiny_qwen2):
    s = start_server(tiny_qwen2, api_key="sekret")
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            assert c.get("/health_generate").status_code == 200
            for method, path in [("GET", "/get_model_info"), ("POST", "/flush_cache"),
                                 ("POST", "/pause_generation"), ("POST", "/generate")]:
                r = c.request(method, path, json={})
                assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}, path
                bad = c.request(method, path, json={}, headers={"Authorization": "Bearer wrong"})
                assert bad.status_code == 401, path
            ok = c.get("/get_model_info", headers={"Authorization": "Bearer sekret"})
            assert ok.status_code == 200 and ok.json()["weight_version"] == "default"
            gen = c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
                         headers={"Authorization": "Bearer sekret"})
            assert gen.status_code == 200
    finally:
        s.shutdown()


def test_health_model_info_flush_and_unknown_path(http, tiny_qwen2):
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    info = http.get("/get_model_info").json()
    assert info["model_path"] == str(tiny_qwen2) and info["is_generation"] is True
    assert info["model_type"] == "qwen2" and "weight_version" in info
    r = http.post("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed")
    assert http.post("/no_such_endpoint", json={}).status_code == 404
    r = http.post("/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("mode:")


def test_a_failing_forward_fails_its_requests_and_the_engine_lives_on(fresh):
    real = fresh.model.forward
    calls = {"n": 0}

    def broken(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated device failure")
        return real(*args, **kwargs)

    fresh.model.forward = broken
    try:
        r = post(fresh.url, "/generate", {"input_ids": prompt_of(3), "sampling_params": SHORT})
        assert r.status_code == 500 and "simulated device failure" in r.json()["error"]["message"]
        ok = post(fresh.url, "/generate", {"input_ids": prompt_of(3), "sampling_params": SHORT})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2
    finally:
        fresh.model.forward = real
