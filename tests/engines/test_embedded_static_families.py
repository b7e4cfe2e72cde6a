"""The static KV cache path (the one CUDA graphs capture) for every text family of the registry:
Llama, Qwen2 (= Qwen2.5's model_type), Qwen3, GLM-4 (its post norms, interleaved half-head RoPE and fused
gate_up_proj), and the real SmolLM2-135M-Instruct checkpoint.

The step passes a 4-D slot mask to the HF forward; Llama's forward hands it straight to
`create_causal_mask`, Qwen2/Qwen3's accept a per-layer-type dict, so a family-specific mistake shows
up only on that family (issue #18: the CUDA-graph path crashed on the real Llama). The reference is
the dynamic path (left-padded DynamicCache, itself checked against float64 in
test_embedded_generate.py), fed the same seeded requests in one batch, while the static path serves
them through fewer slots than requests, so rows join a decoding batch and reuse freed slots. One
request per tiny family is also checked against a float64 forward without any cache.
"""

from __future__ import annotations

import pytest
import torch
from engine_testlib import prompt_of, reference_logprobs
from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from slime_rl.engines.embedded.engine import Engine
from slime_rl.engines.embedded.protocol import seed_generator
from slime_rl.engines.embedded.request import GenRequest
from slime_rl.engines.embedded.sampling import SamplingParams


def _requests(prompts: list[list[int]], vocab: int, new_tokens: int) -> list[GenRequest]:
    reqs = []
    for i, p in enumerate(prompts):
        raw = {"max_new_tokens": new_tokens - (i % 3), "ignore_eos": True, "sampling_seed": 100 + i,
               "temperature": 0.0 if i % 2 else 0.8, "top_p": 0.95 if i % 4 == 2 else 1.0}
        req = GenRequest(rid=f"r{i}", input_ids=p, params=SamplingParams.from_json(raw, vocab), return_logprob=True)
        seed_generator(req, torch.device("cpu"))
        reqs.append(req)
    return reqs


def _run(engine: Engine, reqs: list[GenRequest]) -> dict:
    engine.submit(reqs)
    for r in reqs:
        assert r.done.wait(300), r.rid
    stats = engine.load()
    engine.shutdown()
    return stats


def _static_equals_dynamic(model, tok, prompts: list[list[int]], new_tokens: int, atol: float) -> list[GenRequest]:
    vocab = model.config.get_text_config().vocab_size
    eos = {tok.eos_token_id if tok.eos_token_id is not None else 0}
    ref = _requests(prompts, vocab, new_tokens)
    _run(Engine(model, tok, eos, 0, max_running_requests=len(prompts)), ref)
    got = _requests(prompts, vocab, new_tokens)
    slots = max(1, len(prompts) // 2)
    stats = _run(Engine(model, tok, eos, 0, max_running_requests=slots, static_cache=True, capacity=16,
                        min_kv_len=8), got)
    assert stats["static_eager_steps"] == stats["decode_forwards"] > 0  # every decode step was a static one
    for g, w in zip(got, ref, strict=True):
        assert g.output_ids == w.output_ids, g.rid
        assert g.finish_reason == w.finish_reason, g.rid
        torch.testing.assert_close(torch.tensor(g.output_logprobs), torch.tensor(w.output_logprobs), atol=atol, rtol=0)
    return got


def _tiny_qwen3(path) -> str:
    """A random 2-layer Qwen3 (q/k RMSNorm, explicit head_dim) sharing the tiny Qwen2's tokenizer."""
    torch.manual_seed(3)
    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=62, eos_token_id=63, pad_token_id=0)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "glm4"])
def family(request, tiny_llama, tiny_qwen2, tiny_glm4, tmp_path_factory):
    if request.param == "qwen3":
        path = _tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))
    else:
        path = {"llama": tiny_llama, "qwen2": tiny_qwen2, "glm4": tiny_glm4}[request.param]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert model.config.model_type == request.param
    return path, model, AutoTokenizer.from_pretrained(tiny_qwen2)


def test_static_path_equals_dynamic_path_per_family(family):
    path, model, tok = family
    prompts = [prompt_of(3 + 5 * i, salt=i) for i in range(6)]  # 3..28 tokens; capacity 16 must grow
    got = _static_equals_dynamic(model, tok, prompts, new_tokens=10, atol=1e-5)
    model64 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    for r in (got[4], got[5]):  # a sampled and a greedy request, both past the first capacity
        want = reference_logprobs(model64, r.input_ids, r.output_ids, r.params.temperature)
        torch.testing.assert_close(torch.tensor(r.output_logprobs, dtype=torch.float64), want, atol=1e-5, rtol=0)


def test_static_path_on_real_smollm2_fp32(smollm2_fp32):
    path = smollm2_fp32
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    questions = ["What is 12 + 30?", "Name a color.", "Write one word about the sea.", "What is 7 times 6?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False) for q in questions]
    # 30 fp32 layers accumulate more rounding than the tiny models' 2
    _static_equals_dynamic(model, tok, prompts, new_tokens=8, atol=2e-4)
