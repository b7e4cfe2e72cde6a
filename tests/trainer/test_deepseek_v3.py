"""deepseek_v3 (DeepSeek-V3 / R1, Moonlight, Kimi-K2's architecture): multi-latent attention (megatron-core's
MLASelfAttention under the local spec) over GLM-4.5's MoE layout (tests/trainer/test_glm4_moe.py); and
glm4_moe_lite (GLM-4.7-Flash), the same model under GLM's own model_type and dense-layer field.

Expected values: the module classes and tensor names come from transformers' own DeepseekV3 model built from
the config; log-probs and gradients from HF transformers in float64 (trainer_ref.hf_model); the parallel
layouts are compared with one rank on the same batch, with test_moe.py's tolerances.
"""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file

from tests.trainer.moe_scenarios import MOE_RUN_LAYOUTS
from tests.trainer.test_moe import (
    TOL,
    _assert_weights_out,
    _diffs,
    _per_expert,
    assert_layout_covered,
    assert_registry_is_the_models,
)
from tests.trainer.test_trainer_megatron import LOGP_TOL, _assert_grads_close, _max_diff
from tests.trainer.trainer_ref import hf_logprobs, hf_model, hf_policy_grad, make_batch
from tests.trainer.trainer_scenarios import scenario_runner

# a config as Moonlight's / DeepSeek-V3's, small: what transformers builds from it is the reference
BASE = {"model_type": "deepseek_v3", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 4,
        "vocab_size": 32, "intermediate_size": 24, "moe_intermediate_size": 8, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "n_shared_experts": 2, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "num_hidden_layers": 3, "q_lora_rank": 12, "kv_lora_rank": 6,
        "qk_nope_head_dim": 4, "qk_rope_head_dim": 2, "v_head_dim": 3, "rope_theta": 1e4, "hidden_act": "silu"}


# DeepSeek-V3's YaRN (its rope_scaling, with a pretraining context of 4 tokens so that the test batch's positions
# reach past it): of the 2 rotary frequencies one is extrapolated and one interpolated (factor 40), and
# mscale_all_dim scales the softmax by mscale(40, 1)^2 = 1.87
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.fixture(scope="session")
def tiny_deepseek_v3_yarn(tiny_deepseek_v3, tmp_path_factory):
    import shutil

    out = tmp_path_factory.mktemp("tiny_deepseek_v3_yarn") / "ckpt"
    shutil.copytree(tiny_deepseek_v3, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["rope_parameters"] = YARN
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="session")
def dsv3_scenario(tiny_deepseek_v3, tiny_moonlight, tiny_deepseek_v3_yarn, tiny_glm4_moe_lite, tmp_path_factory):
    return scenario_runner(tmp_path_factory.mktemp("deepseek_v3_scenarios"),
                           {"deepseek_v3": tiny_deepseek_v3, "moonlight": tiny_moonlight,
                            "yarn": tiny_deepseek_v3_yarn, "glm4_moe_lite": tiny_glm4_moe_lite})


def _ref(folder):
    model, batch = hf_model(folder), make_batch()
    loss, grad = hf_policy_grad(model, batch)
    return {"logp": hf_logprobs(model, batch), "loss": loss, "grad": _per_expert(grad)}


def test_tiny_deepseek_v3_folders(tiny_deepseek_v3, tiny_moonlight):
    """tools/make_tiny_model.py --arch deepseek_v3: MLA's tensors (the query's low-rank pair, or one q_proj with
    --q-lora-rank 0), a dense layer 0, MoE layers with the expert bias and a shared expert."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MLP, DeepseekV3MoE

    for folder, q_lora in ((tiny_deepseek_v3, 24), (tiny_moonlight, None)):
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["architectures"] == ["DeepseekV3ForCausalLM"] and cfg["q_lora_rank"] == q_lora
        names = set(load_file(folder / "model.safetensors"))
        attn = {"kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight"}
        attn |= {"q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight"} if q_lora else {"q_proj.weight"}
        for i in range(4):
            assert {f"model.layers.{i}.self_attn.{n}" for n in attn} <= names
            assert not {n for n in names if n.startswith(f"model.layers.{i}.self_attn.")} - {
                f"model.layers.{i}.self_attn.{n}" for n in attn}
        assert "model.layers.3.mlp.gate.e_score_correction_bias" in names
        model = hf_model(folder)
        assert [type(layer.mlp) for layer in model.model.layers] == [DeepseekV3MLP] + [DeepseekV3MoE] * 3


@pytest.mark.parametrize("change", [{}, {"q_lora_rank": None}, {"n_group": 4, "topk_group": 1},
                                    {"first_k_dense_replace": 2}, {"v_head_dim": 5, "qk_rope_head_dim": 4}])
def test_deepseek_v3_registry_is_transformers(change):
    """ModelArch and the registry's tensors against the model transformers builds from the same config:
    every tensor's name and shape (fused experts named one by one), the MLA widths, the sparse layers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_rl.trainer.convert import arch_from_hf_config

    cfg = {**BASE, **change}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    arch = arch_from_hf_config(cfg)
    assert arch.moe_layers == tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert (arch.q_lora_rank, arch.kv_lora_rank, arch.v_head_dim) == (cfg["q_lora_rank"] or 0, 6, cfg["v_head_dim"])
    assert_registry_is_the_models(arch, model)


@pytest.mark.parametrize("change,message", [
    ({"num_key_value_heads": 2}, "num_key_value_heads=2 must equal num_attention_heads=4 for multi-latent attention"),
    ({"attention_bias": True}, "attention_bias=True is not supported for model_type 'deepseek_v3'"),
    ({"rope_interleave": False}, "rope_interleave=False is not supported"),
    ({"qk_rope_head_dim": 3}, "qk_rope_head_dim=3 must be even"),
    ({"kv_lora_rank": 0}, "kv_lora_rank=0 must be a positive integer"),
])
def test_deepseek_v3_configs_refused_naming_the_field(change, message):
    from slime_rl.trainer.convert import arch_from_hf_config

    with pytest.raises(ValueError, match=message):
        arch_from_hf_config({**BASE, **change}, where="ckpt/config.json")


LITE = {**BASE, "model_type": "glm4_moe_lite", "routed_scaling_factor": 1.8,
        "mlp_layer_types": ["dense", "sparse", "sparse"]}


@pytest.mark.parametrize("change", [{}, {"q_lora_rank": None},
                                    {"first_k_dense_replace": 2, "mlp_layer_types": ["dense", "dense", "sparse"]},
                                    {"first_k_dense_replace": 1, "mlp_layer_types": None}])
def test_glm4_moe_lite_registry_is_transformers(change):
    """GLM-4.7-Flash's family against transformers' Glm4MoeLiteForCausalLM built from the same config: every
    tensor's name and shape, and the sparse layers as transformers builds them (mlp_layer_types, or its default:
    the first layer dense)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_rl.trainer.convert import arch_from_hf_config

    cfg = {k: v for k, v in {**LITE, **change}.items() if v is not None or k == "q_lora_rank"}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    assert type(model).__name__ == "Glm4MoeLiteForCausalLM"
    arch = arch_from_hf_config(cfg)
    assert arch.moe_layers == tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert arch.family.model_type == "glm4_moe_lite" and arch.moe_scaling_factor == 1.8
    assert_registry_is_the_models(arch, model)


def test_glm4_moe_lite_dense_layers_named_twice_must_agree():
    """transformers builds GLM-4.7-Flash's dense layers from mlp_layer_types, SGLang from first_k_dense_replace:
    a file where they differ would train one model and serve another."""
    from slime_rl.trainer.convert import arch_from_hf_config

    with pytest.raises(ValueError, match=r"mlp_layer_types \['dense', 'sparse', 'sparse'\] \(what transformers "
                                         r"builds\) and first_k_dense_replace=2 \(what SGLang builds\)"):
        arch_from_hf_config({**LITE, "first_k_dense_replace": 2}, where="ckpt/config.json")
    with pytest.raises(ValueError, match="mlp_layer_types=.*must name 'dense' or 'sparse' for each of the 3 layers"):
        arch_from_hf_config({**LITE, "mlp_layer_types": ["dense", "sparse"]}, where="ckpt/config.json")
    # transformers' Glm4MoeLiteConfig maps head_dim onto qk_rope_head_dim: two values would be two models
    with pytest.raises(ValueError, match="head_dim=8 differs from qk_rope_head_dim=2"):
        arch_from_hf_config({**LITE, "head_dim": 8}, where="ckpt/config.json")


def test_mla_heads_must_split_over_tp():
    from slime_rl.trainer.convert import arch_from_hf_config

    with pytest.raises(ValueError, match="num_key_value_heads=4 is not divisible by --tensor-model-parallel-size 3"):
        arch_from_hf_config(BASE, tp_size=3, where="ckpt/config.json")


def test_yarn_changes_the_model(tiny_deepseek_v3, tiny_deepseek_v3_yarn):
    """The tiny YaRN config reads as transformers reads it, and its log-probs differ from default RoPE's by 20x
    the equality tolerance below at least (the tiny model's attention is nearly uniform, so the effect is small:
    8e-4 here), so that the equality checks YaRN, not the plain rotary path."""
    from slime_rl.trainer.convert import load_arch

    arch = load_arch(tiny_deepseek_v3_yarn)
    assert (arch.yarn_factor, arch.yarn_original_max_position_embeddings, arch.yarn_mscale,
            arch.yarn_mscale_all_dim) == (40.0, 4, 1.0, 1.0)
    batch = make_batch()
    plain, yarn = hf_logprobs(hf_model(tiny_deepseek_v3), batch), hf_logprobs(hf_model(tiny_deepseek_v3_yarn), batch)
    assert max(abs(a - b) for p, y in zip(plain, yarn, strict=True) for a, b in zip(p, y, strict=True)) > 20 * LOGP_TOL


@pytest.mark.parametrize("rope,message", [
    ({**YARN, "attention_factor": 1.2}, "attention_factor=1.2 is not supported for YaRN"),
    ({**YARN, "truncate": False}, "truncate=False is not supported"),
    ({**YARN, "original_max_position_embeddings": None}, "YaRN needs rope_parameters.original_max_position_embeddings"),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}, "rope_type 'linear' is not supported"),
])
def test_rope_scaling_refused_naming_the_field(rope, message):
    from slime_rl.trainer.convert import arch_from_hf_config

    with pytest.raises(ValueError, match=message):
        arch_from_hf_config({**BASE, "rope_parameters": rope}, where="ckpt/config.json")


def test_yarn_for_attention_other_than_mla_is_refused():
    from slime_rl.trainer.convert import arch_from_hf_config

    cfg = {"model_type": "qwen3", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 32, "rope_parameters": YARN}
    with pytest.raises(ValueError, match=r"rope_type 'yarn' is not supported \(only 'default' RoPE\)"):
        arch_from_hf_config(cfg, where="ckpt/config.json")


@pytest.mark.slow
@pytest.mark.parametrize("key", ["deepseek_v3", "moonlight", "yarn", "glm4_moe_lite"])
def test_one_rank_deepseek_v3_equals_hf(dsv3_scenario, tiny_deepseek_v3, tiny_moonlight, tiny_deepseek_v3_yarn,
                                        tiny_glm4_moe_lite, key):
    """Megatron's MLASelfAttention (the query's low-rank pair and its norm, or one q_proj; the key/value
    latent and its norm; interleaved RoPE on the rotary channels; value heads narrower than query heads)
    with the sigmoid-routed experts: HF's float64 log-probs and, without the aux loss, HF's gradient of
    every tensor. glm4_moe_lite: against transformers' Glm4MoeLiteForCausalLM."""
    folder = {"deepseek_v3": tiny_deepseek_v3, "moonlight": tiny_moonlight, "yarn": tiny_deepseek_v3_yarn,
              "glm4_moe_lite": tiny_glm4_moe_lite}[key]
    ref = _ref(folder)
    (one,) = dsv3_scenario(f"{key}1", 1)
    for layout in ("padded", "packed"):
        assert _max_diff(one[f"base/{layout}/logp"], ref["logp"]) < LOGP_TOL
    grad = one["noaux/base/packed/grad"]
    names = {"kv_a_proj_with_mqa", "kv_b_proj", "kv_a_layernorm"} | (
        {"q_a_proj", "q_b_proj", "q_a_layernorm"} if key != "moonlight" else {"q_proj"})
    assert {f"model.layers.1.self_attn.{n}.weight" for n in names} <= set(grad)
    _assert_grads_close(grad, {n: g for n, g in ref["grad"].items() if "e_score_correction_bias" not in n})
    assert abs(one["noaux/base/packed/stats"]["loss"] - ref["loss"]) < 1e-6


EP_CASES = [(key, name, world, layout)
            for key, name, world in [("deepseek_v3", "ep2", 2), ("deepseek_v3", "ep2tp2", 4),
                                     ("deepseek_v3", "ep2pp2", 4), ("deepseek_v3", "cp2ep2", 4),
                                     ("moonlight", "ep2tp2", 4), ("yarn", "cp2ep2", 4), ("yarn", "ep2tp2", 4)]
            for layout in MOE_RUN_LAYOUTS.get(name, ("padded", "packed"))]


@pytest.mark.slow
@pytest.mark.parametrize("key,name,world,layout", EP_CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in EP_CASES])
def test_deepseek_v3_parallel_equals_one_rank(dsv3_scenario, tiny_deepseek_v3, tiny_moonlight, tiny_deepseek_v3_yarn,
                                              key, name, world, layout):
    """EP=2, EP=2 x TP=2 (every MLA projection split over TP, the latents gathered; sequence parallel),
    EP=2 x PP=2 and CP=2 x EP=2 (the rotary channels on each rank's chunks) give one rank's log-probs,
    gradient, grad norm and aux loss; the weights out and --save-hf's folder are the checkpoint's tensors."""
    folder = {"deepseek_v3": tiny_deepseek_v3, "moonlight": tiny_moonlight, "yarn": tiny_deepseek_v3_yarn}[key]
    (one,) = dsv3_scenario(f"{key}1", 1)
    ranks = dsv3_scenario(f"{key}_{name}", world)
    assert_layout_covered(ranks, name, world)
    diffs = _diffs(one, ranks, name, layout)
    print(f"{key} {name} {layout} fp32 max diffs: {diffs}")
    grads = {n: g for r in ranks for n, g in r[f"{name}/{layout}/grad"].items()}
    worst = sorted(((float((grads[n] - g).abs().max()), n) for n, g in one[f"base/{layout}/grad"].items()),
                   reverse=True)[:4]
    print("largest gradient differences:", worst)
    for k, tol in TOL.items():
        assert diffs[k] <= tol, f"{key} {name} {layout}: max {k} diff {diffs[k]:.3g} > {tol}"
    _assert_weights_out(ranks, name, load_file(folder / "model.safetensors"))
