"""slime-style generate and filter functions in our rollout: the generate function posts SGLang's
/generate body to `args.sglang_router_ip:port` itself (our endpoint in front of the engines) and
fills slime's Sample; the filter gets slime's Samples and returns a bool or a DynamicFilterOutput.
The generate checks are against our own built-in generate on the same engine at temperature 0
(greedy: the same tokens and log-probs whichever function sent the request)."""

from __future__ import annotations

import asyncio
import importlib

import httpx
import pytest
from rollout_testlib import feeder, row, start_server, with_clients

from slime_rl.config import RolloutConfig, slime_imports
from slime_rl.config.dotted_path import PluginLoadError
from slime_rl.data import Sample
from slime_rl.data.slime_compat import SAMPLE_HEADER, DynamicFilterOutput, to_slime
from slime_rl.rollout.custom import load_filter, load_generate_function
from slime_rl.rollout.dynamic import generate_filtered_groups
from slime_rl.rollout.generate import generate_groups
from slime_rl.rollout.options import RolloutOptions
from slime_rl.rollout.partial import COMPLETED, TRUNCATED, status, token_versions
from slime_rl.rollout.routing import UNATTRIBUTED, ClientPool
from slime_rl.rollout.slime_compat import SlimeFilter, SlimeGenerate, endpoint_of, from_slime

slime_imports.install()  # what loading by a flag does first; the test imports the file itself
slime_style = importlib.import_module("tests.plugins.slime_style")
GEN = "tests.plugins.slime_style:custom_generate"


@pytest.fixture(scope="module")
def server(calc_model):
    s = start_server(calc_model, random_seed=5, max_running_requests=8)
    yield s
    s.shutdown()


def run_groups(server, rows, path, budget=8, n=2):
    cfg = RolloutConfig(n_samples_per_prompt=n, max_response_len=budget, temperature=0.0)
    opts = RolloutOptions.from_config(cfg, custom_generate_function_path=path)

    async def body(clients):
        return await generate_groups(clients, rows, cfg, lambda s: float(len(s.response_ids)), server.tokenizer,
                                     progress=False, options=opts)
    return with_clients([server.url], body)


@pytest.mark.parametrize("path", [GEN, "tests.plugins.slime_style:manual_generate"])
def test_slime_generate_matches_the_built_in_one(server, path):
    rows = [row(1), row(2, n=9)]
    ours = run_groups(server, rows, None)
    theirs = run_groups(server, rows, path)
    for g_ours, g_theirs in zip(ours, theirs, strict=True):
        for a, b in zip(g_ours, g_theirs, strict=True):
            assert b.response_ids == a.response_ids and len(b.response_ids) > 0
            assert b.rollout_logprobs == pytest.approx(a.rollout_logprobs, abs=1e-5)
            assert b.loss_mask == [1] * len(b.response_ids) and b.response == a.response
            assert status(b) == status(a) and b.finish_reason == a.finish_reason
            assert b.reward == float(len(b.response_ids))
            if path == GEN:  # append_response_tokens records the engine's weight version per token
                assert token_versions(b) == token_versions(a)


def test_budget_and_truncation(server):
    s = run_groups(server, [row(3)], GEN, budget=3, n=1)[0][0]
    assert len(s.response_ids) <= 3
    assert status(s) in (COMPLETED, TRUNCATED)


def test_requests_are_filed_under_the_samples_group_and_aborted_with_it():
    seen, aborted = [], []

    class Client:
        batch_generate = True
        base_url = "fake"

        async def generate_body(self, body):
            seen.append(body["rid"])
            await asyncio.sleep(0.3)
            return {"text": "", "meta_info": {"finish_reason": {"type": "abort"}, "output_token_logprobs": []}}

        async def abort_request(self, rid="", abort_all=False):
            aborted.append(rid)

    async def main():
        pool = ClientPool([Client()], tokenizer=None)
        host, port = await endpoint_of(pool)
        async with httpx.AsyncClient() as http:
            body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}
            named = asyncio.create_task(http.post(f"http://{host}:{port}/generate", json=body,
                                                  headers={SAMPLE_HEADER: "12/34"}))
            anonymous = asyncio.create_task(http.post(f"http://{host}:{port}/generate", json=body))
            await asyncio.sleep(0.15)
            live = (pool.live_rids(12), pool.live_rids(UNATTRIBUTED))
            calls = await pool.abort_groups([12])
            await asyncio.gather(named, anonymous)
        await pool.aclose()
        return live, calls

    (named, anonymous), calls = asyncio.run(main())
    assert len(named) == 1 and next(iter(named)).split("-")[1:3] == ["g0000000012", "s0000000034"]
    assert len(anonymous) == 1 and "-x-r" in next(iter(anonymous))
    assert calls == 2 and sorted(aborted) == sorted([*named, *anonymous])


def test_generate_with_a_filter_and_aborts_through_the_dynamic_rollout(server):
    """slime's generate and slime's filter in the DAPO loop: every kept group passed the filter."""
    slime_style.CALLS["filter"].clear()
    opts = RolloutOptions.from_config(RolloutConfig(rollout_batch_size=2, n_samples_per_prompt=3, max_response_len=6,
                                                    temperature=1.0), custom_generate_function_path=GEN,
                                      dynamic_sampling_filter_path="tests.plugins.slime_style:filter_function",
                                      over_sampling_batch_size=2)
    next_rows, _ = feeder([row(k, label=k % 10) for k in range(40)])

    async def body(clients):
        return await generate_filtered_groups(clients, next_rows, opts, lambda s: float(len(s.response_ids) % 3),
                                              server.tokenizer)
    result = with_clients([server.url], body)
    assert len(result.groups) == 2
    for g in result.groups:
        assert len({s.reward for s in g}) > 1  # the filter keeps groups whose rewards differ
    assert len(slime_style.CALLS["filter"]) == 2 + result.metrics["rollout/groups_filtered"]


def mk(n_resp=2):
    return Sample(index=3, group_index=1, prompt="p", prompt_ids=[5, 6, 7],
                  response_ids=[8, 9][:n_resp], rollout_logprobs=[-0.1, -0.2][:n_resp], loss_mask=[1, 1][:n_resp],
                  metadata={"rollout_status": "aborted", "token_weight_versions": ["1", "1"][:n_resp], "u": 1},
                  finish_reason="abort")


def test_from_slime_keeps_earlier_versions_and_checks_what_came_back():
    s = mk()
    out = to_slime(s)
    assert out.tokens == [5, 6, 7, 8, 9] and out.response_length == 2 and out.status.value == "aborted"
    assert "token_weight_versions" not in out.metadata and out.metadata == {"u": 1}
    out.append_response_tokens(None, tokens=[10], log_probs=[-0.3], meta_info={
        "finish_reason": {"type": "stop"}, "weight_version": "2"}, text="x")
    out.append_response_tokens(None, tokens=[11], trainable=False)
    out.metadata["v"] = 2
    back = from_slime(out, s, GEN)
    assert back.response_ids == [8, 9, 10, 11] and back.loss_mask == [1, 1, 1, 0]
    assert back.rollout_logprobs == [-0.1, -0.2, -0.3, 0.0] and token_versions(back) == ["1", "1", "2", None]
    assert status(back) == COMPLETED and back.finish_reason == "stop" and back.weight_version == "2"
    assert back.metadata["v"] == 2 and back.metadata["u"] == 1


@pytest.mark.parametrize("change, message", [
    (lambda o: setattr(o, "tokens", [0] + o.tokens[1:]), "no longer starts with the prompt's 3 ids"),
    (lambda o: setattr(o, "response_length", 5), "response_length 5 but tokens hold 2"),
    (lambda o: setattr(o, "rollout_log_probs", None), "no rollout_log_probs"),
    (lambda o: setattr(o, "loss_mask", [1]), "loss_mask has 1"),
    (lambda o: setattr(o, "status", o.Status.PENDING), "status 'pending'"),
])
def test_from_slime_errors_name_the_flag_and_sample(change, message):
    s = mk()
    out = to_slime(s)
    change(out)
    with pytest.raises(ValueError, match=f"--custom-generate-function-path '{GEN}': sample 3: .*{message}"):
        from_slime(out, s, GEN)
    with pytest.raises(ValueError, match="returned 2 samples"):
        from_slime([out, out], s, GEN)


def test_slime_filter_forms():
    def group(rewards):
        return [Sample(index=i, group_index=0, prompt="", prompt_ids=[1], label="x", reward=r)
                for i, r in enumerate(rewards)]
    keep = load_filter("tests.plugins.slime_style:filter_function")
    assert isinstance(keep, SlimeFilter)
    assert [keep(group(r)) for r in ([0.0, 1.0], [1.0, 1.0], [0.5])] == [True, False, False]
    legacy = load_filter("tests.plugins.slime_style:bool_filter")
    assert legacy(group([0.0, 0.0])) is True and legacy(group([1.0])) is False
    hedged = SlimeFilter(lambda args, samples: DynamicFilterOutput(keep=False, keep_when_insufficient=True), None, "p")
    assert hedged(group([1.0, 0.0])) is False


def test_loading_decides_the_form_once_and_names_the_flag():
    gen = load_generate_function(GEN)
    assert isinstance(gen, SlimeGenerate) and gen.fn is slime_style.custom_generate
    from slime_rl.rollout.examples import calculator
    assert load_generate_function("slime_rl.rollout.examples.calculator.generate") is calculator.generate
    with pytest.raises(PluginLoadError, match=r"--dynamic-sampling-filter-path .*fits no supported form; expected "
                                              r"`filter\(group\) -> bool` \(ours\) or `filter\(args, samples\)"):
        load_filter("tests.plugins.slime_style:neither")
    with pytest.raises(ValueError, match="--custom-generate-function-path .*must be an `async def`"):
        load_generate_function("tests.plugins.slime_style:filter_function")
    with pytest.raises(ValueError, match="--dynamic-sampling-filter-kwargs .*does not take them"):
        load_filter("slime_rl.rollout.filters:reward_mean_in_range", None, '{"lo": 1}')
