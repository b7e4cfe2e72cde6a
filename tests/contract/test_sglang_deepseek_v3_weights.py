"""DeepSeek-V3 (deepseek_v3: multi-latent attention) weights as SGLang 0.5.23 loads them, with the names the
trainer sends.

SGLang's DeepSeek loader (models/deepseek_common/deepseek_weight_loader.py, `DeepseekV2WeightLoaderMixin
.do_load_weights`) fuses a layer's q_a_proj and kv_a_proj_with_mqa into `fused_qkv_a_proj_with_mqa` when both
arrive within one load_weights call (q_lora_rank set; Moonlight's one q_proj and its kv_a_proj_with_mqa load as
they are), the dense MLPs' and shared experts' gate/up into `gate_up_proj`, the routed experts into FusedMoE's
w13/w2, and loads the latent norms, kv_b_proj (absorbed into w_kc / w_vc after loading: not run here), o_proj, the
router and its e_score_correction_bias as they are. Its loader skips a name it has no parameter for without a
word, and a q_a_proj whose kv_a_proj_with_mqa comes in another call stays cached and is never loaded: the test
checks that every name lands once, and that splitting the pair loses both (weight_sync/broadcast.py never does)."""

from __future__ import annotations

import types

import pytest
import torch

from tests.contract.sglang_probe import calls_by_target, recording_probe

deepseek_v2 = pytest.importorskip("sglang.srt.models.deepseek_v2",
                                  reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")


def _sglang_param_names(sparse: tuple[bool, ...], q_lora: bool) -> list[str]:
    """SGLang 0.5.23's DeepSeek-V3 parameters at TP 1 (shared experts apart)."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i, moe in enumerate(sparse):
        p = f"model.layers.{i}."
        attn = ["q_a_layernorm.weight", "q_b_proj.weight", "fused_qkv_a_proj_with_mqa.weight"] if q_lora else [
            "q_proj.weight", "kv_a_proj_with_mqa.weight"]
        names += [p + "self_attn." + n for n in (*attn, "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight")]
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
                                   q_lora_rank=arch.q_lora_rank or None, num_nextn_predict_layers=0)
    if arch.family.model_type == "glm4_moe_lite":  # GLM-4.7-Flash: SGLang's own class (models/glm4_moe_lite.py)
        from sglang.srt.models.glm4_moe_lite import Glm4MoeLiteForCausalLM as cls
    else:
        cls = deepseek_v2.DeepseekV3ForCausalLM
    probe = recording_probe(cls, config, names, arch.num_layers)
    probe.quant_config, probe.num_fused_shared_experts = None, 0
    probe.pp_group = types.SimpleNamespace(is_last_rank=True)
    probe.post_load_weights = lambda *a, **k: None  # the kv_b_proj absorption needs real weights
    return probe


@pytest.mark.parametrize("folder", ["tiny_deepseek_v3", "tiny_moonlight", "tiny_glm4_moe_lite"])
def test_sglang_maps_every_deepseek_v3_name_we_send(folder, request):
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(request.getfixturevalue(folder))
    sent = hf_shapes(arch)  # every name weight sync sends, in its order
    names = _sglang_param_names(arch.moe_layers, bool(arch.q_lora_rank))
    probe = _probe(arch, names)
    probe.load_weights([(name, torch.zeros(shape)) for name, shape in sent.items()])
    by_target = calls_by_target(probe)
    assert set(by_target) == set(names)
    h, heads, n_q = arch.hidden_size, arch.num_attention_heads, arch.qk_nope_head_dim + arch.qk_rope_head_dim
    for i, moe in enumerate(arch.moe_layers):
        a = f"model.layers.{i}.self_attn."
        if arch.q_lora_rank:  # q_a_proj and kv_a_proj_with_mqa fused into one load: the rows of both
            assert [c[0] for c in by_target[a + "fused_qkv_a_proj_with_mqa.weight"]] == [
                (arch.q_lora_rank + arch.kv_lora_rank + arch.qk_rope_head_dim, h)]
            assert [c[0] for c in by_target[a + "q_b_proj.weight"]] == [(heads * n_q, arch.q_lora_rank)]
        else:
            assert [c[0] for c in by_target[a + "q_proj.weight"]] == [(heads * n_q, h)]
        assert [c[0] for c in by_target[a + "kv_b_proj.weight"]] == [
            (heads * (arch.qk_nope_head_dim + arch.v_head_dim), arch.kv_lora_rank)]
        assert [c[0] for c in by_target[a + "o_proj.weight"]] == [(h, heads * arch.v_head_dim)]
        if moe:
            w13 = by_target[f"model.layers.{i}.mlp.experts.w13_weight"]
            assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w13) == sorted(
                (e, s) for e in range(arch.num_experts) for s in ("w1", "w3"))
    # every tensor sent reached exactly one load (the fused pair counts once for its two tensors)
    fused = sum(len(v) for k, v in by_target.items() if "fused_qkv_a_proj_with_mqa" in k)
    assert len(probe.calls) + fused == len(sent)


def test_q_a_proj_and_kv_a_proj_in_separate_calls_are_lost(tiny_deepseek_v3):
    """Why weight sync keeps the pair in one bucket: sent in two load_weights calls, neither loads."""
    from slime_rl.trainer.convert import hf_shapes, load_arch

    arch = load_arch(tiny_deepseek_v3)
    sent = hf_shapes(arch)
    probe = _probe(arch, _sglang_param_names(arch.moe_layers, True))
    q_a = "model.layers.0.self_attn.q_a_proj.weight"
    kv_a = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    probe.load_weights([(q_a, torch.zeros(sent[q_a]))])
    probe.load_weights([(kv_a, torch.zeros(sent[kv_a]))])
    assert probe.calls == []
    probe.load_weights([(q_a, torch.zeros(sent[q_a])), (kv_a, torch.zeros(sent[kv_a]))])
    assert [c[0] for c in probe.calls] == ["model.layers.0.self_attn.fused_qkv_a_proj_with_mqa.weight"]
