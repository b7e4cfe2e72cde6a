"""glm_moe_dsa (GLM-5 / GLM-5.1 / GLM-5.2): DeepSeek-V3's multi-latent attention and MoE layout with DeepSeek Sparse
Attention (a lightning indexer per layer, or shared across layers, chooses each query's index_topk keys;
trainer/dsa.py).

Expected values: module classes and tensor names from transformers' own GlmMoeDsa model built from the config (on
the meta device for GLM-5's and GLM-5.2's full sizes); log-probs and gradients from transformers in float64
(trainer_ref.hf_model), on rows longer than the tiny model's index_topk (4) so that the choice of keys matters; the
parallel layouts against one rank on the same batch, with test_moe.py's tolerances.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.test_moe import (
    TOL,
    _assert_weights_out,
    _diffs,
    _per_expert,
    assert_layout_covered,
    assert_registry_is_the_models,
)
from tests.trainer.test_trainer_megatron import LOGP_TOL, _assert_grads_close, _max_diff
from tests.trainer.trainer_ref import LENGTHS, hf_logprobs, hf_model, hf_policy_grad, make_batch
from tests.trainer.trainer_scenarios import scenario_runner

HF_CONFIGS = Path(__file__).parents[1] / "migration" / "hf_configs"
INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")

# small, as GLM-5.2's: what transformers builds from it is the reference
BASE = {"model_type": "glm_moe_dsa", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 32, "intermediate_size": 24, "moe_intermediate_size": 8, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "num_hidden_layers": 5,
        "q_lora_rank": 12, "kv_lora_rank": 6, "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 3,
        "index_topk": 4, "index_n_heads": 2, "index_head_dim": 6, "rope_theta": 1e4, "hidden_act": "silu",
        "indexer_rope_interleave": True}


@pytest.fixture(scope="module")
def dsa_scenario(tiny_glm_moe_dsa, tmp_path_factory):
    return scenario_runner(tmp_path_factory.mktemp("glm_moe_dsa_scenarios"), {"glm_moe_dsa": tiny_glm_moe_dsa})


def test_tiny_glm_moe_dsa_folder(tiny_glm_moe_dsa):
    """tools/make_tiny_model.py --arch glm_moe_dsa: MLA's tensors in every layer, the indexer's in layers 0-2 only
    (layer 3 shares layer 2's choice), a dense layer 0, and what config.json says of both."""
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaMLP, GlmMoeDsaMoE

    from slime_rl.trainer.convert import load_arch

    cfg = json.loads((tiny_glm_moe_dsa / "config.json").read_text())
    assert cfg["architectures"] == ["GlmMoeDsaForCausalLM"] and cfg["index_topk"] == 4
    assert cfg["indexer_types"] == ["full", "full", "full", "shared"] and cfg["indexer_rope_interleave"] is True
    names = set(load_file(tiny_glm_moe_dsa / "model.safetensors"))
    for i, full in enumerate((True, True, True, False)):
        assert ({f"model.layers.{i}.self_attn.indexer.{n}" for n in INDEXER} <= names) is full
        assert any(n.startswith(f"model.layers.{i}.self_attn.indexer.") for n in names) is full
    model = hf_model(tiny_glm_moe_dsa)
    assert [type(layer.mlp) for layer in model.model.layers] == [GlmMoeDsaMLP] + [GlmMoeDsaMoE] * 3
    arch = load_arch(tiny_glm_moe_dsa)
    assert (arch.dsa_index_topk, arch.dsa_index_heads, arch.dsa_index_head_dim) == (4, 8, 8)
    assert arch.dsa_indexer_layers == (True, True, True, False) and max(LENGTHS) > 2 * arch.dsa_index_topk


@pytest.mark.parametrize("change", [{}, {"index_topk_freq": 2, "index_skip_topk_offset": 3},
                                    {"indexer_types": ["full", "shared", "full", "shared", "shared"]},
                                    {"index_topk_freq": 3}, {"first_k_dense_replace": 2}])
def test_glm_moe_dsa_registry_is_transformers(change):
    """ModelArch and the registry's tensors against transformers' GlmMoeDsaForCausalLM built from the same config:
    every tensor's name and shape (the indexer's only in the layers transformers gives one), the sparse layers, and
    which layers run their own indexer (transformers' indexer_types, from the schedule keys where the file has no
    list)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_rl.trainer.convert import arch_from_hf_config

    cfg = {**BASE, **change}
    hf_cfg = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    arch = arch_from_hf_config(cfg)
    assert arch.dsa_indexer_layers == tuple(t == "full" for t in hf_cfg.indexer_types)
    assert arch.dsa_indexer_layers == tuple(layer.self_attn.indexer is not None for layer in model.model.layers)
    assert arch.moe_layers == tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert_registry_is_the_models(arch, model)


@pytest.mark.parametrize("name", ["GLM-5", "GLM-5.2-FP8"])
def test_glm5_registry_and_estimate_are_transformers(name):
    """GLM-5's and GLM-5.2's config.json (tests/migration/hf_configs): the registry's every tensor against
    transformers' model on the meta device, and the planner's parameter count (orchestration/estimate.py) against
    that model's and against the count by hand."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_rl.orchestration.estimate import model_shape
    from slime_rl.trainer.convert import arch_from_hf_config

    cfg = json.loads((HF_CONFIGS / name / "config.json").read_text())
    hf_cfg = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "quantization_config"})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    arch = arch_from_hf_config(cfg)
    assert arch.dsa_indexer_layers == tuple(layer.self_attn.indexer is not None for layer in model.model.layers)
    assert_registry_is_the_models(arch, model)
    counted = sum(p.numel() for p in model.parameters())
    assert model_shape(cfg).params == counted
    # by hand: 78 layers of MLA (q 6144 -> 2048 -> 64 x 256, kv 6144 -> 512 + 64 -> 64 x (192 + 256), o 64 x 256 ->
    # 6144, the latent norms 2048 and 512, the layer's two norms), 3 dense SwiGLU layers of 12288, 75 MoE layers of
    # 256 + 1 shared experts of 2048 and a 256-way router, the indexer (wq_b 2048 -> 32 x 128, wk 6144 -> 128, its
    # LayerNorm 2 x 128, weights_proj 6144 -> 32) in every layer (GLM-5) or in GLM-5.2's 21 full layers, the
    # embedding and the LM head of 154880, the final norm
    h, layers = 6144, 78
    mla = h * 2048 + 2048 + 2048 * 64 * 256 + h * (512 + 64) + 512 + 512 * 64 * (192 + 256) + 64 * 256 * h + 2 * h
    indexer = 2048 * 32 * 128 + h * 128 + 2 * 128 + h * 32
    full = sum(arch.dsa_indexer_layers)
    assert full == (78 if name == "GLM-5" else 21)
    by_hand = (layers * mla + full * indexer + 3 * 3 * h * 12288 + 75 * (257 * 3 * h * 2048 + 256 * h)
               + 2 * 154880 * h + h)
    assert counted == by_hand
    assert 740e9 < counted < 760e9  # 744B-A40B


@pytest.mark.parametrize("change,message", [
    ({"indexer_rope_interleave": None}, "indexer_rope_interleave absent .* not supported for model_type 'glm_moe_dsa'"),
    ({"indexer_rope_interleave": False}, "indexer_rope_interleave=False is not supported"),
    ({"q_lora_rank": None}, "q_lora_rank must be set for sparse attention"),
    ({"index_head_dim": 1}, "index_head_dim=1 is narrower than qk_rope_head_dim=2"),
    ({"index_topk": 0}, "index_topk=0 must be a positive integer"),
    ({"indexer_types": ["shared"] + ["full"] * 4}, "the first layer has no indexer before it"),
    ({"indexer_types": ["full"] * 4}, "must name 'full' or 'shared' for each of the 5 layers"),
    ({"mlp_layer_types": ["dense", "dense", "sparse", "sparse", "sparse"]},
     r"mlp_layer_types .* and first_k_dense_replace=1 \(what SGLang builds\)"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0,
                          "original_max_position_embeddings": 8}}, "only 'default' RoPE with sparse attention"),
])
def test_glm_moe_dsa_configs_refused_naming_the_field(change, message):
    from slime_rl.trainer.convert import arch_from_hf_config

    cfg = {k: v for k, v in {**BASE, **change}.items() if v is not None or k == "q_lora_rank"}
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(cfg, where="ckpt/config.json")


def test_pipeline_stages_start_on_an_indexer_layer():
    """A shared layer's top-k comes from an earlier layer of its own stage (as slime's GLM-5 provider requires), so a
    split whose stage starts on a shared layer is refused naming the flags."""
    from slime_rl.trainer.convert.arch import check_dsa_stages as check_stages

    check_stages((True, True, True, False), [0, 2])
    with pytest.raises(ValueError, match=r"stages start at layers \[0, 3\], and layer\(s\) \[3\] reuse .*"
                                         r"--decoder-first-pipeline-num-layers .* one of \[0, 1, 2\]"):
        check_stages((True, True, True, False), [0, 3])


@pytest.fixture(scope="module")
def hf_ref(tiny_glm_moe_dsa):
    """transformers' float64 model of the tiny checkpoint and its log-probs, loss and gradient on the test batch."""
    model, batch = hf_model(tiny_glm_moe_dsa), make_batch()
    loss, grad = hf_policy_grad(model, batch, drop_missing=True)  # the indexer: no gradient
    return {"model": model, "logp": hf_logprobs(model, batch), "loss": loss, "grad": _per_expert(grad)}


def test_sparsity_changes_the_model(hf_ref):
    """With index_topk 4 the tiny model's log-probs differ from those of dense attention (every indexer's index_topk
    past every row's length) by 20x the equality tolerance below at least: the equality checks the choice of keys."""
    indexers = [layer.self_attn.indexer for layer in hf_ref["model"].model.layers if layer.self_attn.indexer]
    assert len(indexers) == 3 and {ix.index_topk for ix in indexers} == {4}
    try:
        for ix in indexers:
            ix.index_topk = 64
        dense = hf_logprobs(hf_ref["model"], make_batch())
    finally:
        for ix in indexers:
            ix.index_topk = 4
    diff = max(abs(a - b) for p, y in zip(hf_ref["logp"], dense, strict=True) for a, b in zip(p, y, strict=True))
    assert diff > 20 * LOGP_TOL


def test_hadamard_rotation_leaves_the_indexer_scores(hf_ref):
    """SGLang's indexer rotates its queries and keys by a Hadamard transform scaled by 1 / sqrt(width) before its FP8
    cache (dsa_indexer.rotate_activation), transformers' and the trainer's do not: an orthonormal rotation of both
    leaves every product q . k, so the scores and the choice of keys are the same (here with Sylvester's matrix in
    torch, as fast_hadamard_transform computes it)."""
    d = 8
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 3, d, generator=g, dtype=torch.float64), torch.randn(7, d, generator=g, dtype=torch.float64)
    rot = h / d ** 0.5
    assert torch.allclose(rot @ rot.T, torch.eye(d, dtype=torch.float64))
    torch.testing.assert_close(torch.einsum("thd,sd->ths", q @ rot, k @ rot), torch.einsum("thd,sd->ths", q, k))


@pytest.mark.slow
def test_one_rank_glm_moe_dsa_equals_hf(dsa_scenario, hf_ref):
    """Sparse MLA (the indexer's choice of 4 keys per query, shared by layer 3) with the sigmoid-routed experts:
    transformers' float64 log-probs (padded and packed micro-batches) and, without the aux loss, its gradient of every
    tensor; the indexer gets none (transformers' runs under no_grad) and is frozen."""
    loss, ref_logp, ref_grad = hf_ref["loss"], hf_ref["logp"], hf_ref["grad"]
    assert not [n for n in ref_grad if ".indexer." in n]
    (one,) = dsa_scenario("glm_moe_dsa1", 1)
    for layout in ("padded", "packed"):
        assert _max_diff(one[f"base/{layout}/logp"], ref_logp) < LOGP_TOL
    got = one["noaux/base/packed/grad"]
    assert {f"model.layers.1.self_attn.{n}.weight" for n in ("q_a_proj", "q_b_proj", "kv_b_proj")} <= set(got)
    _assert_grads_close(got, {n: g for n, g in ref_grad.items() if "e_score_correction_bias" not in n})
    assert abs(one["noaux/base/packed/stats"]["loss"] - loss) < 1e-6
    # the indexer is sent (weights out) though never trained
    assert {f"model.layers.2.self_attn.indexer.{n}" for n in INDEXER} <= set(one["base/weights"])


@pytest.mark.slow
def test_glm_moe_dsa_tp2_pp2_ep2_cp2_equal_one_rank(dsa_scenario, tiny_glm_moe_dsa):
    """TP=2 (sequence parallel: the indexer's inputs gathered, each rank its heads of the same chosen keys), PP=2
    (layer 3 shares layer 2's choice on the second stage; also with every layer recomputed in the backward, where
    layer 3 finds the choice on the micro-batch's PackedSeqParams), EP=2 and CP=2 (each rank's queries choose among
    the whole sample's keys by global position), in one 2-rank launch: one rank's log-probs,
    gradient, grad norm and aux loss; the weights out and --save-hf's folder are the checkpoint's tensors, bit for
    bit."""
    (one,) = dsa_scenario("glm_moe_dsa1", 1)
    ranks = dsa_scenario("glm_moe_dsa_2ranks", 2)
    want = load_file(tiny_glm_moe_dsa / "model.safetensors")
    for name, layouts in (("tp2", ("packed",)), ("pp2", ("padded", "packed")), ("ep2", ("padded", "packed")),
                          ("cp2", ("padded", "packed")), ("pp2rc", ("packed",))):
        assert_layout_covered(ranks, name, 2)
        for layout in layouts:
            diffs = _diffs(one, ranks, name, layout)
            for k, tol in TOL.items():
                assert diffs[k] <= tol, f"{name} {layout}: max {k} diff {diffs[k]:.3g} > {tol}"
        _assert_weights_out(ranks, name, want)


def test_builtin_engine_refuses_sparse_attention_in_one_sentence():
    """transformers' GlmMoeDsa keeps its indexer's keys in a cache layer of their own, which the built-in engine's
    left-padded key/value batches do not hold: refused at engine start (preflight refuses it before, naming the
    flag: tests/config/test_model_args.py), naming the backend that serves it."""
    from slime_rl.engines.embedded.server import refuse_unserved_family

    with pytest.raises(ValueError, match=r"^model_type 'glm_moe_dsa': the built-in engine does not serve its sparse "
                                         r"attention, .*; use --rollout-backend sglang$"):
        refuse_unserved_family("glm_moe_dsa")
