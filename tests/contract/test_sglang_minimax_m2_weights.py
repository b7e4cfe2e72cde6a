"""MiniMax-M2 (minimax_m2) weights as SGLang 0.5.23 loads them, with the names the trainer sends.

SGLang's `MiniMaxM2ForCausalLM.load_weights` fuses q/k/v into `qkv_proj`, the routed experts' w1 (gate), w3 (up)
and w2 (down) into FusedMoE's w13/w2 of `block_sparse_moe.experts` (its mapping names the checkpoint's w1/w2/w3),
and loads the router (`block_sparse_moe.gate.weight`), its `e_score_correction_bias` (a parameter there, with its
own loader; a buffer in transformers) and the whole-width q/k norms (MiniMaxM2RMSNormTP, whose loader takes the
whole [heads x head_dim] weight and keeps its TP rank's part) as they are. Its loader skips a name it has no
parameter for without a word, so the test checks that every name lands once, in the parameter and shard it belongs
to (TP 1, EP 1)."""

from __future__ import annotations

import types

import pytest
import torch

from tests.contract.sglang_probe import calls_by_target, recording_probe

minimax_m2 = pytest.importorskip("sglang.srt.models.minimax_m2",
                                 reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


def _sglang_param_names(num_layers: int) -> list[str]:
    """SGLang 0.5.23's MiniMax-M2 parameters at TP 1: QKVParallelLinear qkv_proj, o_proj, the q/k norms
    (use_qk_norm, qk_norm_type per_layer), RMSNorms, the MoE block (block_sparse_moe: gate, e_score_correction_bias
    under use_routing_bias, FusedMoE w13/w2)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(num_layers):
        p = f"model.layers.{i}."
        names += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight", p + "self_attn.q_norm.weight",
                  p + "self_attn.k_norm.weight", p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  p + "block_sparse_moe.gate.weight", p + "block_sparse_moe.e_score_correction_bias",
                  p + "block_sparse_moe.experts.w13_weight", p + "block_sparse_moe.experts.w2_weight"]
    return names


def test_sglang_maps_every_minimax_m2_name_we_send(tiny_minimax_m2):
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(tiny_minimax_m2)
    sent = hf_shapes(arch)  # every name weight sync sends (the expert bias included), in its order
    assert any(n.endswith("block_sparse_moe.e_score_correction_bias") for n in sent)
    config = types.SimpleNamespace(num_local_experts=arch.num_experts, num_hidden_layers=arch.num_layers)
    names = _sglang_param_names(arch.num_layers)
    probe = recording_probe(minimax_m2.MiniMaxM2ForCausalLM, config, names, arch.num_layers)
    probe.load_weights([(name, torch.zeros(shape)) for name, shape in sent.items()])
    assert len(probe.calls) == len(sent)  # one load per tensor sent: none skipped
    by_target = calls_by_target(probe)
    assert set(by_target) == set(names)
    h, width, experts = arch.hidden_size, arch.moe_ffn_hidden_size, arch.num_experts
    q, kv = arch.num_attention_heads * arch.kv_channels, arch.num_query_groups * arch.kv_channels
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        assert [(c[0], c[1]) for c in by_target[p + "self_attn.qkv_proj.weight"]] == [
            ((q, h), ("q",)), ((kv, h), ("k",)), ((kv, h), ("v",))]
        # the norms over all heads: the whole width, once
        assert [c[0] for c in by_target[p + "self_attn.q_norm.weight"]] == [(q,)] and q == 64
        assert [c[0] for c in by_target[p + "self_attn.k_norm.weight"]] == [(kv,)] and kv == 32
        assert [c[0] for c in by_target[p + "block_sparse_moe.gate.weight"]] == [(experts, h)]
        assert [c[0] for c in by_target[p + "block_sparse_moe.e_score_correction_bias"]] == [(experts,)]
        w13 = by_target[p + "block_sparse_moe.experts.w13_weight"]
        w2 = by_target[p + "block_sparse_moe.experts.w2_weight"]
        assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w13) == sorted(
            (e, s) for e in range(experts) for s in ("w1", "w3"))
        assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w2) == [(e, "w2") for e in range(experts)]
        assert all(shape == (width, h) for shape, _, _ in w13) and all(shape == (h, width) for shape, _, _ in w2)
