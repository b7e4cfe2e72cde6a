"""/generate of the embedded engine: log-probs against a float64 reference, seeding, stop conditions,
SGLang's response shape, and 400s that name the bad field."""

from __future__ import annotations

import httpx
import pytest
import torch
from engine_testlib import prompt_of, reference_logprobs, start_server

# The engine runs float32; the reference float64. On this 2-layer model the difference of the two
# log-probs stays below ~1e-6; 1e-5 leaves room for summation order and still catches any real
# error (a wrong position id or mask moves log-probs by 1e-2 or more).
ATOL = 1e-5


def gen(http: httpx.Client, prompt, **sp) -> dict:
    r = http.post("/generate", json={"input_ids": prompt, "sampling_params": sp, "return_logprob": True})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_output_logprobs_match_float64_reference(http, model64, temperature):
    prompt = prompt_of(9, salt=1)
    out = gen(http, prompt, max_new_tokens=12, temperature=temperature, ignore_eos=True)
    meta = out["meta_info"]
    lps = meta["output_token_logprobs"]
    assert [t for _, t, _ in lps] == out["output_ids"] and len(lps) == 12 == meta["completion_tokens"]
    assert all(text is None for _, _, text in lps)  # return_text_in_logprobs defaults to False
    # SGLang: temperature 0 is greedy (top_k=1) at temperature 1.0, so its log-probs are softmax(logits).
    ref = reference_logprobs(model64, prompt, out["output_ids"], temperature or 1.0)
    got = torch.tensor([lp for lp, _, _ in lps], dtype=torch.float64)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    if temperature == 0.0:  # greedy picks the argmax of the reference distribution at every step
        ids = torch.tensor([prompt + out["output_ids"]])
        with torch.no_grad():
            logits = model64(input_ids=ids).logits[0, len(prompt) - 1:-1]
        assert logits.argmax(-1).tolist() == out["output_ids"]


def test_input_token_logprobs_from_logprob_start_len(http, model64):
    prompt = prompt_of(8, salt=2)
    r = http.post("/generate", json={"input_ids": prompt, "return_logprob": True, "logprob_start_len": 0,
                                     "sampling_params": {"max_new_tokens": 2, "temperature": 0.5}})
    inp = r.json()["meta_info"]["input_token_logprobs"]
    assert [t for _, t, _ in inp] == prompt and inp[0][0] is None  # nothing predicts the first token
    ref = reference_logprobs(model64, prompt[:1], prompt[1:], 0.5)
    torch.testing.assert_close(torch.tensor([lp for lp, _, _ in inp[1:]], dtype=torch.float64), ref,
                               atol=ATOL, rtol=0)


def test_response_shape_is_sglangs(http):
    out = gen(http, prompt_of(4), max_new_tokens=3, ignore_eos=True)
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    for key in ("id", "finish_reason", "prompt_tokens", "completion_tokens", "weight_version", "cached_tokens",
                "output_token_logprobs", "input_token_logprobs", "output_token_logprobs_length"):
        assert key in meta, key
    assert meta["prompt_tokens"] == 4 and meta["finish_reason"] == {"type": "length", "length": 3}


def test_sampling_seed_and_random_seed_reproduce_in_a_fresh_server(http, server, tiny_qwen2):
    prompt = prompt_of(6, salt=3)
    seeded = gen(http, prompt, max_new_tokens=16, temperature=1.0, sampling_seed=7, ignore_eos=True)["output_ids"]
    assert gen(http, prompt, max_new_tokens=16, sampling_seed=7, ignore_eos=True)["output_ids"] == seeded
    other = gen(http, prompt, max_new_tokens=16, sampling_seed=8, ignore_eos=True)["output_ids"]
    assert other != seeded  # 16 draws from ~61 likely tokens: equal by chance is ~impossible
    fresh = [start_server(tiny_qwen2, random_seed=99) for _ in range(2)]
    try:
        runs = []
        for s in fresh:
            with httpx.Client(base_url=s.url, timeout=60) as c:
                runs.append([gen(c, prompt_of(5, salt=k), max_new_tokens=10, ignore_eos=True)["output_ids"]
                             for k in range(3)]
                            + [gen(c, prompt, max_new_tokens=16, sampling_seed=7, ignore_eos=True)["output_ids"]])
    finally:
        for s in fresh:
            s.shutdown()
    assert runs[0] == runs[1]  # same --random-seed, same request sequence: same tokens
    assert runs[0][-1] == seeded  # sampling_seed does not depend on the server or its history


def test_sampling_seed_is_ignored_without_deterministic_inference(tiny_qwen2, caplog):
    """SGLang 0.5.23 builds per-request seeds only under --enable-deterministic-inference: without it
    the same sampling_seed gives different tokens, and the engine says so once in its log."""
    prompt = prompt_of(6, salt=3)
    s = start_server(tiny_qwen2, random_seed=99, enable_deterministic_inference=False)
    try:
        with caplog.at_level("WARNING", logger="slime_rl.engines.embedded.server"), \
                httpx.Client(base_url=s.url, timeout=60) as c:
            outs = [gen(c, prompt, max_new_tokens=16, sampling_seed=7, ignore_eos=True)["output_ids"]
                    for _ in range(2)]
    finally:
        s.shutdown()
    assert outs[0] != outs[1]  # one shared generator drew both: 16 equal draws by chance is ~impossible
    warned = [r for r in caplog.records if "--enable-deterministic-inference" in r.getMessage()]
    assert len(warned) == 1


def test_max_new_tokens_and_stop_token_ids(http):
    prompt = prompt_of(7, salt=4)
    greedy = gen(http, prompt, max_new_tokens=10, temperature=0, ignore_eos=True)
    assert len(greedy["output_ids"]) == 10
    assert greedy["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    ids = greedy["output_ids"]
    stop_at = 4
    stop_tok = ids[stop_at]
    first = ids.index(stop_tok)
    out = gen(http, prompt, max_new_tokens=10, temperature=0, stop_token_ids=[stop_tok])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_tok}
    assert out["output_ids"] == ids[:first + 1]  # the matched token is kept in output_ids (and logprobs)
    assert len(out["meta_info"]["output_token_logprobs"]) == first + 1
    # ignore_eos also disables stop_token_ids in SGLang (schedule_batch._check_token_based_finish).
    assert gen(http, prompt, max_new_tokens=10, temperature=0, stop_token_ids=[stop_tok],
               ignore_eos=True)["output_ids"] == ids


def test_stop_string_check_decodes_sglangs_tail_only(http, server):
    """SGLang's scheduler checks stop strings on the decode of the last stop_str_max_len + 1 output
    tokens (Req.tail_str), stop_str_max_len from SamplingParams.normalize: the engine must take the
    same length (SGLang's own normalize computes it here), stop at the first token whose output
    text holds the stop string (found below by decoding every prefix in full), and never decode more
    than that tail in its stop check (decoding the whole output each step cost O(length) a row)."""
    from slime_rl.engines.embedded.sampling import SamplingParams

    tokenizer = server.tokenizer
    prompt = prompt_of(6, salt=8)
    ids = gen(http, prompt, max_new_tokens=24, temperature=0, ignore_eos=True)["output_ids"]
    stop = tokenizer.decode(ids[15:17])
    want = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    lengths = []

    class Recording:
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def decode(self, token_ids, *args, **kwargs):
            lengths.append(len(token_ids))
            return tokenizer.decode(token_ids, *args, **kwargs)

    engine = server.engine
    engine.tokenizer = Recording()
    try:
        out = gen(http, prompt, max_new_tokens=24, temperature=0, stop=[stop])
    finally:
        engine.tokenizer = tokenizer
    tail = len(tokenizer.encode(stop, add_special_tokens=False)) + 1
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["output_ids"] == ids[:want]
    assert len(lengths) == want and max(lengths) == min(tail, want), (lengths, tail)

    stops = ["ab", " the end", "\n\n", "</answer>"]
    ours = SamplingParams(stop=stops)
    ours.normalize(tokenizer)
    sgl = pytest.importorskip("sglang.srt.sampling.sampling_params", reason="sglang is not importable here")
    theirs = sgl.SamplingParams(stop=stops)
    theirs.normalize(tokenizer)
    assert ours.stop_str_max_len == theirs.stop_str_max_len > 1


def test_stop_string_trims_text_not_ids(http, server):
    prompt = prompt_of(5, salt=5)
    full = gen(http, prompt, max_new_tokens=12, temperature=0, ignore_eos=True)
    text = full["text"]
    assert len(text) >= 6, text
    stop = text[3:5]
    out = gen(http, prompt, max_new_tokens=12, temperature=0, stop=[stop])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[:text.index(stop)]
    decoded = server.tokenizer.decode(out["output_ids"])
    assert stop in decoded and out["output_ids"] == full["output_ids"][:len(out["output_ids"])]


def test_batch_of_prompts_and_text_input(http, server):
    prompts = [prompt_of(3, salt=6), prompt_of(8, salt=7)]
    r = http.post("/generate", json={"input_ids": prompts, "rid": ["a", "b"],
                                     "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    batch = r.json()
    assert [o["meta_info"]["id"] for o in batch] == ["a", "b"]
    for p, o in zip(prompts, batch, strict=True):
        assert o["output_ids"] == gen(http, p, max_new_tokens=5, temperature=0, ignore_eos=True)["output_ids"]
    text = server.tokenizer.decode(prompts[1])
    by_text = http.post("/generate", json={"text": text, "sampling_params": {"max_new_tokens": 3}}).json()
    assert by_text["meta_info"]["prompt_tokens"] == len(server.tokenizer.encode(text))


@pytest.mark.parametrize("body, field", [
    ({"input_ids": [1, 64]}, "input_ids"),
    ({"input_ids": [1], "text": "a"}, "text, input_ids"),
    ({"input_ids": [1], "sampling_params": {"top_p": 2.0}}, "sampling_params.top_p"),
    ({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"input_ids": [1], "sampling_params": {"json_schema": "{}"}}, "sampling_params.json_schema"),
    ({"input_ids": [1], "stream": True}, "stream"),
    ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob"),
    ({"input_ids": [1], "lora_path": "x"}, "lora_path"),
])
def test_bad_input_is_400_naming_the_field(http, body, field):
    r = http.post("/generate", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(field + ":"), r.json()
