"""Qwen3.5 (qwen3_5) weights as SGLang 0.5.23 loads them, with the names the trainer sends.

A checkpoint whose architectures say Qwen3_5ForConditionalGeneration runs as SGLang's class of that name
(models/qwen3_5.py), whose `load_weights` maps `model.language_model.` to `model.`, drops `.self_attn` from a
full-attention layer's names (its decoder layer holds qkv_proj, o_proj, q_norm and k_norm itself), fuses q/k/v into
`qkv_proj` (q_proj whole, its per-head query and gate rows as the checkpoint holds them) and gate/up into the dense
MLP's `gate_up_proj`, and loads the Gated DeltaNet's split tensors into its merged ones: `in_proj_qkv` into
`in_proj_qkvz` with shard ids (0, 1, 2), `in_proj_z` as shard 3, `in_proj_b` / `in_proj_a` into `in_proj_ba` as 0 / 1.
The trainer sends the vision tower too, under the checkpoint's `model.visual.*`: the loader names it `visual.*` and
its attention's `attn.qkv` `attn.qkv_proj` (VisionAttention), each tensor whole (TP 1). Its loader skips a name it has
no parameter for with only a log line, so the test checks that every name lands once, in the parameter and shard it
belongs to, with the shape SGLang's module has for it (TP 1), and that SGLang's packed loader cuts in_proj_qkv into
the q, k and v the trainer means."""

from __future__ import annotations

import types

import pytest
import torch

from tests.contract.sglang_probe import calls_by_target, recording_probe, sglang_qwen3_vision_names

qwen3_5 = pytest.importorskip("sglang.srt.models.qwen3_5",
                              reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


def _sglang_param_names(linear: tuple[bool, ...]) -> list[str]:
    """SGLang 0.5.23's Qwen3_5ForConditionalGeneration language-model parameters at TP 1, untied: a linear-attention
    layer's Qwen3_5GatedDeltaNet (in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, its gated norm, out_proj), a
    full-attention layer's qkv_proj, o_proj and q/k norms on the layer itself; two GemmaRMSNorms and a Qwen2MoeMLP
    (gate_up_proj, down_proj) per layer."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i, is_linear in enumerate(linear):
        p = f"model.layers.{i}."
        if is_linear:
            names += [p + "linear_attn." + n for n in ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight",
                                                       "dt_bias", "A_log", "norm.weight", "out_proj.weight")]
        else:
            names += [p + "qkv_proj.weight", p + "o_proj.weight", p + "q_norm.weight", p + "k_norm.weight"]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight", p + "mlp.gate_up_proj.weight",
                  p + "mlp.down_proj.weight"]
    return names


def test_sglang_maps_every_qwen3_5_name_we_send(tiny_qwen3_5):
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(tiny_qwen3_5)
    assert arch.linear_layers == (True, False, True, False) and not arch.tie_word_embeddings
    sent = hf_shapes(arch)  # every name weight sync sends, with its shape, in its order
    visual = [n for n in sent if n.startswith("model.visual.")]
    assert len(visual) == len(arch.vision.params) == 21
    names = _sglang_param_names(arch.linear_layers) + sglang_qwen3_vision_names(depth=1)
    probe = recording_probe(qwen3_5.Qwen3_5ForConditionalGeneration,
                            types.SimpleNamespace(tie_word_embeddings=False), names, arch.num_layers)
    probe.pooler = None  # set by its __init__ for a joint-head checkpoint only
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
    whole = ((), {})
    for i, is_linear in enumerate(arch.linear_layers):
        p = f"model.layers.{i}."
        if is_linear:
            a = p + "linear_attn."
            assert by_target[a + "in_proj_qkvz.weight"] == [((2 * key_dim + value_dim, h), ((0, 1, 2),), {}),
                                                           ((value_dim, h), (3,), {})]
            assert by_target[a + "in_proj_ba.weight"] == [((v_heads, h), (0,), {}), ((v_heads, h), (1,), {})]
            want = {"conv1d.weight": (2 * key_dim + value_dim, 1, arch.linear_conv_kernel_dim),
                    "dt_bias": (v_heads,), "A_log": (v_heads,), "norm.weight": (arch.linear_value_head_dim,),
                    "out_proj.weight": (h, value_dim)}
            for name, shape in want.items():
                assert by_target[a + name] == [(shape, *whole)], name
        else:
            assert [(c[0], c[1]) for c in by_target[p + "qkv_proj.weight"]] == [
                ((2 * heads * d, h), ("q",)), ((groups * d, h), ("k",)), ((groups * d, h), ("v",))]
            assert by_target[p + "o_proj.weight"] == [((h, heads * d), *whole)]
            assert by_target[p + "q_norm.weight"] == by_target[p + "k_norm.weight"] == [((d,), *whole)]
        assert [(c[0], c[1]) for c in by_target[p + "mlp.gate_up_proj.weight"]] == [
            ((arch.ffn_hidden_size, h), (0,)), ((arch.ffn_hidden_size, h), (1,))]
        assert by_target[p + "mlp.down_proj.weight"] == [((h, arch.ffn_hidden_size), *whole)]


def test_sglang_packed_loader_cuts_in_proj_qkv_into_the_trainers_q_k_v(tiny_qwen3_5):
    """SGLang's packed loader for in_proj_qkv (shard ids (0, 1, 2)) cuts it by its in_proj_qkvz output sizes [key
    dim, key dim, value dim]: the q, k and v sections the trainer's Layout.GDN_IN_PROJ_SPLIT reads from it."""
    from slime_rl.trainer.convert import hf_to_mcore_shard, load_arch

    arch = load_arch(tiny_qwen3_5)
    pm = next(p for p in arch.param_maps() if p.mcore.endswith("layers.0.self_attention.in_proj.weight"))
    key_dim = arch.linear_num_key_heads * arch.linear_key_head_dim
    value_dim = arch.linear_num_value_heads * arch.linear_value_head_dim
    module = types.SimpleNamespace(output_sizes=[key_dim, key_dim, value_dim, value_dim])  # create_qkvz_proj's
    got: dict[int, torch.Tensor] = {}
    loader = qwen3_5.Qwen3_5GatedDeltaNet._make_packed_weight_loader(
        module, lambda param, chunk, idx: got.__setitem__(idx, chunk))
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(2 * key_dim + value_dim, arch.hidden_size, generator=gen)
    rest = [torch.randn(n, arch.hidden_size, generator=gen) for n in (value_dim, arch.linear_num_value_heads,
                                                                      arch.linear_num_value_heads)]
    loader(torch.nn.Parameter(torch.zeros(1)), qkv, (0, 1, 2))
    ours = hf_to_mcore_shard(pm, [qkv, *rest], arch, 0, 1)  # [q; k; v; z; b; a]
    q, k, v = torch.split(ours[:2 * key_dim + value_dim], [key_dim, key_dim, value_dim])
    assert sorted(got) == [0, 1, 2]
    assert torch.equal(got[0], q) and torch.equal(got[1], k) and torch.equal(got[2], v)
