"""Concurrent requests share forwards (continuous batching) and get what they would get alone.

Every request carries its own `sampling_seed`, so the tokens it draws do not depend on which batch
it lands in; then the concurrent run must give the same tokens as one-at-a-time requests and the same
log-probs up to float32 noise. Different prompt lengths exercise left padding and explicit position
ids; different max_new_tokens make rows finish (and leave the batch) at different steps while
others keep decoding; requests that start after others are already decoding join the running batch.
"""

from __future__ import annotations

import threading
import time

import httpx
import torch
from engine_testlib import prompt_of, reference_logprobs

N = 12


def body(i: int) -> dict:
    return {"input_ids": prompt_of(2 + 3 * i, salt=i), "return_logprob": True, "rid": f"batch-{i}",
            "sampling_params": {"max_new_tokens": 6 + 2 * (i % 4), "temperature": 0.6 + 0.1 * (i % 5),
                                "top_p": 0.9 if i % 2 else 1.0, "top_k": 20 if i % 3 == 0 else -1,
                                "sampling_seed": 100 + i, "ignore_eos": True}}


def internal(http: httpx.Client) -> dict:
    return http.get("/get_server_info").json()["internal_states"][0]


def test_concurrent_requests_equal_sequential_ones(http, model64):
    before = internal(http)
    sequential = [http.post("/generate", json=body(i)).json() for i in range(N)]
    mid = internal(http)
    assert mid["prefill_forwards"] - before["prefill_forwards"] == N  # one at a time: one prefill each

    results: dict[int, dict] = {}

    def send(i: int) -> None:
        with httpx.Client(base_url=str(http.base_url), timeout=120) as c:
            results[i] = c.post("/generate", json=body(i)).json()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(N)]
    for k, t in enumerate(threads):
        t.start()
        if k == N // 2:
            time.sleep(0.05)  # the second half arrives while the first half is decoding
    for t in threads:
        t.join()
    after = internal(http)

    for i in range(N):
        seq, con = sequential[i], results[i]
        assert con["output_ids"] == seq["output_ids"], i
        got = torch.tensor([lp for lp, _, _ in con["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
        want = torch.tensor([lp for lp, _, _ in seq["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        # and both against the float64 reference, so "equal" is not "equally wrong"
        temp = body(i)["sampling_params"]["temperature"]
        ref = reference_logprobs(model64, body(i)["input_ids"], con["output_ids"], temp)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)

    prefills = after["prefill_forwards"] - mid["prefill_forwards"]
    decodes = after["decode_forwards"] - mid["decode_forwards"]
    total_tokens = sum(len(r["output_ids"]) for r in results.values())
    assert prefills < N, prefills  # requests were admitted together
    assert decodes < total_tokens - N, (decodes, total_tokens)  # decode steps were shared
    assert after["max_running_rows"] > 1


def test_max_running_requests_bounds_the_batch(tiny_qwen2):
    from engine_testlib import start_server

    s = start_server(tiny_qwen2, max_running_requests=3)
    try:
        def send(i: int) -> None:
            with httpx.Client(base_url=s.url, timeout=120) as c:
                assert c.post("/generate", json=body(i)).status_code == 200

        threads = [threading.Thread(target=send, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        stats = s.engine.load()
        assert stats["max_running_rows"] == 3 and stats["requests_finished"] == 8
    finally:
        s.shutdown()
