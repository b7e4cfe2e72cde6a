"""Qwen3-MoE weights as SGLang 0.5.23 loads them, with the names the trainer sends.

Weight sync sends every tensor under its HF name, each routed expert as
`model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight` (config/families.py, the
order of `Family.param_maps`). SGLang's `Qwen3MoeForCausalLM.load_weights` (what
/update_weights_from_distributed calls) maps them onto its fused parameters through
`FusedMoE.make_expert_params_mapping`: gate -> w13 shard "w1", up -> w13 shard "w3", down -> w2
shard "w2", with the expert id from the name; q/k/v into qkv_proj. Driven here: SGLang's own
load_weights on a module that holds SGLang's parameter names (TP 1, EP 1: every expert local),
each parameter's weight_loader recording what it got. Every name we send must land exactly once,
in the right parameter, shard and expert; nothing may be skipped silently."""

from __future__ import annotations

import types

import pytest
import torch

from tests.contract.sglang_probe import calls_by_target, recording_probe

qwen3_moe = pytest.importorskip("sglang.srt.models.qwen3_moe",
                                reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


def _sglang_param_names(layers: int, tied: bool) -> list[str]:
    """SGLang 0.5.23's Qwen3-MoE parameters at TP 1 (QKVParallelLinear qkv_proj, FusedMoE w13/w2,
    ReplicatedLinear gate, RMSNorms; ParallelLMHead unless tied)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [p + "self_attn.qkv_proj.weight", p + "self_attn.o_proj.weight", p + "self_attn.q_norm.weight",
                  p + "self_attn.k_norm.weight", p + "input_layernorm.weight", p + "post_attention_layernorm.weight",
                  p + "mlp.gate.weight", p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight"]
    return names


def test_sglang_maps_every_name_we_send(tiny_qwen3_moe):
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(tiny_qwen3_moe)
    sent = hf_shapes(arch)  # every name weight sync sends, with its shape, in its order
    assert sum(".mlp.experts." in n for n in sent) == arch.num_layers * arch.num_experts * 3
    config = types.SimpleNamespace(num_experts=arch.num_experts)
    probe = recording_probe(qwen3_moe.Qwen3MoeForCausalLM, config,
                            _sglang_param_names(arch.num_layers, arch.tie_word_embeddings), arch.num_layers)
    probe.load_weights([(name, torch.zeros(shape)) for name, shape in sent.items()])
    assert len(probe.calls) == len(sent)  # one load per tensor sent: none skipped
    by_target = calls_by_target(probe)
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        assert [c[1] for c in by_target[p + "self_attn.qkv_proj.weight"]] == [("q",), ("k",), ("v",)]
        w13 = by_target[p + "mlp.experts.w13_weight"]
        w2 = by_target[p + "mlp.experts.w2_weight"]
        assert len(w13) == 2 * arch.num_experts and len(w2) == arch.num_experts
        # (expert_id, shard_id) of each load: gate is w1, up is w3, every expert once
        assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w13) == sorted(
            (e, s) for e in range(arch.num_experts) for s in ("w1", "w3"))
        assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w2) == [(e, "w2") for e in range(arch.num_experts)]
        assert all(shape == (arch.moe_ffn_hidden_size, arch.hidden_size) for shape, _, _ in w13)
        assert all(shape == (arch.hidden_size, arch.moe_ffn_hidden_size) for shape, _, _ in w2)
        # the loader got the renamed parameter name and the expert of the name we sent
        for _, args, _ in w13 + w2:
            assert args[0].startswith(p + "mlp.experts.w")
        assert [c[0] for c in by_target[p + "mlp.gate.weight"]] == [(arch.num_experts, arch.hidden_size)]
    loaded = set(by_target)
    assert loaded == set(_sglang_param_names(arch.num_layers, arch.tie_word_embeddings))


def test_expert_id_comes_from_the_name(tiny_qwen3_moe):
    """Expert 5's up projection of layer 1 lands as expert 5, shard w3 (not expert 0 or 50)."""
    from slime_rl.trainer.convert import load_arch

    arch = load_arch(tiny_qwen3_moe)
    probe = recording_probe(qwen3_moe.Qwen3MoeForCausalLM, types.SimpleNamespace(num_experts=arch.num_experts),
                            _sglang_param_names(arch.num_layers, False), arch.num_layers)
    probe.load_weights([("model.layers.1.mlp.experts.5.up_proj.weight", torch.zeros(32, 64))])
    ((param, _, args, kwargs),) = probe.calls
    assert param == "model.layers.1.mlp.experts.w13_weight"
    assert (kwargs["expert_id"], kwargs["shard_id"]) == (5, "w3")
