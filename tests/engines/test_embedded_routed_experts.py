"""SGLang's routed experts from the built-in engine (engines/embedded/routing.py): with
--enable-return-routed-experts a request's return_routed_experts answers meta_info["routed_experts"],
base64 int32 [prompt + output - 1 - start, layers, top_k]; the ids are those a float64 forward of the
same tokens picks (HF's own router, not the engine's recording one)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from engine_testlib import prompt_of, start_server

from slime_rl.engines.payloads import decode_routed_experts

LAYERS, TOPK = 2, 2  # the tiny Qwen3-MoE (tests/conftest.py)


def _float64_topk(model_path, seq: list[int]) -> tuple[np.ndarray, float]:
    """[len(seq), layers, top_k] expert ids (sorted per row) of HF's router in float64, and the
    smallest gap between the k-th and (k+1)-th router logit (how far from a tie)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 experts_implementation="eager").double().eval()
    logits: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: logits.__setitem__(i, out[0]))
    with torch.no_grad():
        model(torch.tensor([seq]))
    ids = np.zeros((len(seq), LAYERS, TOPK), dtype=np.int64)
    gap = float("inf")
    for i in range(LAYERS):
        srt = logits[i].sort(dim=-1, descending=True)
        ids[:, i] = np.sort(srt.indices[:, :TOPK].numpy(), axis=-1)
        gap = min(gap, float((srt.values[:, TOPK - 1] - srt.values[:, TOPK]).min()))
    return ids, gap


def _post(url: str, body: dict) -> httpx.Response:
    return httpx.post(f"{url}/generate", json=body, timeout=120)


def test_routed_experts_match_a_float64_recomputation(tiny_qwen3_moe):
    server = start_server(tiny_qwen3_moe, enable_return_routed_experts=True)
    try:
        # a batch: two samples of one prompt (shared prefill) and another prompt, sampled
        prompts = [prompt_of(7), prompt_of(7), prompt_of(5, salt=2)]
        sps = [{"max_new_tokens": 9, "temperature": 1.0, "sampling_seed": 11 + k, "ignore_eos": True}
               for k in range(3)]
        r = _post(server.url, {"input_ids": prompts, "sampling_params": sps, "return_logprob": True,
                               "return_routed_experts": True})
        assert r.status_code == 200, r.text
        for prompt, out in zip(prompts, r.json(), strict=True):
            seq = prompt + out["output_ids"]
            flat = decode_routed_experts(out["meta_info"]["routed_experts"])
            got = np.sort(flat.reshape(len(seq) - 1, LAYERS, TOPK), axis=-1)
            ref, gap = _float64_topk(tiny_qwen3_moe, seq[:-1])
            assert gap > 1e-4  # no near tie: fp32 and fp64 must choose alike
            np.testing.assert_array_equal(got, ref)
        # routed_experts_start_len: the rows from that position on
        one = {"input_ids": prompts[2], "sampling_params": sps[2], "return_routed_experts": True}
        full = decode_routed_experts(_post(server.url, one).json()["meta_info"]["routed_experts"])
        cut = decode_routed_experts(_post(server.url, {**one, "routed_experts_start_len": 3}).json()
                                    ["meta_info"]["routed_experts"])
        np.testing.assert_array_equal(cut, full[3 * LAYERS * TOPK:])
        bad = _post(server.url, {**one, "routed_experts_start_len": 6})  # prompt has 5 tokens
        assert bad.status_code == 400 and "routed_experts_start_len" in bad.text
        # not asked: not answered
        plain = _post(server.url, {"input_ids": prompts[2], "sampling_params": sps[2]}).json()
        assert "routed_experts" not in plain["meta_info"]
    finally:
        server.shutdown()


def test_without_the_server_flag_the_key_is_absent_as_in_sglang(tiny_qwen3_moe):
    server = start_server(tiny_qwen3_moe)
    try:
        r = _post(server.url, {"input_ids": prompt_of(5), "sampling_params": {"max_new_tokens": 3},
                               "return_routed_experts": True})
        assert r.status_code == 200 and "routed_experts" not in r.json()["meta_info"]
    finally:
        server.shutdown()


def test_rounded_selection_flips_some_choices_and_keeps_the_rest(tiny_qwen3_moe):
    """routing_select_round='fp8_e5m2' (test only) routes some tokens elsewhere than fp32 routing: the
    acceptance test of rollout routing replay relies on it (bf16 flips none on this model)."""
    prompts = [prompt_of(24, salt=s) for s in range(4)]
    sp = {"max_new_tokens": 1, "temperature": 0.0}
    answers = []
    for rnd in (None, "fp8_e5m2"):
        server = start_server(tiny_qwen3_moe, enable_return_routed_experts=True, routing_select_round=rnd)
        try:
            r = _post(server.url, {"input_ids": prompts, "sampling_params": sp, "return_routed_experts": True})
            answers.append([decode_routed_experts(o["meta_info"]["routed_experts"]).reshape(-1, TOPK)
                            for o in r.json()])
        finally:
            server.shutdown()
    fp32, bf16 = (np.sort(np.concatenate(a), axis=-1) for a in answers)
    differ = (fp32 != bf16).any(axis=-1).mean()
    assert 0 < differ < 0.5, differ


def test_decode_refuses_malformed_values():
    with pytest.raises(ValueError, match="base64"):
        decode_routed_experts("not base64!")
    with pytest.raises(ValueError, match="int32"):
        decode_routed_experts("AAA=")  # 2 bytes
    with pytest.raises(ValueError, match="base64 string"):
        decode_routed_experts([1, 2])
