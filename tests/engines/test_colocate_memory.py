"""Colocated mode on the embedded engine: /release_memory_occupation really frees the weights and
refuses /generate, /resume_memory_occupation re-allocates them (still refusing until refilled), and
/update_weights_from_tensor loads tensors another process hands over in shared memory, bit-exactly.
The restricted unpickler refuses any global that is not one of torch's rebuild functions."""

from __future__ import annotations

import base64
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from engine_testlib import prompt_of, start_server

from slime_rl.engines.tensor_ipc import UnsafePayloadError, deserialize_named_tensors
from tests.engines.tensor_sender import perturbed

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module", params=[False, True], ids=["dynamic_cache", "static_cache"])
def engine(tiny_qwen2, request):
    """Both decode paths; the static one (slot KV cache, CUDA graphs on GPUs) must drop its cache and
    graphs on release and rebuild them after the resume."""
    s = start_server(tiny_qwen2, random_seed=7, static_kv_cache=request.param)
    yield s
    s.shutdown()


@pytest.fixture()
def http(engine):
    with httpx.Client(base_url=engine.url, timeout=120) as c:
        yield c


def greedy(http) -> httpx.Response:
    return http.post("/generate", json={"input_ids": prompt_of(6), "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})


def memory(http) -> dict:
    return http.get("/get_server_info").json()["memory_occupation"]


class Sender:
    """tests/engines/tensor_sender.py in its own process (unrelated to the engine: no fd passing)."""

    def __init__(self, model_dir, scale: float, n_buckets: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.engines.tensor_sender", str(model_dir), str(scale),
                                      str(n_buckets)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=env, cwd=ROOT)
        self.entries = json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.communicate("done\n", timeout=60)
        assert self.proc.returncode == 0


def post_update(http, entry: str, version: str) -> httpx.Response:
    """One update in its own weight-update session (SGLang 0.5.23 refuses updates outside one)."""
    assert http.post("/begin_weight_update", json={}).status_code == 200
    try:
        return http.post("/update_weights_from_tensor", json={"serialized_named_tensors": [entry],
                                                              "weight_version": version})
    finally:
        assert http.post("/end_weight_update", json={}).status_code == 200


def test_release_resume_refill_in_place(engine, http, tiny_qwen2):
    before = greedy(http)
    assert before.status_code == 200
    checksum = http.get("/weights_checksum").json()["checksum"]
    info = memory(http)
    assert info["weights_bytes"] == info["weights_total_bytes"] > 0 and info["released_tags"] == []

    assert http.post("/release_memory_occupation", json={"tags": ["weights", "kv_cache", "cuda_graph"]}
                     ).status_code == 200
    info = memory(http)
    assert info["weights_bytes"] == 0 and info["released_tags"] == ["cuda_graph", "kv_cache", "weights"]
    refused = greedy(http)
    assert refused.status_code == 503 and "resume_memory_occupation" in refused.json()["error"]["message"]
    assert http.get("/weights_checksum").status_code == 400

    sender = Sender(tiny_qwen2, scale=0.01, n_buckets=2)
    try:
        r = post_update(http, sender.entries[0], "v1")  # into released weights: refused, nothing copied
        assert r.status_code == 400 and "resume_memory_occupation" in r.json()["message"]
        assert http.post("/resume_memory_occupation", json={}).status_code == 200
        info = memory(http)
        assert info["weights_bytes"] == info["weights_total_bytes"] and info["released_tags"] == []
        assert greedy(http).status_code == 503  # re-allocated, not refilled
        assert post_update(http, sender.entries[0], "v1").json()["success"] is True
        partly = greedy(http)
        assert partly.status_code == 503 and "not refilled" in partly.json()["error"]["message"]
        assert post_update(http, sender.entries[1], "v1").json()["success"] is True
    finally:
        sender.close()
    assert greedy(http).status_code == 200  # every tensor refilled: serving again
    for name, expected in perturbed(str(tiny_qwen2), 0.01):
        got = torch.tensor(http.post("/get_weights_by_name", json={"name": name, "truncate_size": 10**9}).json())
        assert torch.equal(got.view(-1), expected.view(-1)), name  # the sent bits, not approximately

    # the original weights handed back (no release in between): the engine is exactly as before
    sender = Sender(tiny_qwen2, scale=0.0, n_buckets=1)
    try:
        assert post_update(http, sender.entries[0], "v2").json()["success"] is True
    finally:
        sender.close()
    assert http.get("/weights_checksum").json()["checksum"] == checksum
    after = greedy(http)
    assert after.status_code == 200 and after.json()["output_ids"] == before.json()["output_ids"]
    assert after.json()["meta_info"]["weight_version"] == "v2"


def test_release_kv_cache_only_keeps_weights(http):
    assert http.post("/release_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert memory(http)["weights_bytes"] > 0 and greedy(http).status_code == 503
    assert http.post("/resume_memory_occupation", json={"tags": ["kv_cache"]}).status_code == 200
    assert greedy(http).status_code == 200  # weights were never dropped: nothing to refill
    # SGLang records a tag it does not know and frees nothing for it; resuming a tag that is not
    # released is its KeyError, answered 400 (weight_updater.py, SchedulerWeightUpdaterManager)
    assert http.post("/release_memory_occupation", json={"tags": ["activations"]}).status_code == 200
    assert greedy(http).status_code == 200
    assert http.post("/resume_memory_occupation", json={"tags": ["activations"]}).status_code == 200
    bad = http.post("/resume_memory_occupation", json={"tags": ["activations"]})
    assert bad.status_code == 400 and "activations" in bad.json()["error"]["message"]


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/slime_rl_colocate_pwned",))


def test_restricted_unpickler_refuses_other_globals(http, tmp_path):
    payload = base64.b64encode(pickle.dumps([("model.norm.weight", _Evil())])).decode()
    r = post_update(http, payload, "evil")
    assert r.status_code == 400 and "system is not allowed" in r.json()["error"]["message"]
    assert not Path("/tmp/slime_rl_colocate_pwned").exists()
    with pytest.raises(UnsafePayloadError, match="builtins.eval is not allowed"):
        deserialize_named_tensors(base64.b64encode(b"cbuiltins\neval\n(S'1'\ntR.").decode())
    with pytest.raises(UnsafePayloadError, match=r"list of \(name, tensor\) pairs"):
        deserialize_named_tensors(base64.b64encode(pickle.dumps([("a", 1)])).decode())
    with pytest.raises(UnsafePayloadError, match="base64"):
        deserialize_named_tensors("not base64!")
