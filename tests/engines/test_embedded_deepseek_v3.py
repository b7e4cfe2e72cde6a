"""DeepSeek-V3 (deepseek_v3: multi-latent attention) in the built-in engine, transformers' own modules: every
checkpoint name a weight update may send reaches the tensor the model computes with (MLA's projections and
latent norms, the fused experts by their per-expert names, the expert bias), and --enable-return-routed-experts
answers the experts transformers' sigmoid router picks in float64."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import torch
from engine_testlib import assert_served_and_live, prompt_of, start_server

from slime_rl.engines.payloads import decode_routed_experts

LAYERS, TOPK = 4, 2  # tests/conftest.py's tiny_deepseek_v3 and tiny_moonlight


@pytest.mark.parametrize("folder", ["tiny_deepseek_v3", "tiny_moonlight", "tiny_glm4_moe_lite"])
def test_every_checkpoint_name_is_served(folder, request):
    # an MLA latent norm, by its checkpoint name
    assert_served_and_live(request.getfixturevalue(folder), "model.layers.1.self_attn.kv_a_layernorm.weight",
                           lambda t: t.mul_(2.0))


def test_routed_experts_are_transformers_sigmoid_routing(tiny_deepseek_v3):
    from transformers import AutoModelForCausalLM

    server = start_server(tiny_deepseek_v3, enable_return_routed_experts=True)
    try:
        prompt = prompt_of(7)
        body = {"input_ids": prompt, "return_routed_experts": True,
                "sampling_params": {"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": 3, "ignore_eos": True}}
        out = httpx.post(f"{server.url}/generate", json=body, timeout=120).json()
        seq = prompt + out["output_ids"]
        got = decode_routed_experts(out["meta_info"]["routed_experts"]).reshape(len(seq) - 1, LAYERS, TOPK)
    finally:
        server.shutdown()
    model = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3, dtype=torch.float32,
                                                 experts_implementation="eager").double().eval()
    want = np.zeros((len(seq) - 1, LAYERS, TOPK), dtype=np.int64)
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(
                lambda m, a, o, i=i: want.__setitem__((slice(None), i), np.sort(o[2].numpy(), axis=-1)))
    with torch.no_grad():
        model(torch.tensor([seq[:-1]]))
    np.testing.assert_array_equal(np.sort(got, axis=-1), want)
    assert not got[:, 0].any() and got[:, 1:].any()


def test_kimi_k2_runs_on_deepseek_v3s_classes(tiny_deepseek_v3, tmp_path):
    """A Kimi-K2 checkpoint (config.json's model_type kimi_k2, which transformers has no classes for; its
    architecture is DeepseekV3ForCausalLM) loads in the built-in engine through DeepSeek-V3's classes: the same
    weights under either model_type give the same greedy tokens and log-probs."""
    import json
    import shutil

    kimi = tmp_path / "kimi"
    shutil.copytree(tiny_deepseek_v3, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    (kimi / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2"}))
    body = {"input_ids": prompt_of(9), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}}
    answers = []
    for folder in (tiny_deepseek_v3, kimi):
        server = start_server(folder)
        try:
            answers.append(httpx.post(f"{server.url}/generate", json=body, timeout=120).json())
        finally:
            server.shutdown()
    assert answers[0]["output_ids"] == answers[1]["output_ids"]
    assert answers[0]["meta_info"]["output_token_logprobs"] == answers[1]["meta_info"]["output_token_logprobs"]
