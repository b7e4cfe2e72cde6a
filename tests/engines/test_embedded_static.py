"""The static KV cache path of the embedded engine (slots.py, graphs.py) on CPU, where it runs the
same static forward a CUDA graph captures, only eagerly.

The dynamic path (left-padded DynamicCache) is the reference: it is itself checked against a float64
model in test_embedded_generate.py / test_embedded_batching.py. Every request carries its own
seed (or is greedy), so its tokens do not depend on which rows share its forwards; then the static
path must give the same tokens and the same log-probs up to float32 noise, although it sees the
requests in a different schedule: fewer rows at once (slots are reused), requests joining while
others decode, an abort, a cache that grows and kv_len buckets that change mid-request.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch
from engine_testlib import causal_packed_attention, prompt_of, reference_logprobs, start_server
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config
from transformers.cache_utils import DynamicCache

from slime_rl.engines.embedded.attention import FLASH_DECODE
from slime_rl.engines.embedded.batch import Row
from slime_rl.engines.embedded.engine import Engine
from slime_rl.engines.embedded.precision import apply_deterministic_attention
from slime_rl.engines.embedded.protocol import seed_generator
from slime_rl.engines.embedded.request import GenRequest
from slime_rl.engines.embedded.sampling import SamplingParams
from slime_rl.engines.embedded.slots import SlotBatch, SlotCache, batch_buckets, unsupported

N = 10


def make_requests(vocab: int, abort_rid: str | None = None) -> list[GenRequest]:
    reqs = []
    for i in range(N):
        raw = {"max_new_tokens": 40 if f"r{i}" == abort_rid else 4 + 2 * i, "ignore_eos": i != 3,
               "temperature": 0.0 if i % 2 else 0.6 + 0.1 * (i % 4), "top_p": 0.9 if i % 4 == 2 else 1.0,
               "sampling_seed": 50 + i}
        req = GenRequest(rid=f"r{i}", input_ids=prompt_of(2 + 4 * i, salt=i),
                         params=SamplingParams.from_json(raw, vocab), return_logprob=True)
        seed_generator(req, torch.device("cpu"))
        reqs.append(req)
    return reqs


def wait_for(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


@pytest.fixture(scope="module")
def model_tok(tiny_qwen2):
    return (AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(tiny_qwen2))


@pytest.mark.parametrize("deterministic", [False, True], ids=["head_major", "time_major"])
def test_static_path_equals_dynamic_path(model_tok, model64, deterministic):
    """`deterministic`: the attention layers marked as --enable-deterministic-inference marks them, so
    the slot cache is time-major (the layout the CUDA flash decode reads); on CPU the same decode
    attention then reads it through the transposed views, and everything must stay equal."""
    model, tok = model_tok
    if deterministic:
        apply_deterministic_attention(model)
    try:
        _static_vs_dynamic(model, tok, model64, deterministic)
    finally:
        for m in model.modules():
            if hasattr(m, FLASH_DECODE):
                delattr(m, FLASH_DECODE)


def _static_vs_dynamic(model, tok, model64, time_major: bool) -> None:
    eos = {tok.eos_token_id}
    # reference: the dynamic path, every request submitted at once, none aborted
    ref_engine = Engine(model, tok, eos, 0, max_running_requests=N)
    ref = make_requests(64)
    ref_engine.submit(ref)
    for r in ref:
        assert r.done.wait(120)
    ref_engine.shutdown()

    # static path: 4 slots for 10 requests, a 16-column cache (prompts reach 38 tokens) and kv_len
    # buckets from 8, so rows move between buckets, the cache grows and slots are reused
    eng = Engine(model, tok, eos, 0, max_running_requests=4, static_cache=True, capacity=16, min_kv_len=8)
    assert eng._static is not None and eng._static.buckets == [1, 2, 4]
    assert eng._static.cache.time_major == time_major
    reqs = make_requests(64, abort_rid="r7")
    eng.submit(reqs[:5])
    wait_for(lambda: eng.load()["decode_forwards"] >= 3)
    eng.submit(reqs[5:])  # these join a batch that is already decoding
    wait_for(lambda: len(reqs[7].output_ids) >= 4 or reqs[7].done.is_set())
    eng.abort("r7")
    for r in reqs:
        assert r.done.wait(120)
    stats = eng.load()
    eng.shutdown()

    aborted = reqs[7]
    assert aborted.finish_reason["type"] == "abort" and len(aborted.output_ids) < 40
    n = len(aborted.output_ids)
    assert aborted.output_ids == ref[7].output_ids[:n]  # what it had is what it would have produced
    torch.testing.assert_close(torch.tensor(aborted.output_logprobs), torch.tensor(ref[7].output_logprobs[:n]),
                               atol=1e-5, rtol=0)
    for i, (got, want) in enumerate(zip(reqs, ref, strict=True)):
        if i == 7:
            continue
        assert got.output_ids == want.output_ids, i
        assert got.finish_reason == want.finish_reason, i
        torch.testing.assert_close(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs),
                                   atol=1e-5, rtol=0)
    for i in (8, 9):  # the longest prompts (past the first capacity) against the float64 model too
        temp = reqs[i].params.temperature
        want = reference_logprobs(model64, reqs[i].input_ids, reqs[i].output_ids, temp)
        torch.testing.assert_close(torch.tensor(reqs[i].output_logprobs, dtype=torch.float64), want,
                                   atol=1e-5, rtol=0)
    assert stats["static_eager_steps"] == stats["decode_forwards"] > 0 and stats["graph_replays"] == 0
    assert stats["max_running_rows"] == 4
    assert eng._static.cache.capacity >= 64  # grew from 16 (38-token prompts + up to 22 new tokens)
    keys = eng._static.cache.layers[0].keys  # the layout survived the growth
    assert keys.transpose(1, 2).is_contiguous() == time_major and keys.is_contiguous() != time_major


class _Req(SimpleNamespace):
    pass


def _prefill_cache(lengths: list[int], heads: int = 2, dim: int = 3, layers: int = 2) -> tuple[DynamicCache,
                                                                                               torch.Tensor]:
    """A left-padded 'prefill' cache whose entries name themselves: keys[b, h, t, :] = 1000 b + 10 t + h
    (values: the negative), so where each one ends up can be read back."""
    width = max(lengths)
    b, h, t = torch.meshgrid(torch.arange(len(lengths)), torch.arange(heads), torch.arange(width), indexing="ij")
    keys = (1000.0 * b + 10.0 * t + h)[..., None].expand(-1, -1, -1, dim).contiguous()
    cache = DynamicCache()
    for layer in range(layers):
        cache.update(keys + layer * 0.5, -(keys + layer * 0.5), layer)
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    return cache, mask


@pytest.mark.parametrize("time_major", [False, True])
def test_slot_batch_merge_keep_compacts_and_grows(time_major):
    cache = SlotCache(slots=8, capacity=4, time_major=time_major)
    batch = SlotBatch(cache, batch_buckets(8))
    assert batch.buckets == [1, 2, 4, 8]
    lengths = [3, 6, 2, 5, 4]
    rows = [Row(req=_Req(), next_pos=n) for n in lengths]
    prefill, mask = _prefill_cache(lengths)
    batch.merge(rows, mask, prefill)
    assert [r.slot for r in rows] == [0, 1, 2, 3, 4] and cache.capacity == 8  # 6 tokens + 1 pending > 4
    width = max(lengths)
    for r, (i, n) in zip(rows, enumerate(lengths), strict=True):
        for layer in range(2):
            want = prefill.layers[layer].keys[i, :, width - n:]
            assert torch.equal(cache.layers[layer].keys[r.slot, :, :n], want)
            assert torch.equal(cache.layers[layer].values[r.slot, :, :n], -want)
    assert batch.padded_size() == 8
    batch.keep([0, 2])  # rows in slots 0 and 2 stay: padded size 4 > bucket(2) = 2, so slot 2 moves to 1
    assert [r.slot for r in batch.rows] == [0, 1] and batch.moves == 1 and batch.padded_size() == 2
    assert torch.equal(cache.layers[1].keys[1, :, :2], prefill.layers[1].keys[2, :, width - 2:])
    more = [Row(req=_Req(), next_pos=n) for n in (7, 1)]
    p2, m2 = _prefill_cache([7, 1])
    batch.merge(more, m2, p2)  # lowest free slots; 7 + 1 columns still fit in 8
    assert [r.slot for r in more] == [2, 3] and cache.capacity == 8
    batch.cache.ensure_capacity(20)
    assert cache.capacity == 32 and torch.equal(cache.layers[0].keys[2, :, :7], p2.layers[0].keys[0])
    with pytest.raises(RuntimeError, match="row position 5 != cached tokens 4"):
        batch.merge([Row(req=_Req(), next_pos=5)], *reversed(_prefill_cache([4])))


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 100]
    assert batch_buckets(512) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192, 224, 256, 320, 384,
                                  448, 512]


def test_unsupported_models_stay_on_the_dynamic_path(model_tok, tiny_qwen2_5_vl):
    from transformers import AutoModelForImageTextToText

    model, tok = model_tok
    assert unsupported(model) is None
    sliding = Qwen2Config(num_hidden_layers=2, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert "sliding_attention" in unsupported(SimpleNamespace(config=sliding))
    dyn_rope = Qwen2Config(num_hidden_layers=2, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                                 "rope_theta": 10000.0})
    assert "dynamic" in unsupported(SimpleNamespace(config=dyn_rope))
    vl = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_5_vl, dtype=torch.float32).eval()
    assert "vision" in unsupported(vl)
    eng = Engine(vl, tok, {0}, 0, static_cache=True)
    try:
        assert eng._static is None and "graph_replays" not in eng.load()
    finally:
        eng.shutdown()


def test_server_flags_reach_the_engine(tiny_qwen2, model64):
    from slime_rl.config.builtin_engine import parse_server_args

    args = parse_server_args(["--model-path", "m", "--static-kv-cache", "--disable-cuda-graph",
                                      "--cuda-graph-max-bs", "8"])
    assert args.static_kv_cache and args.disable_cuda_graph and args.cuda_graph_max_bs == 8
    assert parse_server_args(["--model-path", "m", "--cuda-graph-max-bs-decode", "4"]).cuda_graph_max_bs == 4
    s = start_server(tiny_qwen2, static_kv_cache=True, max_running_requests=4)
    try:
        out = s.generate({"input_ids": prompt_of(6), "return_logprob": True,
                          "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}})[1]
        assert s.engine.load()["static_eager_steps"] == 5  # the first token comes from the prefill
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]], dtype=torch.float64)
        torch.testing.assert_close(got, reference_logprobs(model64, prompt_of(6), out["output_ids"]),
                                   atol=1e-5, rtol=0)
    finally:
        s.shutdown()
    s = start_server(tiny_qwen2)  # CPU default: the dynamic path, exactly as before
    try:
        assert s.engine._static is None and "static_eager_steps" not in s.engine.load()
    finally:
        s.shutdown()


def _reference_flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, is_causal, debug, *, scale,
                             window_size_left, window_size_right, seqused_k):
    """The semantics flash_slot_decode asks of torch's flash forward, in float64 (a stand-in for the
    CUDA kernel in this unit test): one query per row, row i reads seqused_k[i] packed keys from
    cu_k[i]; query head h reads KV head h // (H / Hkv); the window covers every key."""
    assert (max_q, dropout, is_causal, debug, window_size_right) == (1, 0.0, True, False, 0)
    assert cu_q.tolist() == list(range(q.shape[0] + 1)) and window_size_left >= max_k
    g = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        start, n = int(cu_k[i]), int(seqused_k[i])
        assert 1 <= n <= max_k
        kk = k[start:start + n].double().repeat_interleave(g, dim=1)  # [n, H, D]
        vv = v[start:start + n].double().repeat_interleave(g, dim=1)
        w = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), kk) * scale, dim=-1)
        out[i] = torch.einsum("hn,nhd->hd", w, vv).to(q.dtype)
    return (out,)


def test_flash_decode_plumbing_through_the_engine(model_tok, model64, monkeypatch):
    """The deterministic path end to end on CPU: prefills through the varlen packing (the padding
    read from the mask HF builds for it), decode steps through the time-major slot cache, its
    packed-rows view, cu_seqlens_k from the capacity, seqused_k from the mask, along the engine's
    schedule (rows joining mid-decode, an abort, slots reused and compacted, the cache growing,
    kv_len buckets changing); the CUDA kernels replaced by their float64 semantics (the GPU tests
    check the kernels themselves). Tokens and log-probs equal the dynamic path's."""
    from slime_rl.engines.embedded import attention as A

    calls = []

    def on_cpu(query, key, value, mask):
        ok = A.slot_rows(key) is not None and A.slot_rows(value) is not None and mask.dtype == torch.bool
        calls.append(ok)
        return ok

    prefills = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, *, scale, window_size):
        """torch's varlen_attn semantics (causal window), float64 per packed row."""
        assert window_size == (-1, 0) and torch.equal(cu_q, cu_k) and k.shape[1] == q.shape[1]
        prefills.append(cu_q.tolist())
        return causal_packed_attention(q, k, v, cu_q, scale)

    monkeypatch.setattr(A, "flash_decode_applies", on_cpu)
    monkeypatch.setattr(A, "_flash_forward", _reference_flash_forward)
    monkeypatch.setattr(A, "varlen_prefill_applies", lambda q, k, m: k.shape[2] == q.shape[2])
    monkeypatch.setattr(A, "_varlen_attn", lambda: varlen)
    model, tok = model_tok
    apply_deterministic_attention(model)
    try:
        _static_vs_dynamic(model, tok, model64, time_major=True)
    finally:
        for m in model.modules():
            if hasattr(m, FLASH_DECODE):
                delattr(m, FLASH_DECODE)
    assert calls and all(calls)  # every decode step's attention took the flash path
    # and the prefills the varlen one, rows of different lengths packed (left padding removed)
    sizes = [{b - a for a, b in zip(cu[:-1], cu[1:], strict=True)} for cu in prefills]
    assert prefills and any(len(s) > 1 for s in sizes)
