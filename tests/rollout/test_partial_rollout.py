"""Partial rollout against a real embedded engine: a rollout cut at its deadline returns its groups
with the tokens and log-probs so far; continued next step (after a weight version change) each
response is the first part followed by the continuation, every token has the log-prob the model
gives it in that full context, the length stays within the budget, and the first part is marked
off-policy (and masked under --mask-offpolicy-in-partial-rollout)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from rollout_testlib import feeder, float64_model, reference_logprobs, row, start_server, with_clients

from slime_rl.data import Sample
from slime_rl.engines.client import EngineClient
from slime_rl.rollout.custom import generate_default
from slime_rl.rollout.dynamic import generate_filtered_groups
from slime_rl.rollout.options import RolloutOptions
from slime_rl.rollout.partial import (
    ABORTED,
    PENDING,
    TRUNCATED,
    append_env_tokens,
    append_model_turn,
    mask_offpolicy,
    offpolicy_tokens,
    status,
    token_versions,
)
from slime_rl.rollout.routing import ClientPool

MAX = 300  # the tiny model's context is 512; prompts are 8 tokens
# float32 engine vs float64 reference over up to 308 positions: the engine tests see ~1e-6 on short
# sequences; 1e-4 still catches a continuation fed the wrong context (errors of 1e-2 and more).
ATOL = 1e-4


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    s = start_server(tiny_qwen2, random_seed=3, max_running_requests=32)
    yield s
    s.shutdown()


def test_bookkeeping_of_turns_and_offpolicy_marks():
    s = Sample(index=0, group_index=0, prompt="", prompt_ids=[1, 2])
    assert status(s) == PENDING
    append_model_turn(s, {"output_ids": [5, 6], "meta_info": {
        "finish_reason": {"type": "abort"}, "weight_version": "1",
        "output_token_logprobs": [[-0.5, 5, None], [-0.25, 6, None]]}})
    assert status(s) == ABORTED and s.response_ids == [5, 6] and s.loss_mask == [1, 1]
    append_env_tokens(s, [9])
    append_model_turn(s, {"output_ids": [7], "meta_info": {
        "finish_reason": {"type": "length", "length": 1}, "weight_version": "2",
        "output_token_logprobs": [[-1.0, 7, None]]}})
    assert s.response_ids == [5, 6, 9, 7] and s.rollout_logprobs == [-0.5, -0.25, 0.0, -1.0]
    assert token_versions(s) == ["1", "1", None, "2"] and s.weight_version == "2" and status(s) == TRUNCATED
    assert offpolicy_tokens(s) == [1, 1, 0, 0]
    assert mask_offpolicy(s) == 2 and s.loss_mask == [0, 0, 0, 1]
    with pytest.raises(RuntimeError, match="log-probs for 2 tokens"):
        append_model_turn(s, {"output_ids": [1, 2], "meta_info": {"output_token_logprobs": []}})


def test_budget_respects_response_and_context_caps():
    pool = ClientPool([object()], tokenizer=None, max_context_len=20)
    s = Sample(index=0, group_index=0, prompt="", prompt_ids=list(range(8)), response_ids=[1] * 5)
    assert pool.budget(s, 100) == 20 - 8 - 5 and pool.context_capped == 1
    assert pool.budget(s, 9) == 4 and pool.context_capped == 1  # the response cap binds first
    assert pool.budget(s, 3) == 0  # already past the response cap
    assert pool.budget(s, 100, count=False) == 7 and pool.context_capped == 1


def test_cut_at_deadline_then_continued(server, tiny_qwen2):
    rows = [row(1, n=8), row(2, n=8)]
    next_rows, _ = feeder(rows)
    # the deadline cuts every sample short of MAX: a request decoding alone reached all 300 tokens within 0.3 s
    # on a CI machine (about 1,000 tokens/s of the tiny model) while the others waited; 0.12 s leaves room
    opts = RolloutOptions(rollout_batch_size=2, n_samples_per_prompt=2, max_response_len=MAX, partial_rollout=True,
                          mask_offpolicy_in_partial_rollout=True, rollout_deadline_s=0.12,
                          extra_sampling_params={"ignore_eos": True})
    first = with_clients([server.url], lambda cl: generate_filtered_groups(cl, next_rows, opts, lambda s: 1.0,
                                                                           server.tokenizer))
    assert first.groups == [] and first.metrics["rollout/deadline_hit"] == 1.0
    assert len(first.leftover) == 2 and first.metrics["rollout/groups_aborted"] == 2
    cut = copy.deepcopy(first.leftover)
    parts = [s.response_length for g in cut for s in g]
    assert all(0 <= n < MAX for n in parts) and any(n > 0 for n in parts), parts
    for g in cut:
        for s in g:
            assert status(s) in (ABORTED, PENDING) and s.reward is None
            assert len(s.rollout_logprobs) == len(s.loss_mask) == len(token_versions(s)) == s.response_length

    with EngineClient(server.url, timeout=30) as c:  # as after a weight update: later tokens are "v2"
        c.update_weight_version("v2", abort_all_requests=False)
    resume = with_clients([server.url], lambda cl: generate_filtered_groups(
        cl, feeder([])[0], dataclasses.replace(opts, rollout_deadline_s=None), lambda s: 1.0,
        server.tokenizer, resume=first.leftover, generate_fn=generate_default))
    assert resume.metrics["rollout/groups_resumed"] == 2 and resume.metrics["rollout/prompts_drawn"] == 0
    assert resume.leftover == [] and len(resume.groups) == 2
    assert resume.metrics["rollout/offpolicy_tokens_masked"] == sum(parts)

    model64 = float64_model(tiny_qwen2)
    for before_g, after_g in zip(cut, resume.groups, strict=True):
        for before, after in zip(before_g, after_g, strict=True):
            n = before.response_length
            assert after.index == before.index and after.prompt_ids == before.prompt_ids
            assert after.response_ids[:n] == before.response_ids
            assert after.rollout_logprobs[:n] == before.rollout_logprobs
            assert after.response_length == MAX and status(after) == TRUNCATED  # ignore_eos: exactly the budget
            assert len(after.rollout_logprobs) == MAX and token_versions(after) == ["default"] * n + ["v2"] * (MAX - n)
            assert after.loss_mask == [0] * n + [1] * (MAX - n) and after.reward == 1.0
            ref = reference_logprobs(model64, after.prompt_ids, after.response_ids)
            got = torch.tensor(after.rollout_logprobs, dtype=torch.float64)
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
