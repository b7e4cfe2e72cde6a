"""The embedded engine's side of SGLang 0.5.23's weight-update contract (issue #17), over HTTP.

Expected answers are read from SGLang's source, not from our engine:
- weight_updater.py (SchedulerWeightUpdaterManager): the session messages, refusal of updates outside
  a session; http_server.py: 400 for success=false on /begin_weight_update, /end_weight_update,
  /update_weights_from_*; /get_model_info and /get_server_info answer as /model_info, /server_info.
- constants.py: memory-saver tags "weights", "kv_cache", "cuda_graph"; the manager's resume removes
  each tag from its released set (a tag not released raises, answered 400); None means all three.
- released weights are dropped unless --enable-weights-cpu-backup.
tests/contract/ drives SGLang's own manager with the same sequences.
"""

from __future__ import annotations

import logging

import httpx
import pytest
from engine_testlib import prompt_of, start_server

from slime_rl.engines.client import EngineClient

OUTSIDE = "{} must run between begin_weight_update() and end_weight_update()"
ALREADY_OPEN = "a weight-update session is already open; call end_weight_update() first"
NOT_OPEN = "no weight-update session is open; call begin_weight_update() first"


def greedy(http: httpx.Client) -> httpx.Response:
    return http.post("/generate", json={"input_ids": prompt_of(6), "sampling_params": {
        "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}})


@pytest.mark.parametrize("endpoint", ["update_weights_from_distributed", "update_weights_from_tensor"])
def test_updates_outside_a_session_are_refused_400(http, endpoint):
    body = ({"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
            if endpoint.endswith("distributed") else {"serialized_named_tensors": ["AAAA"]})
    r = http.post(f"/{endpoint}", json=body)
    assert r.status_code == 400
    assert r.json() == {"success": False, "message": OUTSIDE.format(endpoint)}


def test_session_begin_twice_and_end_without_begin_are_refused(http):
    r = http.post("/end_weight_update", json={})
    assert (r.status_code, r.json()) == (400, {"success": False, "message": NOT_OPEN})
    r = http.post("/begin_weight_update", json={})
    assert (r.status_code, r.json()) == (200, {"success": True, "message": "Success"})
    try:
        r = http.post("/begin_weight_update", json={"selector": "target"})
        assert (r.status_code, r.json()) == (400, {"success": False, "message": ALREADY_OPEN})
        # inside the session the update is no longer refused for the session: it fails on its group
        r = http.post("/update_weights_from_distributed", json={
            "names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "none"})
        assert r.status_code == 400 and "init_weights_update_group" in r.json()["message"]
    finally:
        r = http.post("/end_weight_update", json={})
    assert (r.status_code, r.json()) == (200, {"success": True, "message": "Success"})
    r = http.post("/end_weight_update", json={})
    assert r.status_code == 400


def test_session_selector_must_be_one_of_sglangs(http):
    r = http.post("/begin_weight_update", json={"selector": "both"})
    assert r.status_code == 400 and "selector" in r.json()["error"]["message"]
    assert http.post("/end_weight_update", json={}).status_code == 400  # nothing was opened


def test_deprecated_info_endpoints_answer_as_the_new_ones_with_a_warning(http, caplog):
    with caplog.at_level(logging.WARNING, logger="slime_rl.engines.embedded.server"):
        assert http.get("/model_info").json() == http.get("/get_model_info").json()
        old, new = http.get("/get_server_info").json(), http.get("/server_info").json()
    assert old.keys() == new.keys() and old["model_path"] == new["model_path"]
    warned = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert len(warned) == 2 and "'/model_info'" in warned[0] and "'/server_info'" in warned[1]


def test_the_client_calls_the_non_deprecated_info_paths():
    class Recorder(EngineClient):
        def _call(self, method, path, payload=None):
            return method, path

    with Recorder("http://engine.invalid") as c:
        assert (c.get_model_info(), c.get_server_info()) == (("GET", "/model_info"), ("GET", "/server_info"))


@pytest.fixture(scope="module", params=[False, True], ids=["dropped", "cpu_backup"])
def engine(tiny_qwen2, request):
    s = start_server(tiny_qwen2, random_seed=5, enable_weights_cpu_backup=request.param)
    yield s, request.param
    s.shutdown()


def test_memory_tags_and_weights_after_a_release(engine):
    """Release all three tags; resume the weights, then the KV cache and the CUDA graphs (the
    colocated order). Without the CPU backup the released weights are gone: the engine refuses to
    generate until a sync refills them. With it, the same tokens come back without any sync."""
    server, backup = engine
    with httpx.Client(base_url=server.url, timeout=120) as http:
        before = greedy(http).json()["output_ids"]
        assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 400  # not released
        assert http.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache", "cuda_graph"]}
                         ).status_code == 200
        assert http.get("/server_info").json()["memory_occupation"]["released_tags"] == [
            "cuda_graph", "kv_cache", "weights"]
        assert http.post("/resume_memory_occupation", json={"tags": ["weights"]}).status_code == 200
        r = http.post("/resume_memory_occupation", json={"tags": ["weights"]})  # twice: SGLang's KeyError
        assert r.status_code == 400 and "weights" in r.json()["error"]["message"]
        assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache", "cuda_graph"]}).status_code == 200
        r = greedy(http)
        if backup:
            assert r.status_code == 200 and r.json()["output_ids"] == before
        else:
            assert r.status_code == 503 and "not refilled" in r.json()["error"]["message"]
            assert http.get("/server_info").json()["memory_occupation"]["weights_to_refill"] > 0
