"""Qwen2-MoE weights as SGLang 0.5.23 loads them, with the names the trainer sends.

Besides the routed experts (as Qwen3-MoE: test_sglang_moe_weights.py), a Qwen2-MoE layer sends the
shared expert (`mlp.shared_expert.{gate,up,down}_proj.weight`), its gate
(`mlp.shared_expert_gate.weight` [1, hidden]) and the q/k/v biases; a dense layer (mlp_only_layers)
sends a plain MLP (`mlp.{gate,up,down}_proj.weight`). SGLang's `Qwen2MoeForCausalLM.load_weights`
fuses gate/up into `gate_up_proj` (shards 0 and 1) for the shared expert and the dense MLP alike,
q/k/v (weights and biases) into `qkv_proj`, the experts into FusedMoE's w13/w2, and loads the gate
as it is. Its loader skips a name it has no parameter for without a word, so the test checks that
every name lands once, in the parameter and shard it belongs to (TP 1, EP 1, SGLang's separate
shared-expert MLP: the tiny model's shared expert is wider than a routed one, so SGLang's fusion of
the shared expert into the experts does not apply)."""

from __future__ import annotations

import types

import pytest
import torch

from tests.contract.sglang_probe import calls_by_target, recording_probe

qwen2_moe = pytest.importorskip("sglang.srt.models.qwen2_moe",
                                reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


def _sglang_param_names(sparse: tuple[bool, ...], tied: bool) -> list[str]:
    """SGLang 0.5.23's Qwen2-MoE parameters at TP 1: QKVParallelLinear qkv_proj (weight and bias),
    RowParallelLinear o_proj, RMSNorms; a sparse layer's ReplicatedLinear gate, FusedMoE w13/w2,
    Qwen2MoeMLP shared_expert (gate_up_proj, down_proj) and its gate; a dense layer's Qwen2MoeMLP."""
    names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if tied else ["lm_head.weight"])
    for i, moe in enumerate(sparse):
        p = f"model.layers.{i}."
        names += [p + "self_attn.qkv_proj.weight", p + "self_attn.qkv_proj.bias", p + "self_attn.o_proj.weight",
                  p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if moe:
            names += [p + "mlp.gate.weight", p + "mlp.experts.w13_weight", p + "mlp.experts.w2_weight",
                      p + "mlp.shared_expert.gate_up_proj.weight", p + "mlp.shared_expert.down_proj.weight",
                      p + "mlp.shared_expert_gate.weight"]
        else:
            names += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
    return names


def test_sglang_maps_every_qwen2_moe_name_we_send(tiny_qwen2_moe):
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(tiny_qwen2_moe)
    assert arch.moe_layers == (True, True, False, True)  # a dense layer among them
    sent = hf_shapes(arch)  # every name weight sync sends, with its shape, in its order
    probe = recording_probe(qwen2_moe.Qwen2MoeForCausalLM, types.SimpleNamespace(num_experts=arch.num_experts),
                            _sglang_param_names(arch.moe_layers, arch.tie_word_embeddings), len(arch.moe_layers))
    probe.load_weights([(name, torch.zeros(shape)) for name, shape in sent.items()])
    assert len(probe.calls) == len(sent)  # one load per tensor sent: none skipped
    by_target = calls_by_target(probe)
    assert set(by_target) == set(_sglang_param_names(arch.moe_layers, arch.tie_word_embeddings))
    h, shared, ffn = arch.hidden_size, arch.moe_shared_expert_ffn_hidden_size, arch.ffn_hidden_size
    for i, moe in enumerate(arch.moe_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            assert [c[1] for c in by_target[p + f"self_attn.qkv_proj.{kind}"]] == [("q",), ("k",), ("v",)]
        if not moe:
            assert [(c[0], c[1]) for c in by_target[p + "mlp.gate_up_proj.weight"]] == [
                ((ffn, h), (0,)), ((ffn, h), (1,))]
            assert [c[0] for c in by_target[p + "mlp.down_proj.weight"]] == [(h, ffn)]
            continue
        assert [(c[0], c[1]) for c in by_target[p + "mlp.shared_expert.gate_up_proj.weight"]] == [
            ((shared, h), (0,)), ((shared, h), (1,))]
        assert [c[0] for c in by_target[p + "mlp.shared_expert.down_proj.weight"]] == [(h, shared)]
        assert [c[0] for c in by_target[p + "mlp.shared_expert_gate.weight"]] == [(1, h)]
        assert [c[0] for c in by_target[p + "mlp.gate.weight"]] == [(arch.num_experts, h)]
        w13, w2 = by_target[p + "mlp.experts.w13_weight"], by_target[p + "mlp.experts.w2_weight"]
        assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w13) == sorted(
            (e, s) for e in range(arch.num_experts) for s in ("w1", "w3"))
        assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w2) == [(e, "w2") for e in range(arch.num_experts)]
        assert all(shape == (arch.moe_ffn_hidden_size, h) for shape, _, _ in w13)
        assert all(shape == (h, arch.moe_ffn_hidden_size) for shape, _, _ in w2)
