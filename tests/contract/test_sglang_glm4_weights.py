"""GLM-4 dense (glm4) weights as SGLang 0.5.23 loads them, with the names the trainer sends.

SGLang's `Glm4ForCausalLM.load_weights` fuses q/k/v (weights and biases) into `qkv_proj` through its
stacked_params_mapping and loads every other name as it is: the post norms (`post_self_attn_layernorm`,
`post_mlp_layernorm`, RMSNorms of its decoder layer) and the MLP's `gate_up_proj`, which the trainer sends whole,
[gate; up], as the checkpoint holds it. Its mapping's `.gate_proj` / `.up_proj` do not occur in that name
(`gate_up_proj` has no `.up_proj`), so the tensor reaches MergedColumnParallelLinear's weight_loader without a
shard id: SGLang's "already fused in the checkpoint" branch, which splits it by output_sizes (intermediate,
intermediate) and takes each TP rank's rows of both halves. Its loader skips a name it has no parameter for with
only a log line, so the test checks that every name lands once, in the parameter and shard it belongs to (TP 1)."""

from __future__ import annotations

import types

import pytest
import torch

from tests.contract.sglang_probe import calls_by_target, recording_probe

glm4 = pytest.importorskip("sglang.srt.models.glm4",
                           reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


def _sglang_param_names(layers: int) -> list[str]:
    """SGLang 0.5.23's GLM-4 parameters at TP 1, untied: QKVParallelLinear qkv_proj (weight and bias), o_proj,
    MergedColumnParallelLinear gate_up_proj, down_proj, four RMSNorms per layer."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(layers):
        p = f"model.layers.{i}."
        names += [p + "self_attn.qkv_proj.weight", p + "self_attn.qkv_proj.bias", p + "self_attn.o_proj.weight",
                  p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight", p + "input_layernorm.weight",
                  p + "post_attention_layernorm.weight", p + "post_self_attn_layernorm.weight",
                  p + "post_mlp_layernorm.weight"]
    return names


def test_sglang_maps_every_glm4_name_we_send(tiny_glm4):
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(tiny_glm4)
    sent = hf_shapes(arch)  # every name weight sync sends, with its shape, in its order
    assert arch.post_norms and not arch.tie_word_embeddings
    config = types.SimpleNamespace(tie_word_embeddings=False, num_hidden_layers=arch.num_layers)
    names = _sglang_param_names(arch.num_layers)
    probe = recording_probe(glm4.Glm4ForCausalLM, config, names, arch.num_layers)
    probe.load_weights([(name, torch.zeros(shape)) for name, shape in sent.items()])
    assert len(probe.calls) == len(sent)  # one load per tensor sent: none skipped
    by_target = calls_by_target(probe)
    assert set(by_target) == set(names)
    h, ffn = arch.hidden_size, arch.ffn_hidden_size
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias"):
            assert [c[1] for c in by_target[p + f"self_attn.qkv_proj.{kind}"]] == [("q",), ("k",), ("v",)]
        # whole [gate; up], no shard id: MergedColumnParallelLinear splits it by output_sizes itself
        assert by_target[p + "mlp.gate_up_proj.weight"] == [((2 * ffn, h), (), {})]
        assert [c[0] for c in by_target[p + "mlp.down_proj.weight"]] == [(h, ffn)]
        for norm in ("post_self_attn_layernorm", "post_mlp_layernorm", "post_attention_layernorm"):
            assert by_target[p + f"{norm}.weight"] == [((h,), (), {})], norm


def test_sglang_glm4_rotates_interleaved_half_heads():
    """SGLang's Glm4Attention builds its rotary embedding as GPT-J's interleaved pairs (is_neox_style False) on
    partial_rotary_factor of each head (default 0.5): the rotation the trainer runs (megatron's rotary_interleaved
    with rotary_percent, tests/trainer/test_glm4.py)."""
    import inspect

    source = inspect.getsource(glm4.Glm4Attention.__init__)
    assert "is_neox_style=False" in source and "partial_rotary_factor=partial_rotary_factor" in source
