"""Qwen3-Next (qwen3_next) weights as SGLang 0.5.23 loads them, with the names the trainer sends.

SGLang's `Qwen3NextForCausalLM.load_weights` drops `.self_attn` from a full-attention layer's names (its
Qwen3HybridAttentionDecoderLayer holds qkv_proj, o_proj, q_norm and k_norm itself), fuses q/k/v into `qkv_proj`
(q_proj whole, its per-head query and gate rows as the checkpoint holds them), gate/up into the shared expert's
`gate_up_proj` and the experts into FusedMoE's w13/w2. A Gated DeltaNet layer's `linear_attn.in_proj_qkvz` and
`in_proj_ba` match none of its stacked mappings (those name the split `in_proj_qkv.` / `in_proj_z.` / `in_proj_b.` /
`in_proj_a.`), so they reach their packed weight loaders without a shard id, SGLang's branch for the checkpoint's
per-key-head format, as do conv1d, dt_bias, A_log, the gated norm and out_proj. Its loader skips a name it has no
parameter for without a word, so the test checks that every name lands once, in the parameter and shard it belongs
to, with the shape SGLang's module has for it (TP 1, EP 1, the shared expert as its own MLP: the tiny model's is
wider than a routed expert, so SGLang's shared-expert fusion does not apply)."""

from __future__ import annotations

import types

import pytest
import torch

from tests.contract.sglang_probe import calls_by_target, recording_probe

qwen3_next = pytest.importorskip("sglang.srt.models.qwen3_next",
                                 reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


def _sglang_param_names(linear: tuple[bool, ...]) -> list[str]:
    """SGLang 0.5.23's Qwen3-Next parameters at TP 1, untied: a linear-attention layer's Qwen3GatedDeltaNet
    (in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, its gated norm, out_proj), a full-attention layer's
    QKVParallelLinear qkv_proj, o_proj and q/k norms on the layer itself; two GemmaRMSNorms per layer; every layer's
    Qwen2MoeSparseMoeBlock (gate, FusedMoE w13/w2, shared_expert gate_up_proj / down_proj, shared_expert_gate)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i, is_linear in enumerate(linear):
        p = f"model.layers.{i}."
        if is_linear:
            names += [p + "linear_attn." + n for n in ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight",
                                                       "dt_bias", "A_log", "norm.weight", "out_proj.weight")]
        else:
            names += [p + "qkv_proj.weight", p + "o_proj.weight", p + "q_norm.weight", p + "k_norm.weight"]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "mlp.gate.weight",
                  p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight",
                  p + "mlp.shared_expert.gate_up_proj.weight", p + "mlp.shared_expert.down_proj.weight",
                  p + "mlp.shared_expert_gate.weight"]
    return names


def test_sglang_maps_every_qwen3_next_name_we_send(tiny_qwen3_next):
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(tiny_qwen3_next)
    assert arch.linear_layers == (True, False, True, False) and not arch.tie_word_embeddings
    sent = hf_shapes(arch)  # every name weight sync sends, with its shape, in its order
    names = _sglang_param_names(arch.linear_layers)
    probe = recording_probe(qwen3_next.Qwen3NextForCausalLM, types.SimpleNamespace(num_experts=arch.num_experts),
                            names, arch.num_layers)
    probe.enable_shared_expert_fusion = False  # set by its __init__ from the server args; off for this model
    probe.load_weights([(name, torch.zeros(shape)) for name, shape in sent.items()])
    assert len(probe.calls) == len(sent)  # one load per tensor sent: none skipped
    by_target = calls_by_target(probe)
    assert set(by_target) == set(names)
    h, d, heads, groups = arch.hidden_size, arch.kv_channels, arch.num_attention_heads, arch.num_query_groups
    # Qwen3GatedDeltaNet's sizes (its __init__): key_dim = key heads x width, value_dim = value heads x width
    key_dim = arch.linear_num_key_heads * arch.linear_key_head_dim
    value_dim, v_heads = arch.linear_num_value_heads * arch.linear_value_head_dim, arch.linear_num_value_heads
    whole = ((), {})  # no shard id: the checkpoint's own (packed) format
    for i, is_linear in enumerate(arch.linear_layers):
        p = f"model.layers.{i}."
        if is_linear:
            want = {"in_proj_qkvz.weight": (2 * key_dim + 2 * value_dim, h), "in_proj_ba.weight": (2 * v_heads, h),
                    "conv1d.weight": (2 * key_dim + value_dim, 1, arch.linear_conv_kernel_dim),
                    "dt_bias": (v_heads,), "A_log": (v_heads,), "norm.weight": (arch.linear_value_head_dim,),
                    "out_proj.weight": (h, value_dim)}
            for name, shape in want.items():
                assert by_target[p + "linear_attn." + name] == [(shape, *whole)], name
        else:
            # q_proj: each head's query rows and gate rows (Qwen3NextAttention's 2 x heads x head_dim)
            assert [(c[0], c[1]) for c in by_target[p + "qkv_proj.weight"]] == [
                ((2 * heads * d, h), ("q",)), ((groups * d, h), ("k",)), ((groups * d, h), ("v",))]
            assert by_target[p + "o_proj.weight"] == [((h, heads * d), *whole)]
            assert by_target[p + "q_norm.weight"] == by_target[p + "k_norm.weight"] == [((d,), *whole)]
        shared = arch.moe_shared_expert_ffn_hidden_size
        assert [(c[0], c[1]) for c in by_target[p + "mlp.shared_expert.gate_up_proj.weight"]] == [
            ((shared, h), (0,)), ((shared, h), (1,))]
        assert [c[0] for c in by_target[p + "mlp.shared_expert_gate.weight"]] == [(1, h)]
        w13, w2 = by_target[p + "mlp.experts.w13_weight"], by_target[p + "mlp.experts.w2_weight"]
        assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w13) == sorted(
            (e, s) for e in range(arch.num_experts) for s in ("w1", "w3"))
        assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w2) == [(e, "w2") for e in range(arch.num_experts)]


def test_sglang_qwen3_next_norms_are_zero_centred_and_the_gated_norm_is_not():
    """SGLang runs the decoder's norms as GemmaRMSNorm (times 1 + w: the weight the trainer sends as stored, as
    megatron's layernorm_zero_centered_gamma reads it) and the Gated DeltaNet's output norm as a plain gated RMSNorm
    (times w), as the trainer's GatedDeltaNetOutNorm does."""
    import inspect

    layer = inspect.getsource(qwen3_next.Qwen3HybridLinearDecoderLayer.__init__)
    assert "self.input_layernorm = GemmaRMSNorm(" in layer and "self.post_attention_layernorm = GemmaRMSNorm(" in layer
    from sglang.srt.layers.layernorm import GemmaRMSNorm

    norm = GemmaRMSNorm(4, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.5, -0.25, 0.0, 1.0]))
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + norm.weight)
    torch.testing.assert_close(norm.forward_native(x), want)
