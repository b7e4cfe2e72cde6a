"""The built-in engine's HTTP layer against hostile but fair input (issue #20): each bad request gets a
400 naming its field while the good ones around it are served; the key and the body size are checked
from the headers, before the body is read."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest
from engine_testlib import prompt_of, start_server

# Each: (sampling_params, the field the 400 must name). Bounds from SGLang 0.5.23: top_k is -1 or >= 1
# (it maps -1 to 1 << 30); a seed feeds a torch generator (int64); a temperature must be a number
BAD_PARAMS = [
    ({"top_k": 10**30}, "top_k"),
    ({"top_k": 0}, "top_k"),
    ({"sampling_seed": 2**80}, "sampling_seed"),
    ({"sampling_seed": -1}, "sampling_seed"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"max_new_tokens": "8"}, "max_new_tokens"),
]


def _post_raw(url: str, body: bytes, headers: dict | None = None) -> httpx.Response:
    with httpx.Client(base_url=url, timeout=60) as c:
        return c.post("/generate", content=body, headers=headers or {})


def test_bad_requests_fail_alone_while_good_ones_are_served(server):
    good_out: list[httpx.Response] = []

    def good(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=120) as c:
            good_out.append(c.post("/generate", json={"input_ids": prompt_of(6, i), "sampling_params": {
                "max_new_tokens": 24, "ignore_eos": True, "temperature": 1.0}}))

    threads = [threading.Thread(target=good, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for params, field in BAD_PARAMS:
            # json.dumps writes NaN/Infinity bare, as a client in another language might
            body = json.dumps({"input_ids": prompt_of(4), "sampling_params": dict(params, max_new_tokens=4)
                               if "max_new_tokens" not in params else params})
            r = c.post("/generate", content=body.encode())
            assert r.status_code == 400, (params, r.text)
            assert f"sampling_params.{field}" in r.json()["error"]["message"], (params, r.text)
    for t in threads:
        t.join()
    assert [r.status_code for r in good_out] == [200] * 4
    assert all(len(r.json()["output_ids"]) == 24 for r in good_out)  # each ran to its length, none cut


@pytest.mark.parametrize("body, words", [
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b"\xff\xfe{\"input_ids\": [1]}", "invalid JSON"),
    (b"{\"input_ids\": [1], ", "invalid JSON"),
])
def test_malformed_bodies_are_400(server, body, words):
    r = _post_raw(server.url, body)
    assert r.status_code == 400 and words in r.json()["error"]["message"]


def test_an_over_long_prompt_is_refused_by_its_length_before_its_ids_are_checked(server):
    """The tiny model's context is 4,096 (tools/make_tiny_model.py): a prompt of 200,000 ids, one of them
    outside the vocabulary, is refused for its length (the per-id check of a huge prompt came first)."""
    ids = [5] * 199_999 + [10**6]
    r = _post_raw(server.url, json.dumps({"input_ids": ids}).encode())
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "input_ids: the prompt has 200,000 tokens; the context length is 4,096"
    r = _post_raw(server.url, json.dumps({"input_ids": [[1, 2], ids]}).encode())  # a batch: the long one named
    assert r.json()["error"]["message"] == "input_ids: the prompt has 200,000 tokens; the context length is 4,096"


def _raw_exchange(port: int, head: bytes, timeout: float = 5.0) -> tuple[bytes, float]:
    """Send only the request head (no body) and time the answer: the server must not wait for the body."""
    start = time.perf_counter()
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(head)
        while chunk := s.recv(4096):  # a refusal closes the connection ("Connection: close"): read to EOF
            data += chunk
    return data, time.perf_counter() - start


def test_key_and_size_are_checked_before_the_body_is_read(tiny_qwen2):
    s = start_server(tiny_qwen2, api_key="sekret", max_request_bytes=1 << 20)
    try:
        port = int(s.url.rsplit(":", 1)[1])
        # 100 MB announced, no key, no byte of body sent: answered at once, not after reading 100 MB
        data, took = _raw_exchange(port, b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 401") and took < 2.0
        # with the key, a body over --max-request-bytes: 413 before reading it
        data, took = _raw_exchange(port, b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                                         b"Content-Length: 2000000\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 413") and b"--max-request-bytes" in data and took < 2.0
        assert b"Connection: close" in data  # the unread body ends the connection, and the client is told
        data, _ = _raw_exchange(port, b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                                      b"Content-Length: -5\r\n\r\n")
        assert data.startswith(b"HTTP/1.1 400")
        # the engine still serves a proper request afterwards
        with httpx.Client(base_url=s.url, timeout=60, headers={"Authorization": "Bearer sekret"}) as c:
            r = c.post("/generate", json={"input_ids": prompt_of(4), "sampling_params": {"max_new_tokens": 2}})
            assert r.status_code == 200
    finally:
        s.shutdown()


def test_weight_update_requests_with_bad_dtypes_or_shapes_are_400(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        assert c.post("/begin_weight_update", json={}).status_code == 200
        try:
            r = c.post("/update_weights_from_distributed", json={"names": ["lm_head.weight"], "dtypes": [7],
                                                                 "shapes": [[1]]})
            assert r.status_code == 400 and "dtypes" in r.text
            # 10^13 floats: more than any model here holds, refused before anything is allocated
            r = c.post("/update_weights_from_distributed", json={"names": ["lm_head.weight"],
                                                                 "dtypes": ["float32"], "shapes": [[10**13]]})
            assert r.status_code == 400 and "bytes announced" in r.text
        finally:
            assert c.post("/end_weight_update", json={}).status_code == 200


def test_methods_and_expect_continue_as_sglang_serves_them(server):
    # FastAPI/Starlette (SGLang's server): HEAD answers a GET route without its body, another method 405
    port = int(server.url.rsplit(":", 1)[1])
    with httpx.Client(base_url=server.url, timeout=60) as c:
        r = c.head("/health")
        assert r.status_code == 200 and r.content == b""
        r = c.request("DELETE", "/generate")
        assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}
    # curl sends `Expect: 100-continue` before a large body and waits for the interim answer
    body = json.dumps({"input_ids": prompt_of(4), "sampling_params": {"max_new_tokens": 2}}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 100")
        s.sendall(body)
        data = b""
        while b"output_ids" not in data:
            data += s.recv(65536)
        assert data.startswith(b"HTTP/1.1 200")
