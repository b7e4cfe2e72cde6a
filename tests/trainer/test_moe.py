"""Issue 22 (mixture of experts), first slice: the tiny Qwen3-MoE, its registry family, one rank
vs HF transformers, and expert parallelism vs one rank.

Expected values: HF transformers on the same folder in float64 with its experts run one by one
(trainer_ref.hf_model), written out independently of slime_rl.trainer; the layouts are compared
with one rank (TP = PP = EP = DP = 1) on the same batch. Tolerances, fp32 on CPU: log-probs 1e-5
absolute, gradient elements 1e-6 absolute (+1e-5 relative vs HF, as test_trainer_megatron.py),
grad norm 1e-5 relative, aux loss 1e-6 absolute.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.moe_scenarios import AUX_COEFF, MOE_CP, MOE_ETP, MOE_LAYOUTS, MOE_RUN_LAYOUTS
from tests.trainer.test_trainer_megatron import LOGP_TOL, _assert_grads_close, _max_diff
from tests.trainer.trainer_ref import hf_logprobs, hf_model, hf_policy_grad, make_batch

TOL = {"logp": 1e-5, "grad": 1e-6, "grad_norm_rel": 1e-5, "aux": 1e-6}


def _per_expert(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF's module holds each layer's experts fused (transformers 5: `mlp.experts.gate_up_proj`
    [E, 2I, H], gate rows first as its forward chunks them, and `mlp.experts.down_proj` [E, H, I]);
    the checkpoint and weight sync name them per expert, as the hub does."""
    out = {}
    for name, g in grads.items():
        head, fused, kind = name.rpartition(".mlp.experts.")[0], ".mlp.experts." in name, name.rsplit(".", 1)[-1]
        if not fused:
            out[name] = g
            continue
        for e in range(g.shape[0]):
            base = f"{head}.mlp.experts.{e}."
            if kind == "gate_up_proj":
                gate, up = g[e].chunk(2, dim=0)
                out[base + "gate_proj.weight"], out[base + "up_proj.weight"] = gate, up
            else:
                assert kind == "down_proj", name
                out[base + "down_proj.weight"] = g[e]
    return out


@pytest.fixture(scope="session")
def moe_ref(ckpts):
    model, batch = hf_model(ckpts["qwen3_moe"]), make_batch()
    loss, grad = hf_policy_grad(model, batch)
    return {"logp": hf_logprobs(model, batch), "loss": loss, "grad": _per_expert(grad)}


def test_tiny_qwen3_moe_folder(ckpts):
    """tools/make_tiny_model.py --arch qwen3_moe: 8 experts, top-2, 2 MoE layers; the HF names of
    every expert; routing far from ties (top-2 vs third expert) on the test batch."""
    folder = ckpts["qwen3_moe"]
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == 8 and cfg["num_experts_per_tok"] == 2
    assert cfg["norm_topk_prob"] is True and cfg["num_hidden_layers"] == 2
    names = set(load_file(folder / "model.safetensors"))
    for i, e, proj in itertools.product(range(2), range(8), ("gate", "up", "down")):
        assert f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight" in names
    model = hf_model(folder)
    gaps = []

    def hook(module, args, out):  # the router's logits: the gap between the 2nd and 3rd expert
        top = torch.topk(out[0].double(), 3, dim=-1).values
        gaps.append(float((top[:, 1] - top[:, 2]).min()))

    for layer in model.model.layers:
        layer.mlp.gate.register_forward_hook(hook)
    with torch.no_grad():
        for toks in make_batch()["tokens"]:
            model(torch.tensor([toks]))
    assert min(gaps) > 1e-4, min(gaps)


def test_registry_qwen3_moe_names_and_shapes(ckpts):
    from slime_rl.trainer.convert import hf_shapes, load_arch
    from slime_rl.trainer.hf_io import stage_param_maps

    arch = load_arch(ckpts["qwen3_moe"])
    assert (arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size, arch.moe_norm_topk_prob) == (8, 2, 32, True)
    stored = {n: tuple(t.shape) for n, t in load_file(ckpts["qwen3_moe"] / "model.safetensors").items()}
    assert hf_shapes(arch) == stored  # every stored tensor and nothing else
    # EP rank 1 of 2 holds experts 4..7 as its local 0..3
    maps = {local: pm for local, pm, _ in stage_param_maps(arch, 0, 1, 1, 2)}
    pm = maps["decoder.layers.1.mlp.experts.local_experts.0.linear_fc1.weight"]
    assert pm.hf == ("model.layers.1.mlp.experts.4.gate_proj.weight", "model.layers.1.mlp.experts.4.up_proj.weight")
    assert maps["decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight"].hf == (
        "model.layers.0.mlp.experts.7.down_proj.weight",)
    assert "decoder.layers.0.mlp.experts.local_experts.4.linear_fc1.weight" not in maps
    assert maps["decoder.layers.0.mlp.router.weight"].hf == ("model.layers.0.mlp.gate.weight",)
    with pytest.raises(ValueError, match="num_experts=8 is not divisible by --expert-model-parallel-size 3"):
        stage_param_maps(arch, 0, 1, 0, 3)


def test_registry_qwen3_moe_dense_layers_and_missing_fields():
    """Dense layers (mlp_only_layers, decoder_sparse_step) are megatron's moe_layer_freq pattern now
    (test_qwen2_moe.py compares it with transformers'); a missing MoE field is named."""
    from slime_rl.trainer.convert import arch_from_hf_config

    cfg = {"model_type": "qwen3_moe", "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "vocab_size": 64, "intermediate_size": 128, "rope_theta": 1e4,
           "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "hidden_act": "silu"}
    assert arch_from_hf_config({**cfg, "mlp_only_layers": None}).num_experts == 8  # hub configs: null
    assert arch_from_hf_config({**cfg, "mlp_only_layers": [1]}).moe_layers == (True, False)
    assert arch_from_hf_config({**cfg, "decoder_sparse_step": 2}).moe_layers == (False, True)
    with pytest.raises(ValueError, match="needs \\['moe_intermediate_size'\\]"):
        arch_from_hf_config({k: v for k, v in cfg.items() if k != "moe_intermediate_size"})


@pytest.mark.slow
def test_one_rank_moe_equals_hf(scenario, moe_ref):
    """Megatron's MoELayer (softmax router, top-k logits then softmax = HF's renormalised top-k
    probabilities) on the converted folder gives HF's log-probs and, without the aux loss, HF's
    policy-loss gradient for every tensor, experts and router included."""
    (one,) = scenario("moe1", 1)
    for layout in ("padded", "packed"):
        assert _max_diff(one[f"base/{layout}/logp"], moe_ref["logp"]) < LOGP_TOL
    grad = one["noaux/base/packed/grad"]
    assert any("mlp.experts.7.down_proj" in n for n in grad) and "model.layers.1.mlp.gate.weight" in grad
    _assert_grads_close(grad, moe_ref["grad"])
    assert abs(one["noaux/base/packed/stats"]["loss"] - moe_ref["loss"]) < 1e-6
    assert "moe/load_balancing_loss" not in one["noaux/base/packed/stats"]
    # with the aux loss on: it is reported, and its gradient reaches the routers
    aux = one["base/packed/stats"]["moe/load_balancing_loss"]
    assert 0.5 < aux < 8  # E * sum_e f_e P_e: 1 when balanced, at most E
    g = one["base/packed/grad"]["model.layers.0.mlp.gate.weight"]
    g0 = grad["model.layers.0.mlp.gate.weight"]
    assert float((g - g0).abs().max()) > 1e-3 * AUX_COEFF


def assert_layout_covered(ranks: list[dict], name: str, world: int) -> None:
    """The ranks of layout `name` hold every (TP, PP, DP, CP) coordinate once over and every EP rank."""
    tp, pp, ep = MOE_LAYOUTS[name]
    cp = MOE_CP.get(name, 1)
    dp = world // (tp * pp * cp)
    assert sorted({r[f"{name}/ranks"][:2] + (r[f"{name}/ranks"][3], r[f"{name}/cp_etp"][0]) for r in ranks}) == sorted(
        itertools.product(range(tp), range(pp), range(dp), range(cp)))
    assert sorted({r[f"{name}/ranks"][2] for r in ranks}) == list(range(ep))


def _diffs(base: dict, ranks: list[dict], name: str, layout: str) -> dict[str, float]:
    want, got = f"base/{layout}", f"{name}/{layout}"
    logp, grads = 0.0, {}
    for rec in ranks:
        for i, row in zip(rec[f"{name}/ids"], rec[f"{got}/logp"], strict=True):
            ref = base[f"{want}/logp"][i]
            assert len(row) == len(ref)
            logp = max(logp, *(abs(a - b) for a, b in zip(row, ref, strict=True)))
        grads.update(rec[f"{got}/grad"])
    assert set(grads) == set(base[f"{want}/grad"]), (name, layout)
    grad = max(float((grads[k] - g).abs().max()) for k, g in base[f"{want}/grad"].items())
    norm = base[f"{want}/grad_norm"]
    aux = base[f"{want}/stats"]["moe/load_balancing_loss"]
    return {"logp": logp, "grad": grad,
            "grad_norm_rel": max(abs(r[f"{got}/grad_norm"] - norm) / norm for r in ranks),
            "aux": max(abs(r[f"{got}/stats"]["moe/load_balancing_loss"] - aux) for r in ranks),
            "loss": max(abs(r[f"{got}/stats"]["loss"] - base[f"{want}/stats"]["loss"]) for r in ranks)}


EP_CASES = [(name, scen, world, layout)
            for name, scen, world in [("ep2", "moe_ep2", 2), ("ep2tp2", "moe_ep2tp2", 4), ("ep2pp2", "moe_ep2pp2", 4),
                                      ("cp2ep2", "moe_cp2ep2", 4),
                                      ("ep2tp2etp1", "moe_ep2tp2etp1", 4), ("ep2ag", "moe_ep2ag", 2),
                                      ("ep2tp2ag", "moe_ep2tp2ag", 4)]
            for layout in MOE_RUN_LAYOUTS.get(name, ("padded", "packed"))]


@pytest.mark.slow
@pytest.mark.parametrize("name,scen,world,layout", EP_CASES, ids=[f"{c[0]}-{c[3]}" for c in EP_CASES])
def test_expert_parallel_equals_one_rank(scenario, ckpts, name, scen, world, layout):
    """Issue 22's acceptance (CPU, fp32, gloo): EP=2 (DP=2), EP=2 x TP=2 (ETP=2, sequence parallel,
    packed), EP=2 x PP=2 (world 4), CP=2 x EP=2 (DP=2) and TP=2 x ETP=1 x EP=2 (experts whole
    on each TP rank, sequence parallel) and megatron's allgather token dispatcher
    (--moe-token-dispatcher-type allgather: EP=2 with DP=2, and TP=2 x EP=2 gathering over 4 ranks;
    trainer/equal_tokens.py pads the ranks' micro-batches to equal lengths) give one rank's
    log-probs, gradient, grad norm and aux loss;
    every rank's weights out, and the folder --save-hf writes, are the checkpoint's tensors under HF
    names (experts gathered over EP / ETP)."""
    (one,) = scenario("moe1", 1)
    ranks = scenario(scen, world)
    assert_layout_covered(ranks, name, world)
    assert {r[f"{name}/cp_etp"][1] for r in ranks} == {MOE_ETP.get(name, MOE_LAYOUTS[name][0])}
    diffs = _diffs(one, ranks, name, layout)
    print(f"{name} {layout} fp32 max diffs: {diffs}")
    for key, tol in TOL.items():
        assert diffs[key] <= tol, f"{name} {layout}: max {key} diff {diffs[key]:.3g} > {tol}"
    _assert_weights_out(ranks, name, load_file(ckpts["qwen3_moe"] / "model.safetensors"))


def _assert_weights_out(ranks: list[dict], name: str, want: dict) -> None:
    """Every rank's weights out (the same names on every rank of a pipeline stage; the stages
    together: the checkpoint's tensors, bit for bit) and --save-hf's folder (global rank 0 writes
    it) are the checkpoint `want`."""
    by_stage: dict[int, dict] = {}
    for rec in ranks:
        stage = rec[f"{name}/ranks"][1]
        assert [n for n, _, _ in rec[f"{name}/metadata"]] == list(rec[f"{name}/weights"])
        assert list(rec[f"{name}/sources"]) == list(rec[f"{name}/weights"])
        by_stage.setdefault(stage, rec[f"{name}/weights"])
        assert rec[f"{name}/weights"].keys() == by_stage[stage].keys()
    got = {k: v for stage in by_stage.values() for k, v in stage.items()}
    assert set(got) == set(want)
    for n, t in want.items():
        assert torch.equal(got[n], t), n
    (exported,) = [r[f"{name}/exported"] for r in ranks if f"{name}/exported" in r]
    assert set(exported) == set(want)
    for n, t in want.items():
        assert torch.equal(exported[n], t), n


@pytest.mark.slow
def test_deterministic_mode_switches_torch_and_keeps_the_numbers(scenario):
    """--deterministic-mode (Megatron-LM's, in slime's reproducibility script): every rank runs torch's
    deterministic algorithms with cuBLAS's fixed workspace, and EP=2 still gives one rank's log-probs and
    gradient (megatron's deterministic routing path builds the same routing map)."""
    (one,) = scenario("moe1", 1)
    ranks = scenario("moe_deterministic", 2)
    for rec in ranks:
        assert rec["switches"] == (True, True, ":4096:8")
    diffs = _diffs(one, ranks, "ep2", "packed")
    assert diffs["logp"] <= TOL["logp"] and diffs["grad"] <= TOL["grad"], diffs


@pytest.mark.slow
def test_grouped_gemm_equals_sequential_experts(scenario, ckpts):
    """--moe-grouped-gemm: the local experts as two torch._grouped_mm products give SequentialMLP's log-probs and
    gradient (fp32 on CPU, <= 1e-6) on one rank (8 local experts) and under EP=2 x TP=2 (4 local experts, each
    fc1 split over expert-TP, sequence parallel); the weights out are the checkpoint's, under the same names."""
    (one,) = scenario("moe1", 1)
    (grouped,) = scenario("moe_grouped1", 1)
    for layout in ("padded", "packed"):
        logp = max(abs(a - b) for g, w in zip(grouped[f"base/{layout}/logp"], one[f"base/{layout}/logp"], strict=True)
                   for a, b in zip(g, w, strict=True))
        assert logp <= 1e-6, (layout, logp)
        grads = grouped[f"base/{layout}/grad"]
        assert set(grads) == set(one[f"base/{layout}/grad"])
        diff = max(float((grads[n] - g).abs().max()) for n, g in one[f"base/{layout}/grad"].items())
        assert diff <= 1e-6, (layout, diff)
    ranks = scenario("moe_grouped_ep2tp2", 4)
    diffs = _diffs(one, ranks, "ep2tp2", "packed")
    for key, tol in TOL.items():
        assert diffs[key] <= tol, f"grouped ep2tp2: max {key} diff {diffs[key]:.3g} > {tol}"
    _assert_weights_out(ranks, "ep2tp2", load_file(ckpts["qwen3_moe"] / "model.safetensors"))


def assert_registry_is_the_models(arch, model) -> None:
    """The registry's tensors (hf_shapes of `arch`) are those of transformers' `model` built from the same config,
    name for name and shape for shape, its fused experts (gate_up_proj / down_proj) named one by one."""
    from slime_rl.trainer.convert import hf_shapes

    state = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    shapes = hf_shapes(arch)
    for n, shape in shapes.items():
        if ".mlp.experts." not in n:
            assert state[n] == shape, n
    fused = {n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert state.keys() - shapes.keys() == fused


@pytest.mark.slow
def test_grouped_gemm_equals_one_rank_under_pp_cp_and_etp(scenario, ckpts):
    """--moe-grouped-gemm under EP=2 x PP=2 (each stage's experts grouped), CP=2 x EP=2 and EP=2 x TP=2 x ETP=1
    (each expert whole on every TP rank) gives one rank's log-probs, gradient, grad norm and aux loss (SequentialMLP's
    one-rank records), and the checkpoint's weights out."""
    (one,) = scenario("moe1", 1)
    ranks = scenario("moe_grouped_layouts", 4)
    for name in ("ep2pp2", "cp2ep2", "ep2tp2etp1"):
        for layout in MOE_RUN_LAYOUTS.get(name, ("padded", "packed")):
            diffs = _diffs(one, ranks, name, layout)
            for key, tol in TOL.items():
                assert diffs[key] <= tol, f"grouped {name} {layout}: max {key} diff {diffs[key]:.3g} > {tol}"
        _assert_weights_out(ranks, name, load_file(ckpts["qwen3_moe"] / "model.safetensors"))
