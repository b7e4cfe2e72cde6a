"""The overlap scheduler (engine.py): step n+1 is launched before the host reads step n's tokens.

On CPU every step completes before the host goes on, but the scheduling is the one that runs on CUDA:
the next step's input ids come from the device (the sampler's output), the host reads a step's tokens
one step late, a row that stopped has run one more step whose token must never be reported, and
aborts, pauses and weight updates drain the pipeline first. The reference is the same engine with
overlap off (SGLang's --disable-overlap-schedule), itself checked against float64 models elsewhere
(test_embedded_static.py, test_embedded_generate.py), and for the weight updates an HF decode loop.
Every sampled request carries its own seed (or is greedy), so its tokens do not depend on the
schedule: both engines must give the same tokens, finish reasons and log-probs.
"""

from __future__ import annotations

import inspect
import time

import pytest
import torch
from engine_testlib import prompt_of, start_server
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2ForCausalLM
from transformers.cache_utils import DynamicCache

from slime_rl.engines.embedded.engine import Engine
from slime_rl.engines.embedded.protocol import seed_generator
from slime_rl.engines.embedded.request import GenRequest
from slime_rl.engines.embedded.sampling import SamplingParams

N = 12
# transformers renamed the forward's `past_key_values` to `cache` (5.2x); take either, as engine.py does
CACHE_KW = "cache" if "cache" in inspect.signature(Qwen2ForCausalLM.forward).parameters else "past_key_values"
PATHS = {"dynamic": {}, "static": {"static_cache": True, "capacity": 16, "min_kv_len": 8}}


@pytest.fixture(scope="module")
def model_tok(tiny_qwen2):
    return (AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_qwen2))


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.001)


def mixed_params(i: int, stops: dict[int, dict]) -> dict:
    """Greedy and seeded sampled rows, top-k / top-p, per-row max_new_tokens, EOS on some rows, and
    the stop strings / stop token ids of `stops`."""
    raw = {"max_new_tokens": 3 + (5 * i) % 23, "ignore_eos": i % 4 != 1, "sampling_seed": 70 + i,
           "temperature": 0.0 if i % 3 == 0 else 0.5 + 0.25 * (i % 4),
           "top_k": 6 if i % 5 == 2 else -1, "top_p": 0.85 if i % 5 == 4 else 1.0}
    return {**raw, **stops.get(i, {})}


def make_requests(stops: dict[int, dict], vocab: int = 64) -> list[GenRequest]:
    reqs = []
    for i in range(N):
        req = GenRequest(rid=f"r{i}", input_ids=prompt_of(3 + 3 * i, salt=i),
                         params=SamplingParams.from_json(mixed_params(i, stops), vocab), return_logprob=True)
        seed_generator(req, torch.device("cpu"))
        reqs.append(req)
    return reqs


def run(model, tok, reqs: list[GenRequest], overlap: bool, path: str, abort_rid: str | None = None) -> dict:
    """Half the requests first, the rest once the batch decodes; `abort_rid` aborted after 4 tokens."""
    eng = Engine(model, tok, {tok.eos_token_id}, tok.pad_token_id, max_running_requests=5, overlap=overlap,
                 **PATHS[path])
    try:
        eng.submit(reqs[:N // 2])
        wait_for(lambda: eng.load()["decode_forwards"] >= 2)
        eng.submit(reqs[N // 2:])
        if abort_rid is not None:
            target = next(r for r in reqs if r.rid == abort_rid)
            wait_for(lambda: len(target.output_ids) >= 4 or target.done.is_set())
            eng.abort(abort_rid)
        for r in reqs:
            assert r.done.wait(120), r.rid
        return eng.load()
    finally:
        eng.shutdown()


def assert_same(got: GenRequest, want: GenRequest) -> None:
    assert got.output_ids == want.output_ids, got.rid
    assert got.finish_reason == want.finish_reason, got.rid
    torch.testing.assert_close(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs),
                               atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_overlap_on_equals_off(model_tok, path):
    model, tok = model_tok
    # probe (overlap off, no stops): pick stop strings and stop token ids that these rows meet mid-way
    probe = make_requests({})
    run(model, tok, probe, overlap=False, path=path)
    stops = {}
    for i in (2, 7):  # a stop string: the text of two tokens in the middle of the probe's output
        n = len(probe[i].output_ids)
        assert n >= 6, (i, n)
        stops[i] = {"stop": [tok.decode(probe[i].output_ids[n // 2:n // 2 + 2])]}
    for i in (5, 10):  # a stop token id met in the middle
        stops[i] = {"stop_token_ids": [probe[i].output_ids[len(probe[i].output_ids) // 2]]}

    off, on = make_requests(stops), make_requests(stops)
    stats_off = run(model, tok, off, overlap=False, path=path)
    stats_on = run(model, tok, on, overlap=True, path=path)
    kinds = {("str" if isinstance(r.finish_reason.get("matched"), str) else "id") if r.finish_reason["type"] == "stop"
             else r.finish_reason["type"] for r in off}
    assert kinds == {"str", "id", "length"}, kinds  # the reference meets every kind of stop
    for got, want in zip(on, off, strict=True):
        assert_same(got, want)
    for i in (2, 7):
        assert on[i].finish_reason["type"] == "stop" and len(on[i].output_ids) < len(probe[i].output_ids)
    assert stats_off["overlap"] is False and stats_off["overlapped_steps"] == 0
    assert stats_on["overlap"] is True and stats_on["overlapped_steps"] > N
    # a row that stopped at step n ran step n+1 too; its token there was dropped (checked above)
    assert stats_on["decode_forwards"] >= stats_off["decode_forwards"]


@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_an_abort_mid_way_keeps_a_prefix_and_leaves_the_others_alone(model_tok, path):
    model, tok = model_tok
    off = make_requests({})
    run(model, tok, off, overlap=False, path=path)
    on = make_requests({i: {"max_new_tokens": 40, "ignore_eos": True} for i in (8,)})
    ref8 = make_requests({i: {"max_new_tokens": 40, "ignore_eos": True} for i in (8,)})[8:9]
    run(model, tok, ref8, overlap=False, path=path)  # request 8 alone, not aborted
    run(model, tok, on, overlap=True, path=path, abort_rid="r8")
    got = on[8]
    assert got.finish_reason["type"] == "abort" and 4 <= len(got.output_ids) < 40
    n = len(got.output_ids)
    assert got.output_ids == ref8[0].output_ids[:n]
    torch.testing.assert_close(torch.tensor(got.output_logprobs), torch.tensor(ref8[0].output_logprobs[:n]),
                               atol=1e-5, rtol=0)
    for i in range(N):
        if i != 8:
            assert_same(on[i], off[i])


def hf_greedy(model, prompt: list[int], n: int, switch_at: int, mode: str, new_state: dict) -> tuple[list, list]:
    """Greedy decode of `n` tokens by HF's own forward with a DynamicCache, loading `new_state` once
    `switch_at` tokens are out: "in_place" keeps the cache computed so far (the token fed next runs on
    the new weights), "retract" recomputes prompt + output on the new weights. Returns the tokens and
    their log-probs (softmax of the logits: greedy is temperature 1)."""
    params = dict(model.named_parameters())
    old = {k: v.detach().clone() for k, v in params.items()}
    toks, lps = [], []
    try:
        with torch.no_grad():
            cache, ids = DynamicCache(), torch.tensor([prompt])
            logits = model(input_ids=ids, **{CACHE_KW: cache}, use_cache=True).logits[0, -1]
            while len(toks) < n:
                lp = torch.log_softmax(logits.float(), -1)
                toks.append(int(lp.argmax()))
                lps.append(float(lp.max()))
                if len(toks) == switch_at:
                    for k, v in new_state.items():
                        params[k].data.copy_(v)
                    if mode == "retract":
                        cache = DynamicCache()
                        logits = model(input_ids=torch.tensor([prompt + toks]), **{CACHE_KW: cache},
                                       use_cache=True).logits[0, -1]
                        continue
                logits = model(input_ids=torch.tensor([[toks[-1]]]), **{CACHE_KW: cache},
                               use_cache=True).logits[0, -1]
    finally:
        for k, v in old.items():
            params[k].data.copy_(v)
    return toks, lps


def greedy_requests(tag: str, n_new: int = 30) -> list[GenRequest]:
    return [GenRequest(rid=f"{tag}{i}", input_ids=prompt_of(5 + 4 * i, salt=i), return_logprob=True,
                       params=SamplingParams.from_json({"max_new_tokens": n_new, "temperature": 0.0,
                                                        "ignore_eos": True}, 64)) for i in range(3)]


# overlap off too: the HF reference is checked on the non-overlapped engine
@pytest.mark.parametrize("path, mode, overlap", [("static", "in_place", True), ("static", "retract", True),
                                                 ("dynamic", "in_place", True), ("static", "in_place", False)])
def test_a_weight_update_while_paused_mid_generation(tiny_qwen2, path, mode, overlap):
    # a model of its own: the update writes its parameters
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(tiny_qwen2)
    g = torch.Generator().manual_seed(3)
    new_state = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in model.named_parameters()}
    eng = Engine(model, tok, {tok.eos_token_id}, tok.pad_token_id, max_running_requests=4, overlap=overlap,
                 **PATHS[path])
    reqs = greedy_requests("w")
    prompts = [r.input_ids for r in reqs]
    try:
        eng.submit(reqs)
        wait_for(lambda: min(len(r.output_ids) for r in reqs) >= 5)
        eng.pause(mode)  # returns with the in-flight step read (in place) or the rows requeued (retract)
        cut = [len(r.output_ids) for r in reqs]
        with eng.weights_exclusive(), torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(new_state[name])
        eng.resume()
        for r in reqs:
            assert r.done.wait(120)
        assert (eng.load()["overlapped_steps"] > 0) == overlap
    finally:
        eng.shutdown()
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval()
    for r, p, k in zip(reqs, prompts, cut, strict=True):
        assert 5 <= k < 30 and r.finish_reason["type"] == "length"
        want, want_lp = hf_greedy(ref_model, p, 30, k, mode, new_state)
        assert r.output_ids == want, (r.rid, k)
        torch.testing.assert_close(torch.tensor(r.output_logprobs), torch.tensor(want_lp), atol=1e-5, rtol=0)


@pytest.mark.parametrize("path", ["dynamic", "static"])
def test_pause_abort_mid_way_then_continue(model_tok, path):
    model, tok = model_tok
    want = [hf_greedy(model, r.input_ids, 30, 30, "in_place", {}) for r in greedy_requests("x")]
    eng = Engine(model, tok, {tok.eos_token_id}, tok.pad_token_id, max_running_requests=4, overlap=True,
                 **PATHS[path])
    try:
        first = greedy_requests("a")
        eng.submit(first)
        wait_for(lambda: min(len(r.output_ids) for r in first) >= 4)
        eng.pause("abort")  # returns once every running request is answered and the pipeline is empty
        assert all(r.done.is_set() and r.finish_reason["type"] == "abort" for r in first)
        assert eng._inflight is None and not eng._batch.rows
        eng.resume()
        second = greedy_requests("b")
        eng.submit(second)
        for r in second:
            assert r.done.wait(120)
    finally:
        eng.shutdown()
    for r, (toks, lps) in zip(first, want, strict=True):
        n = len(r.output_ids)
        assert 4 <= n < 30 and r.output_ids == toks[:n]  # what it had, without the unread step's token
        torch.testing.assert_close(torch.tensor(r.output_logprobs), torch.tensor(lps[:n]), atol=1e-5, rtol=0)
    for r, (toks, lps) in zip(second, want, strict=True):
        assert r.output_ids == toks and r.finish_reason["type"] == "length"
        torch.testing.assert_close(torch.tensor(r.output_logprobs), torch.tensor(lps), atol=1e-5, rtol=0)


def test_the_switch_reaches_the_engine(tiny_qwen2):
    from slime_rl.config.builtin_engine import parse_server_args

    assert parse_server_args(["--model-path", "m", "--disable-overlap-schedule"]).disable_overlap_schedule
    assert not parse_server_args(["--model-path", "m"]).disable_overlap_schedule
    for off in (False, True):
        s = start_server(tiny_qwen2, disable_overlap_schedule=off)
        try:
            out = s.generate({"input_ids": prompt_of(6), "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})
            assert len(out[1]["output_ids"]) == 8
            state = s.engine.load()
            assert state["overlap"] is not off and (state["overlapped_steps"] > 0) is not off
        finally:
            s.shutdown()


def test_the_sampler_plan_is_built_once_per_batch(model_tok, monkeypatch):
    """Item of the per-step host cost: the rows' temperatures, masks and index tensors are built when
    the batch changes, not every step (steps.EngineSteps._plan_of)."""
    from slime_rl.engines.embedded import steps as steps_mod

    built = []

    class Counting(steps_mod.SamplerPlan):
        def __init__(self, params, *a, **kw) -> None:
            built.append(len(params))
            super().__init__(params, *a, **kw)

    monkeypatch.setattr(steps_mod, "SamplerPlan", Counting)
    model, tok = model_tok
    eng = Engine(model, tok, {tok.eos_token_id}, tok.pad_token_id, max_running_requests=4, **PATHS["static"])
    reqs = [GenRequest(rid=f"p{i}", input_ids=prompt_of(4 + i, salt=i), params=SamplingParams.from_json(
        {"max_new_tokens": n, "temperature": 0.8, "top_p": 0.9, "ignore_eos": True}, 64)) for i, n in
        enumerate((6, 6, 12, 12))]
    try:
        eng.submit(reqs)
        for r in reqs:
            assert r.done.wait(120)
        steps = eng.load()["decode_forwards"]
    finally:
        eng.shutdown()
    # one plan for the 4 rows (their prefill and their decode steps: the same rows in the same order),
    # one for the 2 left once the 6-token rows finished; built every step, it would be steps + 1
    assert steps == 11 and built == [4, 2], (built, steps)


def test_routed_experts_count_the_reported_tokens_only(tiny_qwen3_moe):
    """A row that stops before the others runs one more step under overlap (for a token it never
    reports): its routed experts still cover prompt + output - 1 positions and equal the
    non-overlapped engine's (the engine records a step's experts with its tokens, and the answer is
    cut at seqlen - 1 in protocol.py as well)."""
    import httpx
    import numpy as np

    from slime_rl.engines.payloads import decode_routed_experts

    body = {"input_ids": [prompt_of(7), prompt_of(5, salt=2)], "return_routed_experts": True,
            "sampling_params": [{"max_new_tokens": n, "temperature": 1.0, "sampling_seed": 5 + n, "ignore_eos": True}
                                for n in (3, 9)]}
    answers = {}
    for off in (False, True):
        s = start_server(tiny_qwen3_moe, enable_return_routed_experts=True, disable_overlap_schedule=off)
        try:
            r = httpx.post(f"{s.url}/generate", json=body, timeout=120)
            assert r.status_code == 200, r.text
            answers[off] = r.json()
            assert (s.engine.load()["overlapped_steps"] > 0) is not off
        finally:
            s.shutdown()
    for on, off, prompt in zip(answers[False], answers[True], body["input_ids"], strict=True):
        assert on["output_ids"] == off["output_ids"]
        got, want = (decode_routed_experts(o["meta_info"]["routed_experts"]) for o in (on, off))
        # [prompt + output - 1, layers 2, top-k 2] (the tiny Qwen3-MoE)
        assert got.size == (len(prompt) + len(on["output_ids"]) - 1) * 2 * 2
        np.testing.assert_array_equal(got, want)
