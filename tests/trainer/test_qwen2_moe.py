"""Issue 22, qwen2_moe: routed experts plus a shared expert with a sigmoid gate, q/k/v biases, and
dense layers among the MoE ones (mlp_only_layers / decoder_sparse_step, for qwen3_moe too).

Expected values: which layers are sparse comes from transformers' own model built from the config
(the decoder layer's module class); log-probs and gradients from HF transformers in float64
(trainer_ref.hf_model); the parallel layouts are compared with one rank on the same batch, with
test_moe.py's tolerances (fp32 on CPU).
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.moe_scenarios import AUX_COEFF, MOE_LAYOUTS, MOE_RUN_LAYOUTS
from tests.trainer.test_moe import TOL, _assert_weights_out, _diffs, _per_expert
from tests.trainer.test_trainer_megatron import LOGP_TOL, _assert_grads_close, _max_diff
from tests.trainer.trainer_ref import hf_logprobs, hf_model, hf_policy_grad, make_batch
from tests.trainer.trainer_scenarios import scenario_runner

SPARSE = (0, 1, 3)  # the tiny Qwen2-MoE of tests/conftest.py: layer 2 is dense (mlp_only_layers=[2])

BASE = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 32,
        "intermediate_size": 24, "rope_theta": 1e4, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 8, "shared_expert_intermediate_size": 12, "hidden_act": "silu"}


@pytest.fixture(scope="session")
def tiny_qwen3_moe_mixed(tmp_path_factory):
    """A tiny Qwen3-MoE whose first layer is dense (mlp_only_layers=[0]), 3 layers."""
    from tests.conftest import _load_tool

    out = tmp_path_factory.mktemp("tiny_qwen3_moe_mixed")
    return _load_tool("make_tiny_model").make_tiny_model(out, arch="qwen3_moe", seed=7, num_layers=3,
                                                         mlp_only_layers=[0])


@pytest.fixture(scope="session")
def qwen2_moe_scenario(tiny_qwen2_moe, tiny_qwen3_moe_mixed, tmp_path_factory):
    return scenario_runner(tmp_path_factory.mktemp("qwen2_moe_scenarios"),
                           {"qwen2_moe": tiny_qwen2_moe, "qwen3_moe_mixed": tiny_qwen3_moe_mixed})


@pytest.fixture(scope="session")
def qwen2_moe_ref(tiny_qwen2_moe):
    model, batch = hf_model(tiny_qwen2_moe), make_batch()
    loss, grad = hf_policy_grad(model, batch)
    return {"logp": hf_logprobs(model, batch), "loss": loss, "grad": _per_expert(grad)}


def test_tiny_qwen2_moe_folder(tiny_qwen2_moe):
    """tools/make_tiny_model.py --arch qwen2_moe: the shared expert and its gate in every sparse layer,
    a dense MLP in layer 2, routing far from ties (2nd vs 3rd expert) and a gate that varies by token."""
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeMLP, Qwen2MoeSparseMoeBlock

    cfg = json.loads((tiny_qwen2_moe / "config.json").read_text())
    assert cfg["model_type"] == "qwen2_moe" and cfg["architectures"] == ["Qwen2MoeForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["mlp_only_layers"], cfg["norm_topk_prob"]) == (4, [2], False)
    assert (cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]) == (32, 48)
    names = set(load_file(tiny_qwen2_moe / "model.safetensors"))
    for i in SPARSE:
        assert {f"model.layers.{i}.mlp.shared_expert_gate.weight", f"model.layers.{i}.mlp.shared_expert.up_proj.weight",
                f"model.layers.{i}.mlp.experts.7.down_proj.weight", f"model.layers.{i}.mlp.gate.weight"} <= names
    assert not any(n.startswith("model.layers.2.mlp.") and ("expert" in n or ".gate." in n) for n in names)
    assert "model.layers.2.mlp.gate_proj.weight" in names and "model.layers.0.self_attn.q_proj.bias" in names
    model = hf_model(tiny_qwen2_moe)
    assert [type(layer.mlp) for layer in model.model.layers] == [
        Qwen2MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock, Qwen2MoeMLP, Qwen2MoeSparseMoeBlock]
    gaps, gates = [], []

    def router(module, args, out):
        top = torch.topk(torch.softmax(out[0].double(), -1), 3, dim=-1).values
        gaps.append(float((top[:, 1] - top[:, 2]).min()))

    def gate(module, args, out):
        gates.append(torch.sigmoid(out.double()).flatten())

    for i in SPARSE:
        model.model.layers[i].mlp.gate.register_forward_hook(router)
        model.model.layers[i].mlp.shared_expert_gate.register_forward_hook(gate)
    with torch.no_grad():
        for toks in make_batch()["tokens"]:
            model(torch.tensor([toks]))
    assert min(gaps) > 1e-5, min(gaps)
    g = torch.cat(gates)
    assert float(g.max() - g.min()) > 0.1  # a gate dropped or fixed at 1 would change the log-probs


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
@pytest.mark.parametrize("layers,step,dense", [(4, 1, [2]), (4, 2, []), (6, 2, [1, 3]), (3, 1, None), (5, 3, [0])])
def test_moe_layer_pattern_is_transformers(model_type, layers, step, dense):
    """ModelArch.moe_layers against the module transformers builds per layer from the same config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_rl.trainer.convert import arch_from_hf_config, hf_shapes

    cfg = {**BASE, "model_type": model_type, "num_hidden_layers": layers, "decoder_sparse_step": step,
           "mlp_only_layers": dense, "head_dim": 4}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    want = tuple(hasattr(layer.mlp, "experts") for layer in model.model.layers)
    arch = arch_from_hf_config(cfg)
    assert arch.moe_layers == want and any(want)
    assert all(want) == (step == 1 and not dense)
    # and the registry's tensors are those transformers saves (fused experts named one by one)
    shapes = hf_shapes(arch)
    for i, sparse in enumerate(want):
        assert (f"model.layers.{i}.mlp.gate.weight" in shapes) == sparse
        assert (f"model.layers.{i}.mlp.gate_proj.weight" in shapes) == (not sparse)
        assert (f"model.layers.{i}.mlp.shared_expert_gate.weight" in shapes) == (sparse and model_type == "qwen2_moe")
    state = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    for n, shape in shapes.items():
        if ".mlp.experts." in n:
            continue
        assert state[n] == shape, n
    fused = {n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert state.keys() - shapes.keys() == fused


@pytest.mark.parametrize("change,message", [
    ({"mlp_only_layers": [4]}, r"mlp_only_layers=\[4\]: \[4\] are not layer indices in \[0, num_hidden_layers=4\)"),
    ({"mlp_only_layers": [0, 1, 2, 3]}, "leave no MoE layer"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be an integer >= 1"),
    ({"shared_expert_intermediate_size": None}, "needs shared_expert_intermediate_size > 0"),
    ({"qkv_bias": False}, "qkv_bias=False is not supported for model_type 'qwen2_moe'"),
    ({"use_sliding_window": True}, "use_sliding_window"),
])
def test_qwen2_moe_configs_refused_naming_the_field(change, message):
    from slime_rl.trainer.convert import arch_from_hf_config

    cfg = {**BASE, "model_type": "qwen2_moe", "num_hidden_layers": 4, **change}
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(cfg, where="ckpt/config.json")


def test_registry_qwen2_moe_names_and_stages(tiny_qwen2_moe):
    """Every stored tensor and nothing else; the shared expert and its gate under megatron's
    SharedExpertMLP names; under PP=2 the second stage's local layer 0 is the dense layer 2."""
    from slime_rl.trainer.convert import Layout, hf_shapes, load_arch
    from slime_rl.trainer.hf_io import stage_param_maps

    arch = load_arch(tiny_qwen2_moe)
    assert (arch.num_experts, arch.moe_topk, arch.moe_norm_topk_prob, arch.moe_shared_expert_ffn_hidden_size) == (
        8, 2, False, 48)
    assert arch.moe_layers == (True, True, False, True)
    stored = {n: tuple(t.shape) for n, t in load_file(tiny_qwen2_moe / "model.safetensors").items()}
    assert hf_shapes(arch) == stored
    maps = {local: pm for local, pm, _ in stage_param_maps(arch, 1, 2, 1, 2)}  # PP rank 1, EP rank 1
    assert maps["decoder.layers.0.mlp.linear_fc1.weight"].hf == (
        "model.layers.2.mlp.gate_proj.weight", "model.layers.2.mlp.up_proj.weight")
    assert not any(n.startswith("decoder.layers.0.mlp.") and "expert" in n for n in maps)
    assert maps["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"].hf == (
        "model.layers.3.mlp.experts.4.down_proj.weight",)
    gate = maps["decoder.layers.1.mlp.shared_experts.gate_weight"]
    assert gate.hf == ("model.layers.3.mlp.shared_expert_gate.weight",) and gate.layout is Layout.REPLICATED
    fc1 = maps["decoder.layers.1.mlp.shared_experts.linear_fc1.weight"]
    assert fc1.hf == ("model.layers.3.mlp.shared_expert.gate_proj.weight",
                      "model.layers.3.mlp.shared_expert.up_proj.weight")
    assert fc1.layout is Layout.FC1 and not fc1.expert  # split over TP like a dense MLP, not over ETP


@pytest.mark.slow
def test_one_rank_qwen2_moe_equals_hf(qwen2_moe_scenario, qwen2_moe_ref):
    """Megatron's MoELayer with pre-softmax top-k (norm_topk_prob false), SharedExpertMLP with its
    sigmoid gate and a dense layer: HF's float64 log-probs and, without the aux loss, HF's gradient
    of every tensor (shared expert and gate included)."""
    (one,) = qwen2_moe_scenario("qwen2_moe1", 1)
    for layout in ("padded", "packed"):
        assert _max_diff(one[f"base/{layout}/logp"], qwen2_moe_ref["logp"]) < LOGP_TOL
    grad = one["noaux/base/packed/grad"]
    assert {"model.layers.3.mlp.shared_expert_gate.weight", "model.layers.2.mlp.down_proj.weight",
            "model.layers.0.mlp.shared_expert.gate_proj.weight"} <= set(grad)
    _assert_grads_close(grad, qwen2_moe_ref["grad"])
    assert float(grad["model.layers.0.mlp.shared_expert_gate.weight"].abs().max()) > 1e-6
    assert abs(one["noaux/base/packed/stats"]["loss"] - qwen2_moe_ref["loss"]) < 1e-6
    aux = one["base/packed/stats"]["moe/load_balancing_loss"]  # averaged over the 3 MoE layers
    assert 0.5 < aux < 8
    g = one["base/packed/grad"]["model.layers.0.mlp.gate.weight"]
    assert float((g - grad["model.layers.0.mlp.gate.weight"]).abs().max()) > 1e-3 * AUX_COEFF


EP_CASES = [(name, world, layout) for name, world in [("ep2", 2), ("ep2tp2", 4), ("ep2pp2", 4), ("ep2tp2etp1", 4)]
            for layout in MOE_RUN_LAYOUTS.get(name, ("padded", "packed"))]


@pytest.mark.slow
@pytest.mark.parametrize("name,world,layout", EP_CASES, ids=[f"{c[0]}-{c[2]}" for c in EP_CASES])
def test_qwen2_moe_expert_parallel_equals_one_rank(qwen2_moe_scenario, tiny_qwen2_moe, name, world, layout):
    """EP=2, EP=2 x TP=2 (the shared expert split over TP, its gate's grad summed over the sequence
    parallel ranks), EP=2 x PP=2 (the dense layer on the second stage) and EP=2 x TP=2 x ETP=1 (the
    shared expert split over TP, the routed experts whole) give one rank's log-probs, gradient, grad
    norm and aux loss; the weights out and --save-hf's folder are the checkpoint's tensors."""
    (one,) = qwen2_moe_scenario("qwen2_moe1", 1)
    ranks = qwen2_moe_scenario(f"qwen2_moe_{name}", world)
    tp, pp, ep = MOE_LAYOUTS[name]
    dp = world // (tp * pp)
    assert sorted({r[f"{name}/ranks"][:2] + (r[f"{name}/ranks"][3],) for r in ranks}) == sorted(
        itertools.product(range(tp), range(pp), range(dp)))
    diffs = _diffs(one, ranks, name, layout)
    print(f"qwen2_moe {name} {layout} fp32 max diffs: {diffs}")
    for key, tol in TOL.items():
        assert diffs[key] <= tol, f"{name} {layout}: max {key} diff {diffs[key]:.3g} > {tol}"
    _assert_weights_out(ranks, name, load_file(tiny_qwen2_moe / "model.safetensors"))


@pytest.mark.slow
def test_one_rank_qwen3_moe_with_a_dense_layer_equals_hf(qwen2_moe_scenario, tiny_qwen3_moe_mixed):
    """Qwen3-MoE with mlp_only_layers=[0] (megatron: moe_layer_freq [0, 1, 1]): HF's float64
    log-probs and gradient, the dense layer's MLP included."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeMLP

    model, batch = hf_model(tiny_qwen3_moe_mixed), make_batch()
    assert isinstance(model.model.layers[0].mlp, Qwen3MoeMLP)
    want_logp = hf_logprobs(model, batch)
    loss, grad = hf_policy_grad(model, batch)
    (one,) = qwen2_moe_scenario("qwen3_moe_mixed1", 1)
    for layout in ("padded", "packed"):
        assert _max_diff(one[f"base/{layout}/logp"], want_logp) < LOGP_TOL
    got = one["noaux/base/packed/grad"]
    assert "model.layers.0.mlp.gate_proj.weight" in got and "model.layers.1.mlp.experts.0.up_proj.weight" in got
    _assert_grads_close(got, _per_expert(grad))
    assert abs(one["noaux/base/packed/stats"]["loss"] - loss) < 1e-6
