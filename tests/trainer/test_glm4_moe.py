"""glm4_moe (GLM-4.5 / 4.6 / 4.7, GLM-4.5-Air): DeepSeek-style routing (sigmoid scores, the
e_score_correction_bias for the choice only, group-limited top-k, renormalised weights times
routed_scaling_factor), an ungated shared expert, dense first layers (first_k_dense_replace), q/k/v
biases, q/k norms where use_qk_norm, and half of each head rotated (partial_rotary_factor).

Expected values: the module classes and tensor names come from transformers' own Glm4Moe model built
from the config; log-probs and gradients from HF transformers in float64 (trainer_ref.hf_model); the
parallel layouts are compared with one rank on the same batch, with test_moe.py's tolerances.
"""

from __future__ import annotations

import json

import pytest
import torch
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

# a config as GLM-4.5's, small: what transformers builds from it is the reference
BASE = {"model_type": "glm4_moe", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 4, "vocab_size": 32, "intermediate_size": 24, "moe_intermediate_size": 8,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 2, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1, "num_hidden_layers": 3,
        "attention_bias": True, "use_qk_norm": True, "partial_rotary_factor": 0.5, "hidden_act": "silu",
        "rope_theta": 1e4}


@pytest.fixture(scope="session")
def glm4_scenario(tiny_glm4_moe, tmp_path_factory):
    return scenario_runner(tmp_path_factory.mktemp("glm4_moe_scenarios"), {"glm4_moe": tiny_glm4_moe})


@pytest.fixture(scope="session")
def glm4_ref(tiny_glm4_moe):
    model, batch = hf_model(tiny_glm4_moe), make_batch()
    loss, grad = hf_policy_grad(model, batch)
    return {"logp": hf_logprobs(model, batch), "loss": loss, "grad": _per_expert(grad)}


def _routing(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per MoE layer and test sequence: (sigmoid scores + bias in float64, the experts transformers chose)."""
    seen = []

    def hook(module, args, out):
        x = args[0].reshape(-1, module.hidden_dim).double()
        scores = torch.sigmoid(x @ module.weight.double().T) + module.e_score_correction_bias.double()
        seen.append((scores, out[2].sort(-1).values))

    handles = [layer.mlp.gate.register_forward_hook(hook) for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        for toks in make_batch()["tokens"]:
            model(torch.tensor([toks]))
    for h in handles:
        h.remove()
    return seen


def test_tiny_glm4_moe_folder(tiny_glm4_moe):
    """tools/make_tiny_model.py --arch glm4_moe: a dense layer 0, MoE layers with shared experts and
    the expert bias; routing far from ties at both levels (the chosen group's score vs the other's, the
    2nd vs the 3rd expert inside it), by the rule worked out here from the scores."""
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMLP, Glm4MoeMoE

    cfg = json.loads((tiny_glm4_moe / "config.json").read_text())
    assert cfg["architectures"] == ["Glm4MoeForCausalLM"]
    assert (cfg["first_k_dense_replace"], cfg["n_group"], cfg["topk_group"], cfg["use_qk_norm"]) == (1, 2, 1, True)
    names = set(load_file(tiny_glm4_moe / "model.safetensors"))
    for i in (1, 2, 3):
        layer = f"model.layers.{i}."
        assert {layer + "mlp.gate.e_score_correction_bias", layer + "mlp.shared_experts.up_proj.weight",
                layer + "mlp.experts.7.down_proj.weight", layer + "self_attn.q_norm.weight"} <= names
    assert "model.layers.0.mlp.gate_proj.weight" in names
    assert not any(n.startswith("model.layers.0.mlp.") and ("expert" in n or ".gate." in n) for n in names)
    model = hf_model(tiny_glm4_moe)
    assert [type(layer.mlp) for layer in model.model.layers] == [Glm4MoeMLP] + [Glm4MoeMoE] * 3
    group_gaps, expert_gaps = [], []
    for scores, chosen in _routing(model):
        groups = scores.view(-1, 2, 4)  # n_group 2 of 4 experts; a group's score: the sum of its top 2
        gscore = groups.topk(2, dim=-1).values.sum(-1)
        group_gaps.append(float((gscore[:, 0] - gscore[:, 1]).abs().min()))
        best = gscore.argmax(-1)
        inside = groups[torch.arange(len(best)), best]  # [tokens, 4]
        top = inside.topk(3, dim=-1)
        expert_gaps.append(float((top.values[:, 1] - top.values[:, 2]).min()))
        want = (top.indices[:, :2] + 4 * best[:, None]).sort(-1).values
        assert torch.equal(want, chosen)
    assert min(group_gaps) > 1e-5 and min(expert_gaps) > 1e-5, (group_gaps, expert_gaps)


def test_glm4_moe_bias_and_groups_change_routing(tiny_glm4_moe):
    """The tiny model's expert bias and its groups each change some routing decisions (so a trainer
    that ignored either would differ from HF): transformers' choices with the bias zeroed, and with
    one group, differ from its real choices on the test batch."""
    model = hf_model(tiny_glm4_moe)
    real = [c for _, c in _routing(model)]
    for layer in model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    unbiased = [c for _, c in _routing(model)]
    assert any(not torch.equal(a, b) for a, b in zip(real, unbiased, strict=True))
    model = hf_model(tiny_glm4_moe)
    for layer in model.model.layers[1:]:
        layer.mlp.gate.num_group, layer.mlp.gate.topk_group = 1, 1
    ungrouped = [c for _, c in _routing(model)]
    assert any(not torch.equal(a, b) for a, b in zip(real, ungrouped, strict=True))


@pytest.mark.parametrize("change", [{}, {"use_qk_norm": False}, {"n_group": 4, "topk_group": 1},
                                    {"first_k_dense_replace": 0}, {"first_k_dense_replace": 2},
                                    {"attention_bias": True, "n_shared_experts": 1}])
def test_glm4_moe_registry_is_transformers(change):
    """ModelArch and the registry's tensors against the model transformers builds from the same config:
    which layers are sparse, the q/k norms only where use_qk_norm, the shared experts' width, every
    tensor's name and shape (fused experts named one by one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_rl.trainer.convert import arch_from_hf_config

    cfg = {**BASE, **change}
    if cfg["n_group"] == 4:
        cfg["num_experts_per_tok"] = 2  # 2 / topk_group 1 = 2: the quotient both implementations agree on
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    arch = arch_from_hf_config(cfg)
    assert arch.moe_layers == tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    assert arch.qk_layernorm == cfg["use_qk_norm"] and arch.rotary_percent == 0.5
    assert arch.moe_shared_expert_ffn_hidden_size == cfg["n_shared_experts"] * cfg["moe_intermediate_size"]
    assert (arch.moe_score_function, arch.moe_scaling_factor) == ("sigmoid", 2.5)
    assert_registry_is_the_models(arch, model)


@pytest.mark.parametrize("change,message", [
    ({"norm_topk_prob": False}, "norm_topk_prob=False is not supported for model_type 'glm4_moe'"),
    ({"attention_bias": None}, r"attention_bias absent \(read as False\)"),
    ({"n_group": 4, "topk_group": 2, "num_experts_per_tok": 2}, "only configs where that is 2"),
    ({"n_group": 3}, "n_group=3 must divide n_routed_experts=8"),
    ({"topk_group": 2}, r"topk_group=2 must be in \[1, n_group=1\]"),
    ({"first_k_dense_replace": 3}, r"first_k_dense_replace=3 must be an integer in \[0, num_hidden_layers=3\)"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok=1 with a sigmoid router"),
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor=1.5 must be in \(0, 1\]"),
    ({"n_routed_experts": None}, r"needs \['n_routed_experts'\]"),
])
def test_glm4_moe_configs_refused_naming_the_field(change, message):
    from slime_rl.trainer.convert import arch_from_hf_config

    cfg = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(cfg, where="ckpt/config.json")


def test_registry_glm4_moe_names_and_stages(tiny_glm4_moe):
    """Every stored tensor and nothing else; the expert bias as the router's buffer; the shared experts
    under megatron's SharedExpertMLP names without a gate; under PP=2 x EP=2 the second stage's local
    layer 0 is layer 2 and EP rank 1's first expert is expert 4."""
    from slime_rl.trainer.convert import Layout, hf_shapes, load_arch
    from slime_rl.trainer.hf_io import stage_param_maps

    arch = load_arch(tiny_glm4_moe)
    assert arch.moe_layers == (False, True, True, True) and (arch.moe_num_groups, arch.moe_group_topk) == (2, 1)
    stored = {n: tuple(t.shape) for n, t in load_file(tiny_glm4_moe / "model.safetensors").items()}
    assert hf_shapes(arch) == stored
    maps = {local: pm for local, pm, _ in stage_param_maps(arch, 1, 2, 1, 2)}
    bias = maps["decoder.layers.0.mlp.router.expert_bias"]
    assert bias.hf == ("model.layers.2.mlp.gate.e_score_correction_bias",) and bias.buffer
    assert bias.layout is Layout.REPLICATED and not bias.expert
    assert maps["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"].hf == (
        "model.layers.3.mlp.experts.4.down_proj.weight",)
    fc1 = maps["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.3.mlp.shared_experts.gate_proj.weight",
                      "model.layers.3.mlp.shared_experts.up_proj.weight")
    assert not any("gate_weight" in n for n in maps)


@pytest.mark.slow
def test_one_rank_glm4_moe_equals_hf(glm4_scenario, glm4_ref, tiny_glm4_moe):
    """Megatron's sigmoid router with the checkpoint's expert bias and groups, the ungated shared expert,
    the dense first layer, q/k norms and partial RoPE: HF's float64 log-probs and, without the aux loss,
    HF's gradient of every tensor; the expert bias is not trained (no gradient, unchanged) and is sent
    to the engines as stored."""
    (one,) = glm4_scenario("glm4_moe1", 1)
    for layout in ("padded", "packed"):
        assert _max_diff(one[f"base/{layout}/logp"], glm4_ref["logp"]) < LOGP_TOL
    grad = one["noaux/base/packed/grad"]
    assert {"model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
            "model.layers.2.self_attn.q_norm.weight"} <= set(grad)
    assert not any("e_score_correction_bias" in n for n in grad)
    want = {n: g for n, g in glm4_ref["grad"].items() if "e_score_correction_bias" not in n}
    _assert_grads_close(grad, want)
    assert abs(one["noaux/base/packed/stats"]["loss"] - glm4_ref["loss"]) < 1e-6
    stored = load_file(tiny_glm4_moe / "model.safetensors")
    sources = one["base/sources"]
    for i in (1, 2, 3):
        name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        assert torch.equal(sources[name].float(), stored[name]), name


@pytest.mark.slow
def test_bf16_trainer_keeps_the_float32_expert_bias(glm4_scenario, tiny_glm4_moe):
    """In a bf16 model (Float16Module casts every buffer) the expert bias stays the checkpoint's float32
    values, as transformers keeps e_score_correction_bias and so routes the engine; weight sync sends them."""
    (rec,) = glm4_scenario("glm4_moe_bf16", 1)
    stored = load_file(tiny_glm4_moe / "model.safetensors")
    assert len(rec["held"]) == 3 and len(rec["sent"]) == 3
    for name, t in rec["held"].items():
        layer = name.split(".")[2]
        assert t.dtype == torch.float32
        assert torch.equal(t, stored[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]), name
    for name, t in rec["sent"].items():
        assert t.dtype == torch.float32 and torch.equal(t, stored[name]), name
    # the values are not bf16-representable: a bf16 round trip would have changed them
    assert any(not torch.equal(t.bfloat16().float(), t) for t in rec["held"].values())


EP_CASES = [(name, world, layout) for name, world in [("ep2", 2), ("ep2tp2", 4), ("ep2pp2", 4), ("cp2ep2", 4)]
            for layout in MOE_RUN_LAYOUTS.get(name, ("padded", "packed"))]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,layout", EP_CASES, ids=[f"{c[0]}-{c[2]}" for c in EP_CASES])
def test_glm4_moe_expert_parallel_equals_one_rank(glm4_scenario, tiny_glm4_moe, name, world, layout):
    """EP=2 (each rank's half of the experts, the expert bias whole on both), EP=2 x TP=2 (q/k norms and
    the shared experts under TP with sequence parallelism), EP=2 x PP=2 (the dense layer on the first
    stage) and CP=2 x EP=2 (partial RoPE on each rank's two chunks of the sequence) give one rank's
    log-probs, gradient, grad norm and aux loss; the weights out and --save-hf's folder are the
    checkpoint's tensors, the expert bias included."""
    (one,) = glm4_scenario("glm4_moe1", 1)
    ranks = glm4_scenario(f"glm4_moe_{name}", world)
    assert_layout_covered(ranks, name, world)
    diffs = _diffs(one, ranks, name, layout)
    print(f"glm4_moe {name} {layout} fp32 max diffs: {diffs}")
    for key, tol in TOL.items():
        assert diffs[key] <= tol, f"{name} {layout}: max {key} diff {diffs[key]:.3g} > {tol}"
    _assert_weights_out(ranks, name, load_file(tiny_glm4_moe / "model.safetensors"))
