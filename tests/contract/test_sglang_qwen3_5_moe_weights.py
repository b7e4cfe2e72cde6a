"""Qwen3.5-MoE (qwen3_5_moe) weights as SGLang 0.5.23 loads them, with the names the trainer sends.

A checkpoint whose architectures say Qwen3_5MoeForConditionalGeneration runs as SGLang's class of that name
(models/qwen3_5.py). Its `load_weights` maps `model.language_model.` to `model.`, drops `.self_attn`, fuses q/k/v into
`qkv_proj`, loads the Gated DeltaNet's split in_proj into its merged ones (as for qwen3_5) and the shared expert's
gate/up into `mlp.shared_expert.gate_up_proj`. The routed experts take one of two paths: the published checkpoint's
fused `mlp.experts.gate_up_proj` / `down_proj` (no `.weight`) switch it to its fused mapping, while one expert's
`mlp.experts.{e}.gate_proj.weight` / `up_proj` / `down_proj` go through FusedMoE.make_expert_params_mapping into
`experts.w13_weight` (shards w1, w3) and `experts.w2_weight` (w2) with that expert id. The trainer sends the per-expert
names, never a fused one, so the per-expert path is the one taken. Its loader skips a name it has no parameter for with
only a log line, so the test checks that every name lands once, in the parameter, shard and expert it belongs to, with
the shape SGLang's module has for it (TP 1, EP 1, shared-expert fusion off as on CUDA without aiter); the vision tower's
`model.visual.*` as for qwen3_5 (`visual.*`, `attn.qkv_proj`), whole."""

from __future__ import annotations

import types

import pytest
import torch

from tests.contract.sglang_probe import calls_by_target, recording_probe, sglang_qwen3_vision_names

qwen3_5 = pytest.importorskip("sglang.srt.models.qwen3_5",
                              reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


def _sglang_param_names(linear: tuple[bool, ...]) -> list[str]:
    """SGLang 0.5.23's Qwen3_5MoeForConditionalGeneration language-model parameters at TP 1, untied: qwen3_5's attention
    and Gated DeltaNet parameters and two GemmaRMSNorms per layer, and every layer's Qwen2MoeSparseMoeBlock (gate,
    FusedMoE w13/w2, shared_expert gate_up_proj / down_proj, shared_expert_gate)."""
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


def test_sglang_maps_every_qwen3_5_moe_name_we_send(tiny_qwen3_5_moe):
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(tiny_qwen3_5_moe)
    assert arch.linear_layers == (True, False, True, False) and not arch.tie_word_embeddings
    sent = hf_shapes(arch)  # every name weight sync sends, with its shape, in its order
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in sent)
    visual = [n for n in sent if n.startswith("model.visual.")]
    assert len(visual) == len(arch.vision.params) == 21
    names = _sglang_param_names(arch.linear_layers) + sglang_qwen3_vision_names(depth=1)
    probe = recording_probe(qwen3_5.Qwen3_5MoeForConditionalGeneration,
                            types.SimpleNamespace(tie_word_embeddings=False, num_experts=arch.num_experts,
                                                  encoder_only=False), names, arch.num_layers)
    probe.enable_shared_expert_fusion = False  # set by its __init__ (aiter on ROCm only)
    probe.num_fused_shared_experts = 0
    probe.load_weights([(name, torch.zeros(shape)) for name, shape in sent.items()])
    assert len(probe.calls) == len(sent)  # one load per tensor sent: none skipped
    by_target = calls_by_target(probe)
    assert set(by_target) == set(names)
    for n in visual:  # SGLang's name of the tower's tensor: visual.*, the attention's fused projection qkv_proj
        target = "visual." + n[len("model.visual."):].replace(".attn.qkv.", ".attn.qkv_proj.")
        assert by_target[target] == [(sent[n], (), {})], n
    h, d, heads, groups = arch.hidden_size, arch.kv_channels, arch.num_attention_heads, arch.num_query_groups
    key_dim = arch.linear_num_key_heads * arch.linear_key_head_dim
    value_dim, v_heads = arch.linear_num_value_heads * arch.linear_value_head_dim, arch.linear_num_value_heads
    width, shared = arch.moe_ffn_hidden_size, arch.moe_shared_expert_ffn_hidden_size
    whole = ((), {})
    for i, is_linear in enumerate(arch.linear_layers):
        p = f"model.layers.{i}."
        if is_linear:
            a = p + "linear_attn."
            assert by_target[a + "in_proj_qkvz.weight"] == [((2 * key_dim + value_dim, h), ((0, 1, 2),), {}),
                                                           ((value_dim, h), (3,), {})]
            assert by_target[a + "in_proj_ba.weight"] == [((v_heads, h), (0,), {}), ((v_heads, h), (1,), {})]
        else:
            assert [(c[0], c[1]) for c in by_target[p + "qkv_proj.weight"]] == [
                ((2 * heads * d, h), ("q",)), ((groups * d, h), ("k",)), ((groups * d, h), ("v",))]
            assert by_target[p + "o_proj.weight"] == [((h, heads * d), *whole)]
        assert by_target[p + "mlp.gate.weight"] == [((arch.num_experts, h), *whole)]
        assert [(c[0], c[1]) for c in by_target[p + "mlp.shared_expert.gate_up_proj.weight"]] == [
            ((shared, h), (0,)), ((shared, h), (1,))]
        assert by_target[p + "mlp.shared_expert.down_proj.weight"] == [((h, shared), *whole)]
        assert [c[0] for c in by_target[p + "mlp.shared_expert_gate.weight"]] == [(1, h)]
        w13, w2 = by_target[p + "mlp.experts.w13_weight"], by_target[p + "mlp.experts.w2_weight"]
        assert sorted((k["expert_id"], k["shard_id"], shape) for shape, _, k in w13) == sorted(
            (e, s, (width, h)) for e in range(arch.num_experts) for s in ("w1", "w3"))
        assert sorted((k["expert_id"], k["shard_id"], shape) for shape, _, k in w2) == [
            (e, "w2", (h, width)) for e in range(arch.num_experts)]
        # the per-expert names, not the published fused ones: each call names this layer's w13 / w2 parameter
        assert {args for _, args, _ in w13} == {(p + "mlp.experts.w13_weight",)}
