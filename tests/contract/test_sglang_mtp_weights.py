"""Multi-token-prediction weights as SGLang 0.5.23 loads them, with the names the trainer sends (--mtp-num-layers).

SGLang's weight updates (/update_weights_from_distributed, _from_tensor, _from_disk) reach every runner of a
scheduler, the target model and the speculative draft model alike (managers/scheduler_components/weight_updater.py:
the request's `selector` defaults to "all"), each with the whole list of tensors. GLM-4.7-Flash's draft model
(models/glm4_moe_lite_nextn.py, Glm4MoeLiteForCausalLMNextN, EAGLE's NextN) loads through
Glm4MoeLiteForCausalLM.load_weights(is_nextn=True): of the names under model.layers.{num_hidden_layers}. it maps
enorm, hnorm, eh_proj and shared_head.norm onto model.enorm / hnorm / eh_proj / shared_head.norm and the rest onto
its decoder layer (model.decoder.*, an MoE layer: fused q_a/kv_a projections, experts as FusedMoE), skips that
layer's embed_tokens / shared_head.head (it shares the target's) and every name outside the layer; the target model
skips the names of layers >= num_hidden_layers. The test runs both loaders on what weight sync sends."""

from __future__ import annotations

import types

import pytest
import torch

from tests.contract.sglang_probe import calls_by_target, recording_probe

lite = pytest.importorskip("sglang.srt.models.glm4_moe_lite",
                          reason="sglang 0.5.23 is not importable here (pip install --no-deps sglang)")
nextn = pytest.importorskip("sglang.srt.models.glm4_moe_lite_nextn")

LAYER = ("self_attn.q_a_layernorm.weight", "self_attn.q_b_proj.weight", "self_attn.fused_qkv_a_proj_with_mqa.weight",
         "self_attn.kv_a_layernorm.weight", "self_attn.kv_b_proj.weight", "self_attn.o_proj.weight",
         "input_layernorm.weight", "post_attention_layernorm.weight")
MOE = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias", "mlp.experts.w13_weight", "mlp.experts.w2_weight",
       "mlp.shared_experts.gate_up_proj.weight", "mlp.shared_experts.down_proj.weight")
DENSE = ("mlp.gate_up_proj.weight", "mlp.down_proj.weight")


def _probe(cls, arch, names):
    config = types.SimpleNamespace(n_routed_experts=arch.num_experts, num_hidden_layers=arch.num_layers,
                                   q_lora_rank=arch.q_lora_rank or None, num_nextn_predict_layers=arch.mtp_layers)
    probe = recording_probe(cls, config, names, arch.num_layers)
    probe.quant_config, probe.num_fused_shared_experts = None, 0
    probe.pp_group = types.SimpleNamespace(is_last_rank=True)
    probe.post_load_weights = lambda *a, **k: None  # the kv_b_proj absorption needs real weights
    return probe


def test_sglang_draft_model_loads_the_mtp_layer_we_send(tiny_glm4_moe_lite_mtp):
    from slime_rl.trainer.convert import hf_shapes, load_arch, with_mtp

    arch = with_mtp(load_arch(tiny_glm4_moe_lite_mtp), 1)
    sent = hf_shapes(arch)  # every name weight sync sends, in its order
    mtp = f"model.layers.{arch.num_layers}."
    assert {n for n in sent if n.startswith(mtp)} and not any(
        n.startswith(mtp) and ("embed_tokens" in n or "shared_head.head" in n) for n in sent)
    tensors = [(name, torch.zeros(shape)) for name, shape in sent.items()]

    # the draft: its own four tensors and one MoE decoder layer, every MTP tensor loaded once, nothing else
    draft_names = [f"model.{n}" for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")]
    draft_names += [f"model.decoder.{n}" for n in (*LAYER, *MOE)] + ["model.embed_tokens.weight", "lm_head.weight"]
    draft = _probe(nextn.Glm4MoeLiteForCausalLMNextN, arch, draft_names)
    draft.load_weights(tensors)
    by_target = calls_by_target(draft)
    assert set(by_target) == set(draft_names) - {"model.embed_tokens.weight", "lm_head.weight"}
    h = arch.hidden_size
    assert [c[0] for c in by_target["model.eh_proj.weight"]] == [(h, 2 * h)]
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        assert [c[0] for c in by_target[f"model.{norm}.weight"]] == [(h,)]
    w13 = by_target["model.decoder.mlp.experts.w13_weight"]
    assert sorted((k["expert_id"], k["shard_id"]) for _, _, k in w13) == sorted(
        (e, s) for e in range(arch.num_experts) for s in ("w1", "w3"))
    fused = len(by_target["model.decoder.self_attn.fused_qkv_a_proj_with_mqa.weight"])  # two tensors, one load
    assert len(draft.calls) + fused == sum(1 for n in sent if n.startswith(mtp))

    # the target: every decoder tensor, none of the MTP layer's
    target_names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i, moe in enumerate(arch.moe_layers):
        target_names += [f"model.layers.{i}.{n}" for n in (*LAYER, *(MOE if moe else DENSE))]
    target = _probe(lite.Glm4MoeLiteForCausalLM, arch, target_names)
    target.load_weights(tensors)
    assert set(calls_by_target(target)) == set(target_names)
    fused = sum(1 for c in target.calls if "fused_qkv_a_proj_with_mqa" in c[0])
    assert len(target.calls) + fused == sum(1 for n in sent if not n.startswith(mtp))


def test_sglang_mimo_draft_loads_the_mtp_layer_we_send(tiny_mimo_mtp):
    """MiMo-7B (models/mimo_mtp.py MiMoMTP, the EAGLE draft; models/mimo.py MiMoForCausalLM, the target): the draft
    maps model.mtp_layers.{k}.token_layernorm / hidden_layernorm / input_proj / final_layernorm onto its own modules
    and the rest of the layer onto its Qwen2 decoder layer (model.mtp_block.*, q/k/v and gate/up stacked), and takes
    the decoder's embedding and lm_head too (shared with the target's); the target skips every mtp_layers name. The
    input_proj we send is MiMo's [hidden; embedding] order again (tests/trainer/test_mtp.py checks its values)."""
    mimo = pytest.importorskip("sglang.srt.models.mimo")
    mimo_mtp = pytest.importorskip("sglang.srt.models.mimo_mtp")
    from slime_rl.trainer.convert import hf_shapes, load_arch, with_mtp

    arch = with_mtp(load_arch(tiny_mimo_mtp), 1)
    sent = hf_shapes(arch)
    mtp = "model.mtp_layers.0."
    tensors = [(name, torch.zeros(shape)) for name, shape in sent.items()]
    config = types.SimpleNamespace(tie_word_embeddings=False, num_hidden_layers=arch.num_layers,
                                   num_nextn_predict_layers=1)
    layer = ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias", "self_attn.o_proj.weight",
             "mlp.gate_up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
             "post_attention_layernorm.weight")
    own = ("token_layernorm.weight", "hidden_layernorm.weight", "input_proj.weight", "final_layernorm.weight")
    draft_names = [f"model.{n}" for n in own] + [f"model.mtp_block.{n}" for n in layer] + [
        "model.embed_tokens.weight", "lm_head.weight"]
    draft = recording_probe(mimo_mtp.MiMoMTP, config, draft_names, arch.num_layers)
    draft.load_weights(tensors)
    by_target = calls_by_target(draft)
    assert set(by_target) == set(draft_names)
    h = arch.hidden_size
    assert [c[0] for c in by_target["model.input_proj.weight"]] == [(h, 2 * h)]
    assert sorted(c[1][0] for c in by_target["model.mtp_block.self_attn.qkv_proj.weight"]) == ["k", "q", "v"]
    assert len(draft.calls) == sum(1 for n in sent if n.startswith(mtp)) + 2  # + the embedding and lm_head

    target_names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{n}" for i in range(arch.num_layers) for n in layer]
    target = recording_probe(mimo.MiMoForCausalLM, config, target_names, arch.num_layers)
    target.load_weights(tensors)
    assert set(calls_by_target(target)) == set(target_names)
    assert not any(c[0].startswith("model.mtp") for c in target.calls)
