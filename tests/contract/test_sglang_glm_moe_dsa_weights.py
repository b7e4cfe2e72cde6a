"""GLM-5 (glm_moe_dsa: DeepSeek Sparse Attention) weights as SGLang 0.5.23 loads them, with the names the trainer sends.

SGLang serves GlmMoeDsaForCausalLM with models/glm4_moe.py's class of that name, a DeepseekV2ForCausalLM: its attention
is DeepSeek's MLA (the loader of tests/contract/test_sglang_deepseek_v3_weights.py) and, in the layers that run their
own indexer (`dsa_layer_skips_topk`: indexer_types, else the schedule keys), an `Indexer` module (layers/attention/dsa/
dsa_indexer.py) whose parameters take HF's names: `self_attn.indexer.wq_b.weight`, `wk.weight`, `k_norm.weight` /
`k_norm.bias` (a LayerNorm) and `weights_proj.weight`. On CUDA it keeps wk and weights_proj as one bf16
`wk_weights_proj` (wk's rows on top, weights_proj's below), which `_load_fused_indexer_wk` fills from the two names
(each on its own, in any call); elsewhere (or with SGLANG_DISABLE_DSA_INDEXER_FUSION) they load as they are. The loader
drops indexer tensors of a layer that has no indexer without a word: the trainer sends none there (the registry has
no such entry), and the test checks that every name it sends lands once."""

from __future__ import annotations

import types

import pytest
import torch

from tests.contract.sglang_probe import calls_by_target, recording_probe

glm4_moe = pytest.importorskip("sglang.srt.models.glm4_moe",
                               reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")

INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def _sglang_param_names(arch, fused_wk: bool) -> list[str]:
    """SGLang 0.5.23's GLM-5 parameters at TP 1 (shared experts apart): MLA with its fused q_a / kv_a projection,
    the indexer where the layer runs one."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i, moe in enumerate(arch.moe_layers):
        p = f"model.layers.{i}."
        names += [p + "self_attn." + n for n in ("q_a_layernorm.weight", "q_b_proj.weight",
                                                 "fused_qkv_a_proj_with_mqa.weight", "kv_a_layernorm.weight",
                                                 "kv_b_proj.weight", "o_proj.weight")]
        if arch.has_indexer(i):
            kept = ("wq_b.weight", "k_norm.weight", "k_norm.bias") if fused_wk else INDEXER
            names += [p + "self_attn.indexer." + n for n in kept]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if moe:
            names += [p + "mlp.gate.weight", p + "mlp.gate.e_score_correction_bias", p + "mlp.experts.w13_weight",
                      p + "mlp.experts.w2_weight", p + "mlp.shared_experts.gate_up_proj.weight",
                      p + "mlp.shared_experts.down_proj.weight"]
        else:
            names += [p + "mlp.gate_up_proj.weight", p + "mlp.down_proj.weight"]
    return names


def _probe(arch, names):
    config = types.SimpleNamespace(n_routed_experts=arch.num_experts, num_hidden_layers=arch.num_layers,
                                   q_lora_rank=arch.q_lora_rank, num_nextn_predict_layers=0,
                                   architectures=["GlmMoeDsaForCausalLM"])
    probe = recording_probe(glm4_moe.GlmMoeDsaForCausalLM, config, names, arch.num_layers)
    probe.quant_config, probe.num_fused_shared_experts = None, 0
    probe.pp_group = types.SimpleNamespace(is_last_rank=True)
    probe.post_load_weights = lambda *a, **k: None  # the kv_b_proj absorption needs real weights
    return probe


def test_sglang_serves_glm_moe_dsa_with_its_deepseek_loader():
    from sglang.srt.models.deepseek_v2 import DeepseekV2ForCausalLM

    assert issubclass(glm4_moe.GlmMoeDsaForCausalLM, DeepseekV2ForCausalLM)
    assert "GlmMoeDsaForCausalLM" in [c.__name__ for c in glm4_moe.EntryClass]


def test_sglang_maps_every_glm_moe_dsa_name_we_send(tiny_glm_moe_dsa):
    """Without the fused wk_weights_proj (CPU, or SGLANG_DISABLE_DSA_INDEXER_FUSION): every tensor the trainer sends
    reaches exactly one parameter, the indexer's under their own names in layers 0-2 and none in layer 3."""
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(tiny_glm_moe_dsa)
    sent = hf_shapes(arch)  # every name weight sync sends, in its order
    assert not [n for n in sent if n.startswith("model.layers.3.self_attn.indexer.")]
    names = _sglang_param_names(arch, fused_wk=False)
    probe = _probe(arch, names)
    probe.load_weights([(name, torch.zeros(shape)) for name, shape in sent.items()])
    by_target = calls_by_target(probe)
    assert set(by_target) == set(names)
    heads, dim = arch.dsa_index_heads, arch.dsa_index_head_dim
    want = {"wq_b.weight": (heads * dim, arch.q_lora_rank), "wk.weight": (dim, arch.hidden_size),
            "k_norm.weight": (dim,), "k_norm.bias": (dim,), "weights_proj.weight": (heads, arch.hidden_size)}
    for i in range(3):
        for n, shape in want.items():
            assert [c[0] for c in by_target[f"model.layers.{i}.self_attn.indexer.{n}"]] == [shape]
    fused = sum(len(v) for k, v in by_target.items() if "fused_qkv_a_proj_with_mqa" in k)
    assert len(probe.calls) + fused == len(sent)


def test_sglang_fills_its_fused_indexer_projection_from_wk_and_weights_proj(tiny_glm_moe_dsa):
    """CUDA's bf16 wk_weights_proj: wk's rows on top, weights_proj's below, each from its own name (here in two
    separate load_weights calls, in the order the trainer sends them)."""
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(tiny_glm_moe_dsa)
    sent = hf_shapes(arch)
    names = _sglang_param_names(arch, fused_wk=True)
    probe = _probe(arch, names)
    heads, dim, h = arch.dsa_index_heads, arch.dsa_index_head_dim, arch.hidden_size
    fused = torch.nn.Parameter(torch.zeros(dim + heads, h, dtype=torch.bfloat16), requires_grad=False)
    probe.register_parameter("fused_wk", fused)
    probe._names["fused_wk"] = "model.layers.0.self_attn.indexer.wk_weights_proj.weight"
    wk, wp = torch.randn(dim, h).bfloat16(), torch.randn(heads, h).bfloat16()
    probe.load_weights([("model.layers.0.self_attn.indexer.wk.weight", wk)])
    probe.load_weights([("model.layers.0.self_attn.indexer.weights_proj.weight", wp)])
    assert torch.equal(fused.data, torch.cat([wk, wp]))
    assert probe.calls == []  # copied into the fused parameter, not through a weight_loader
    assert [n for n in sent if n.startswith("model.layers.0.self_attn.indexer.")] == [
        f"model.layers.0.self_attn.indexer.{n}" for n in INDEXER]
