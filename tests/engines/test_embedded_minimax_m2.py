"""MiniMax-M2 (minimax_m2) in the built-in engine: transformers' MiniMaxM2ForCausalLM runs as loaded
(AutoModelForCausalLM), and every checkpoint name a weight update sends reaches the tensor the model computes with:
the whole-width q/k norms, and the MoE block under the checkpoint's block_sparse_moe names (the router, its
e_score_correction_bias buffer, each expert's w1 / w3 / w2 as views of transformers' fused experts)."""

from __future__ import annotations

import pytest
import torch
from engine_testlib import assert_served_and_live

from slime_rl.config.families import FAMILIES


def _scale(t: torch.Tensor) -> None:
    t.mul_(1.5)


def _favour_expert_3(t: torch.Tensor) -> None:  # the bias only chooses: a large one makes expert 3 chosen everywhere
    t[3] += 10.0


@pytest.mark.parametrize("name,change", [
    ("model.layers.1.self_attn.q_norm.weight", _scale), ("model.layers.0.self_attn.k_norm.weight", _scale),
    ("model.layers.0.block_sparse_moe.gate.weight", _scale),
    ("model.layers.1.block_sparse_moe.e_score_correction_bias", _favour_expert_3),
    ("model.layers.0.block_sparse_moe.experts.3.w1.weight", _scale),
    ("model.layers.1.block_sparse_moe.experts.3.w3.weight", _scale),
    ("model.layers.0.block_sparse_moe.experts.3.w2.weight", _scale),
], ids=lambda v: v if isinstance(v, str) else "")
def test_every_checkpoint_name_is_served(tiny_minimax_m2, name, change):
    assert_served_and_live(tiny_minimax_m2, name, change)


def test_minimax_m2_rmsnorm_is_the_stock_one_the_compiled_step_replaces(tiny_minimax_m2):
    """The engine's --enable-torch-compile swaps the norms whose class the family names (hf_rmsnorm): every norm of
    the MiniMax-M2 decoder, the whole-width q/k norms included (an RMSNorm over their last dim), is that class."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_minimax_m2, dtype=torch.float32)
    norms = {type(m).__name__ for n, m in model.named_modules() if n.endswith("norm")}
    assert norms == {FAMILIES["minimax_m2"].hf_rmsnorm} == {"MiniMaxM2RMSNorm"}
    assert {tuple(m.weight.shape) for n, m in model.named_modules() if n.endswith(("q_norm", "k_norm"))} == {
        (64,), (32,)}


def test_routed_experts_are_transformers_sigmoid_routing(tiny_minimax_m2):
    """--enable-return-routed-experts answers, for every layer (each an MoE layer), the experts transformers' own
    MiniMaxM2TopKRouter picks in float64 (sigmoid + the block's e_score_correction_bias) over prompt + output."""
    import httpx
    import numpy as np
    from engine_testlib import prompt_of, start_server
    from transformers import AutoModelForCausalLM

    from slime_rl.engines.payloads import decode_routed_experts

    layers, topk = 2, 2
    model = AutoModelForCausalLM.from_pretrained(tiny_minimax_m2, dtype=torch.float32,
                                                 experts_implementation="eager").double().eval()
    server = start_server(tiny_minimax_m2, enable_return_routed_experts=True)
    try:
        prompt = prompt_of(7)
        sp = {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 5, "ignore_eos": True}
        r = httpx.post(f"{server.url}/generate", json={"input_ids": prompt, "sampling_params": sp,
                                                         "return_routed_experts": True}, timeout=120)
        assert r.status_code == 200, r.text
        out = r.json()
        seq = prompt + out["output_ids"]
        got = decode_routed_experts(out["meta_info"]["routed_experts"]).reshape(len(seq) - 1, layers, topk)
    finally:
        server.shutdown()
    want = np.zeros((len(seq) - 1, layers, topk), dtype=np.int64)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(
            lambda m, a, o, i=i: want.__setitem__((slice(None), i), np.sort(o[2].numpy(), axis=-1)))
    with torch.no_grad():
        model(torch.tensor([seq[:-1]]))
    np.testing.assert_array_equal(np.sort(got, axis=-1), want)
    assert len({tuple(row) for row in want[:, 0]}) > 1  # the choice varies by token
