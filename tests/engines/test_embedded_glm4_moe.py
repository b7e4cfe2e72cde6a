"""GLM-4.5 (glm4_moe) in the built-in engine: every checkpoint name a weight update may send reaches the
tensor the model computes with (the fused routed experts by their per-expert names, the shared experts,
and e_score_correction_bias, a buffer), and --enable-return-routed-experts answers the experts
transformers' own sigmoid router picks in float64 (rows of the dense layer 0 are zero, as the engine
answers for layers without a router)."""

from __future__ import annotations

import httpx
import numpy as np
import torch
from engine_testlib import assert_served_and_live, prompt_of, start_server
from safetensors.torch import load_file

from slime_rl.engines.embedded.experts import expert_aliases
from slime_rl.engines.payloads import decode_routed_experts

LAYERS, TOPK = 4, 2  # tests/conftest.py's tiny_glm4_moe


def test_every_checkpoint_name_is_served(tiny_glm4_moe):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_glm4_moe, dtype=torch.float32).eval()
    aliases = expert_aliases(dict(model.named_parameters(remove_duplicate=False)), model.config)
    saved = load_file(tiny_glm4_moe / "model.safetensors")
    assert set(aliases) == {n for n in saved if ".mlp.experts." in n} and len(aliases) == 3 * 8 * 3

    def raise_expert_3(t):  # expert 3 then always chosen in layer 2
        t[3] += 1.0

    assert_served_and_live(tiny_glm4_moe, "model.layers.2.mlp.gate.e_score_correction_bias", raise_expert_3)


def _float64_choices(model_path, seq: list[int]) -> np.ndarray:
    """[len(seq), layers, top_k] sorted expert ids transformers' router picks in float64 (layer 0: 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                 experts_implementation="eager").double().eval()
    ids = np.zeros((len(seq), LAYERS, TOPK), dtype=np.int64)
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(
                lambda m, a, out, i=i: ids.__setitem__((slice(None), i), np.sort(out[2].numpy(), axis=-1)))
    with torch.no_grad():
        model(torch.tensor([seq]))
    return ids


def test_routed_experts_are_transformers_sigmoid_routing(tiny_glm4_moe):
    server = start_server(tiny_glm4_moe, enable_return_routed_experts=True)
    try:
        prompts = [prompt_of(7), prompt_of(6, salt=3)]
        sps = [{"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 5 + k, "ignore_eos": True}
               for k in range(2)]
        r = httpx.post(f"{server.url}/generate", json={"input_ids": prompts, "sampling_params": sps,
                                                         "return_routed_experts": True}, timeout=120)
        assert r.status_code == 200, r.text
        for prompt, out in zip(prompts, r.json(), strict=True):
            seq = prompt + out["output_ids"]
            got = decode_routed_experts(out["meta_info"]["routed_experts"]).reshape(len(seq) - 1, LAYERS, TOPK)
            want = _float64_choices(tiny_glm4_moe, seq[:-1])
            np.testing.assert_array_equal(np.sort(got, axis=-1), want)
            assert not got[:, 0].any() and got[:, 1:].any()
    finally:
        server.shutdown()
