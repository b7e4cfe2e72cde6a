"""A request that fails inside the scheduler fails alone (issue #20): the HTTP layer refuses what it can
name, and what still gets through (here: requests built past it, as a validation gap would let them)
is answered with its own error while the requests batched with it finish with the tokens and log-probs
of a run without it (same seeds: each good request draws from its own generator)."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import prompt_of, start_server

from slime_rl.engines.embedded.request import GenRequest
from slime_rl.engines.embedded.sampling import SamplingParams

# (kind, where the scheduler must say it failed, how the request is broken)
BAD = {
    # top_p < 1 puts the row in the truncating sampler, whose top-k tensor cannot hold 10**30
    "sampling": ("sampling", lambda p: (setattr(p, "top_k", 10**30), setattr(p, "top_p", 0.9))),
    # an id the embedding does not have (vocab 64)
    "prefill": ("prefill", None),
    # a stop list the stop check cannot use
    "stop": ("stop check", lambda p: setattr(p, "stop", [None])),
}


@pytest.fixture(scope="module", params=[False, True], ids=["dynamic", "static"])
def server(request, tiny_qwen2):
    s = start_server(tiny_qwen2, random_seed=7, max_running_requests=16, static_kv_cache=request.param)
    yield s
    s.shutdown()


def _good(n: int = 4) -> list[GenRequest]:
    reqs = []
    for i in range(n):
        p = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=[1.0, 0.7, 1.0, 1.0][i % 4],
                           top_p=[1.0, 0.9, 1.0, 0.8][i % 4], top_k=[-1, -1, 1, 20][i % 4])
        reqs.append(GenRequest(rid=f"good-{i}", input_ids=prompt_of(5 + i, i), params=p, return_logprob=True,
                               generator=torch.Generator().manual_seed(100 + i)))
    return reqs


def _bad(kind: str) -> GenRequest:
    p = SamplingParams(max_new_tokens=12, ignore_eos=True)
    ids = prompt_of(6, 9)
    if kind == "prefill":
        ids = ids[:3] + [999] + ids[3:]
    else:
        BAD[kind][1](p)
    return GenRequest(rid=f"bad-{kind}", input_ids=ids, params=p, generator=torch.Generator().manual_seed(5))


def _run(server, reqs: list[GenRequest]) -> None:
    server.engine.submit(reqs)  # one call: the scheduler admits them together, in one prefill
    for r in reqs:
        assert r.done.wait(60), r.rid


@pytest.mark.parametrize("kind", list(BAD))
def test_a_request_failing_in_the_scheduler_fails_alone(server, kind):
    clean = _good()
    _run(server, clean)
    assert all(r.finish_reason == {"type": "length", "length": 12} for r in clean)

    mixed = _good()
    bad = _bad(kind)
    _run(server, [*mixed[:2], bad, *mixed[2:]])

    reason = bad.finish_reason
    assert reason["status_code"] == 500 and reason["type"] == "abort", reason
    assert f"request {bad.rid} ({BAD[kind][0]})" in reason["message"], reason
    for ref, got in zip(clean, mixed, strict=True):
        assert got.finish_reason == ref.finish_reason, got.rid
        assert got.output_ids == ref.output_ids, got.rid
        assert got.output_logprobs == pytest.approx(ref.output_logprobs, abs=1e-5), got.rid
    # the engine serves on: the same requests again give the same tokens
    again = _good()
    _run(server, again)
    assert [r.output_ids for r in again] == [r.output_ids for r in clean]
    assert server.engine.is_alive()
    print(f"\n[isolation:{kind}] 1 failing request of 5 in one batch: it got 500 ({reason['message'][:80]}...), "
          f"4 survivors equal the clean run")
