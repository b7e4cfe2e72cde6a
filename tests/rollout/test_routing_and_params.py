"""Routing over two real embedded engines (both get requests, the per-engine cap holds, the counters
agree with what each server saw), stop strings / stop token ids / the context cap on real requests,
and the eval helper end to end."""

from __future__ import annotations

import itertools
from math import comb

import pytest
from rollout_testlib import row, start_server, with_clients

from slime_rl.config import RolloutConfig
from slime_rl.rollout.eval import default_ks, evaluate, pass_at_k, summarize
from slime_rl.rollout.generate import generate_groups, sampling_params
from slime_rl.rollout.options import RolloutOptions
from slime_rl.rollout.options import sampling_params as options_sampling_params
from slime_rl.rollout.partial import TRUNCATED, status
from slime_rl.rollout.routing import ClientPool


@pytest.fixture(scope="module")
def servers(tiny_qwen2):
    pair = [start_server(tiny_qwen2, random_seed=11 + k, max_running_requests=16) for k in range(2)]
    yield pair
    for s in pair:
        s.shutdown()


def finished(server) -> int:
    return server.engine.stats["requests_finished"]


def test_requests_go_to_both_engines_under_the_cap(servers):
    before = [finished(s) for s in servers]
    cfg = RolloutConfig(n_samples_per_prompt=4, max_response_len=8, concurrency_per_engine=2)
    tok = servers[0].tokenizer

    async def body(clients):
        pool = ClientPool(clients, tok, per_engine=2)
        groups = await generate_groups(clients, [row(k) for k in range(4)], cfg, lambda s: 0.0, tok,
                                       progress=False, pool=pool)
        return groups, pool

    groups, pool = with_clients([s.url for s in servers], body)
    assert sum(len(g) for g in groups) == 16
    counters = pool.counters()
    assert [c["url"] for c in counters] == [s.url for s in servers]
    assert all(c["sent"] > 0 and c["in_flight"] == 0 and c["peak"] <= 2 for c in counters)
    # what each server counts itself, independently of the client's bookkeeping
    assert [finished(s) - b for s, b in zip(servers, before, strict=True)] == [c["sent"] for c in counters]
    assert pool.metrics()["rollout/engine0_requests"] + pool.metrics()["rollout/engine1_requests"] == 16


def test_sampling_params_from_flags():
    cfg = RolloutConfig(max_response_len=7, temperature=0.5, top_p=0.9, top_k=4)
    opts = RolloutOptions.from_config(cfg, rollout_stop="</answer>", rollout_stop_token_ids=[3, 5])
    assert options_sampling_params(opts) == {"temperature": 0.5, "top_p": 0.9, "top_k": 4, "max_new_tokens": 7,
                                             "stop": ["</answer>"], "stop_token_ids": [3, 5]}
    assert sampling_params(cfg, [9]) == {"temperature": 0.5, "top_p": 0.9, "top_k": 4, "max_new_tokens": 7,
                                         "stop_token_ids": [9]}
    with pytest.raises(ValueError, match="--mask-offpolicy-in-partial-rollout needs --partial-rollout"):
        RolloutOptions(mask_offpolicy_in_partial_rollout=True)
    with pytest.raises(TypeError, match="no field 'rollout_stopp'"):
        RolloutOptions.from_config(cfg, rollout_stopp="x")


def _one(servers, opts: RolloutOptions, prompt_len: int = 6):
    cfg = RolloutConfig(n_samples_per_prompt=1)
    tok = servers[0].tokenizer

    async def body(clients):
        pool = ClientPool(clients, tok, max_context_len=opts.rollout_max_context_len)
        groups = await generate_groups(clients, [row(5, n=prompt_len)], cfg, lambda s: 0.0, tok, progress=False,
                                       options=opts, pool=pool)
        return groups[0][0], pool

    return with_clients([servers[0].url], body)


def test_stop_token_ids_and_stop_strings_end_the_response(servers):
    # seeded sampling: the same request gives the same tokens, so the base run predicts the cut runs
    # (not ignore_eos: SGLang skips stop token ids under it, as it skips EOS)
    seeded = dict(max_response_len=24, extra_sampling_params={"sampling_seed": 123})
    base, _ = _one(servers, RolloutOptions(**seeded))
    ids = base.response_ids
    assert len(ids) >= 8, ids
    stop_id = ids[len(ids) // 2]
    cut, _ = _one(servers, RolloutOptions(**seeded, rollout_stop_token_ids=(stop_id,)))
    assert cut.response_ids == ids[:ids.index(stop_id) + 1] and cut.finish_reason == "stop"  # the stop token stays

    tok = servers[0].tokenizer
    text = tok.decode(ids, skip_special_tokens=True)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert len(stop) == 2
    # expected: the shortest prefix whose text contains the stop string (the engine checks per token)
    n = next(k for k in range(1, len(ids) + 1) if stop in tok.decode(ids[:k], skip_special_tokens=True))
    cut, _ = _one(servers, RolloutOptions(**seeded, rollout_stop=(stop,)))
    assert cut.response_ids == ids[:n] and cut.finish_reason == "stop"


def test_context_cap_limits_new_tokens_and_is_counted(servers):
    opts = RolloutOptions(max_response_len=50, rollout_max_context_len=10, extra_sampling_params={"ignore_eos": True})
    s, pool = _one(servers, opts, prompt_len=6)
    assert s.response_length == 4 and s.finish_reason == "length" and status(s) == TRUNCATED
    assert pool.metrics()["rollout/context_capped_requests"] == 1
    sent = pool.counters()[0]["sent"]
    over, pool = _one(servers, opts, prompt_len=12)  # no room at all: never sent, truncated, empty
    assert over.response_ids == [] and status(over) == TRUNCATED and pool.counters()[0]["sent"] == 0 and sent == 1


def test_pass_at_k_hand_made():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(5, 2, 3) == pytest.approx(1 - 1 / 10)  # 1 - C(3,3)/C(5,3)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)
    assert default_ks(8) == [1, 2, 4, 8] and default_ks(6) == [1, 2, 4, 6]
    out = summarize([[1, 0, 0, 0], [1, 1, 0, 0]], ks=[1, 2])
    assert out["reward_mean"] == pytest.approx(3 / 8)
    assert out["pass@1"] == pytest.approx((1 / 4 + 2 / 4) / 2)
    assert out["pass@2"] == pytest.approx(((1 - 3 / 6) + (1 - 1 / 6)) / 2)


def test_evaluate_on_real_engines(servers):
    seen: dict[int, list[float]] = {}

    def reward(sample) -> float:  # a coin from the response: some prompts pass sometimes
        r = float(sample.response_ids[0] % 2 == 0) if sample.response_ids else 0.0
        seen.setdefault(sample.group_index, []).append(r)
        return r

    rows = [row(k) for k in range(3)]
    out = with_clients([s.url for s in servers], lambda cl: evaluate(
        cl, rows, 4, {"max_new_tokens": 3, "temperature": 1.0}, reward, servers[0].tokenizer))
    assert set(out) == {"reward_mean", "n_samples", "pass@1", "pass@2", "pass@4"}
    rewards = list(seen.values())
    assert len(rewards) == 3 and all(len(r) == 4 for r in rewards)
    assert out["reward_mean"] == pytest.approx(sum(map(sum, rewards)) / 12)
    for k in (1, 2, 4):  # brute force over every k-subset, not the estimator's formula
        want = sum(sum(any(sub) for sub in itertools.combinations(r, k)) / comb(4, k) for r in rewards) / 3
        assert out[f"pass@{k}"] == pytest.approx(want)


def test_eval_samples_are_seeded_apart_from_training_and_show_progress(servers, capsys):
    """--deterministic-rollout: eval requests carry sampling seeds from EVAL_INDEX_BASE on, so the same
    seed repeats the eval's answers (on either engine) and another seed changes them; the progress
    indicator (not a terminal here) prints its periodic line."""
    from slime_rl.rollout.eval import EVAL_INDEX_BASE, generate_eval

    rows = [row(k) for k in range(6)]
    params = {"max_new_tokens": 6, "temperature": 1.0}

    def answers(seed, **kw):
        groups = with_clients([s.url for s in servers], lambda cl: generate_eval(
            cl, rows, 4, params, lambda s: 0.0, servers[0].tokenizer, sample_seed=seed, **kw))
        assert [s.index for g in groups for s in g] == list(range(EVAL_INDEX_BASE, EVAL_INDEX_BASE + 24))
        return [s.response_ids for g in groups for s in g]

    import slime_rl.observability.progress as progress

    saved = progress.PROGRESS_INTERVAL_S
    progress.PROGRESS_INTERVAL_S = 0.0  # a line at every finished sample
    try:
        first = answers(5, progress=True, progress_desc="eval digits")
    finally:
        progress.PROGRESS_INTERVAL_S = saved
    err = capsys.readouterr().err
    assert "eval digits: 24/24 samples (100%)" in err and "eval digits: 1/24 samples" in err
    assert answers(5) == first
    assert answers(6) != first
