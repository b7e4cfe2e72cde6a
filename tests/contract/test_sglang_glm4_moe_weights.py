"""GLM-4.5 (glm4_moe) weights as SGLang 0.5.23 loads them, with the names the trainer sends.

SGLang's `Glm4MoeForCausalLM.load_weights` fuses q/k/v (weights and biases) into `qkv_proj`, the dense
layers' and the shared experts' gate/up into `gate_up_proj` (shards 0 and 1), the routed experts into
FusedMoE's w13/w2, and loads the router (`mlp.gate.weight`), its `e_score_correction_bias` (a parameter
there, a buffer in transformers) and the q/k norms as they are. With shared-experts fusion on (SGLang's
default where its kernels allow it) the shared expert becomes routed expert `n_routed_experts` of
FusedMoE. Its loader skips a name it has no parameter for without a word, so the test checks that every
name lands once, in the parameter and shard it belongs to (TP 1, EP 1), both ways."""

from __future__ import annotations

import types

import pytest
import torch

from tests.contract.sglang_probe import calls_by_target, recording_probe

glm4_moe = pytest.importorskip("sglang.srt.models.glm4_moe",
                               reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


def _sglang_param_names(sparse: tuple[bool, ...], fused_shared: bool) -> list[str]:
    """SGLang 0.5.23's GLM-4.5 parameters at TP 1: QKVParallelLinear qkv_proj (weight and bias), o_proj,
    q/k norms (use_qk_norm), RMSNorms; a sparse layer's gate (weight and e_score_correction_bias), FusedMoE
    w13/w2 and, unfused, the shared experts' Glm4MoeMLP; a dense layer's Glm4MoeMLP."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i, moe in enumerate(sparse):
        p = f"model.layers.{i}."
        names += [p + "self_attn.qkv_proj.weight", p + "self_attn.qkv_proj.bias", p + "self_attn.o_proj.weight",
                  p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight",
                  p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if moe:
            names += [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias", p + "mlp.experts.w13_weight",
                      p + "mlp.experts.w2_weight"]
            if not fused_shared:
                names += [p + "mlp.shared_experts.gate_up_proj.weight", p + "mlp.shared_experts.down_proj.weight"]
        else:
            names += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
    return names


@pytest.mark.parametrize("fused_shared", [False, True], ids=["shared-apart", "shared-fused"])
def test_sglang_maps_every_glm4_moe_name_we_send(tiny_glm4_moe, fused_shared):
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(tiny_glm4_moe)
    assert arch.moe_layers == (False, True, True, True) and arch.qk_layernorm
    sent = hf_shapes(arch)  # every name weight sync sends (the expert bias included), in its order
    assert any(n.endswith("mlp.gate.e_score_correction_bias") for n in sent)
    config = types.SimpleNamespace(n_routed_experts=arch.num_experts, num_hidden_layers=arch.num_layers,
                                   num_nextn_predict_layers=0)
    names = _sglang_param_names(arch.moe_layers, fused_shared)
    probe = recording_probe(glm4_moe.Glm4MoeForCausalLM, config, names, arch.num_layers)
    probe.num_fused_shared_experts = int(fused_shared)
    probe.load_weights([(name, torch.zeros(shape)) for name, shape in sent.items()])
    assert len(probe.calls) == len(sent)  # one load per tensor sent: none skipped
    by_target = calls_by_target(probe)
    assert set(by_target) == set(names)
    h, ffn, width, experts = arch.hidden_size, arch.ffn_hidden_size, arch.moe_ffn_hidden_size, arch.num_experts
    shared = arch.moe_shared_expert_ffn_hidden_size
    for i, moe in enumerate(arch.moe_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            assert [c[1] for c in by_target[p + f"self_attn.qkv_proj.{kind}"]] == [("q",), ("k",), ("v",)]
        assert [c[0] for c in by_target[p + "self_attn.q_norm.weight"]] == [(arch.kv_channels,)]
        if not moe:
            assert [(c[0], c[1]) for c in by_target[p + "mlp.gate_up_proj.weight"]] == [
                ((ffn, h), (0,)), ((ffn, h), (1,))]
            assert [c[0] for c in by_target[p + "mlp.down_proj.weight"]] == [(h, ffn)]
            continue
        assert [c[0] for c in by_target[p + "mlp.gate.weight"]] == [(experts, h)]
        assert [c[0] for c in by_target[p + "mlp.gate.e_score_correction_bias"]] == [(experts,)]
        routed = experts + int(fused_shared)  # fused: the shared expert is FusedMoE's expert n_routed_experts
        w13, w2 = by_target[p + "mlp.experts.w13_weight"], by_target[p + "mlp.experts.w2_weight"]
        assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w13) == sorted(
            (e, s) for e in range(routed) for s in ("w1", "w3"))
        assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w2) == [(e, "w2") for e in range(routed)]
        assert all(shape == (width, h) for shape, _, _ in w13) and all(shape == (h, width) for shape, _, _ in w2)
        if not fused_shared:
            assert [(c[0], c[1]) for c in by_target[p + "mlp.shared_experts.gate_up_proj.weight"]] == [
                ((shared, h), (0,)), ((shared, h), (1,))]
            assert [c[0] for c in by_target[p + "mlp.shared_experts.down_proj.weight"]] == [(h, shared)]
