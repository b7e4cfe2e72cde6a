"""Prefix sharing in the embedded engine's prefill: the n samples of a group (same prompt, own seeds)
are prefilled once and each gets a copy of the row. Reference: every request served alone (no
sharing possible), and a float64 forward without any cache. Both decoding paths are checked."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import prompt_of, reference_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer

from slime_rl.engines.embedded.engine import Engine
from slime_rl.engines.embedded.protocol import seed_generator
from slime_rl.engines.embedded.request import GenRequest
from slime_rl.engines.embedded.sampling import SamplingParams

GROUPS, N = 3, 4  # 3 prompts x 4 samples


def _group_requests() -> list[GenRequest]:
    reqs = []
    for g in range(GROUPS):
        for k in range(N):
            raw = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0.9, "sampling_seed": 10 * g + k}
            req = GenRequest(rid=f"g{g}-{k}", input_ids=prompt_of(5 + 3 * g, salt=g),
                             params=SamplingParams.from_json(raw, 64), return_logprob=True, logprob_start_len=0)
            seed_generator(req, torch.device("cpu"))
            reqs.append(req)
    return reqs


@pytest.mark.parametrize("static", [False, True])
def test_group_prefilled_once_gives_what_each_request_gives_alone(tiny_qwen2, model64, static):
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    kw = {"static_cache": True, "capacity": 16, "min_kv_len": 8} if static else {}
    eng = Engine(model, tok, {63}, 0, max_running_requests=GROUPS * N, **kw)
    reqs = _group_requests()
    eng.submit(reqs)
    for r in reqs:
        assert r.done.wait(120)
    stats = eng.load()
    alone = _group_requests()
    for r in alone:  # one at a time: nothing to share
        eng.submit([r])
        assert r.done.wait(120)
    after = eng.load()
    eng.shutdown()

    assert stats["prefill_forwards"] == 1 and stats["prefill_shared_rows"] == GROUPS * N - GROUPS
    assert after["prefill_shared_rows"] == stats["prefill_shared_rows"]
    for got, want in zip(reqs, alone, strict=True):
        assert got.output_ids == want.output_ids, got.rid
        torch.testing.assert_close(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs),
                                   atol=1e-5, rtol=0)
        assert got.input_logprobs[0] is None and len(got.input_logprobs) == len(got.input_ids)
        torch.testing.assert_close(torch.tensor(got.input_logprobs[1:]), torch.tensor(want.input_logprobs[1:]),
                                   atol=1e-5, rtol=0)
    # the samples of a group differ (own seeds) and each matches the float64 model
    assert len({tuple(r.output_ids) for r in reqs[:N]}) > 1
    for r in reqs[::N]:
        ref = reference_logprobs(model64, r.input_ids, r.output_ids, r.params.temperature)
        torch.testing.assert_close(torch.tensor(r.output_logprobs, dtype=torch.float64), ref, atol=1e-5, rtol=0)
