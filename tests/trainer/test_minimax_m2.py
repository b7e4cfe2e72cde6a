"""minimax_m2 (MiniMax-M2 / M2.1 / M2.5): GQA without biases, q/k RMSNorms over all heads' channels together
(trainer/whole_qk_norm.py), the first rotary_dim channels of each head rotated, every layer routed experts chosen by
sigmoid + e_score_correction_bias with the chosen scores renormalised, the checkpoint's block_sparse_moe names.

Expected values: tensor names and shapes from what transformers' own MiniMaxM2 model writes (save_pretrained); the
config's defaults from transformers' MiniMaxM2Config; log-probs, the loss and every gradient from HF transformers in
float64 (trainer_ref.hf_model) on the tiny checkpoint, with test_trainer_megatron.py's tolerances, for DP=2, TP=2
with sequence parallelism and EP=2; the weights weight sync sends and --save-hf's folder against the checkpoint's
tensors, bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.minimax_m2_scenarios import MINIMAX_LAYOUTS, MINIMAX_RUN_LAYOUTS
from tests.trainer.test_trainer_megatron import LOGP_TOL, _assert_grads_close, _max_diff
from tests.trainer.trainer_ref import hf_logprobs, hf_model, hf_policy_grad, make_batch
from tests.trainer.trainer_scenarios import scenario_runner

# a config as MiniMax-M2.5's, small: what transformers builds from it is the reference
BASE = {"model_type": "minimax_m2", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "rotary_dim": 4, "vocab_size": 48, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-6, "rope_theta": 5e6,
        "use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid", "use_routing_bias": True,
        "tie_word_embeddings": False, "hidden_act": "silu", "shared_intermediate_size": 0}


def hub_names(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' module names (mlp.gate, the fused mlp.experts.gate_up_proj [E, 2I, H] with each expert's gate
    rows first, mlp.experts.down_proj [E, H, I]) -> the checkpoint's (block_sparse_moe.gate, experts.{e}.w1 gate,
    w3 up, w2 down)."""
    out = {}
    for name, g in grads.items():
        if ".mlp.experts." in name:
            head, kind = name.split(".mlp.experts.")
            for e in range(g.shape[0]):
                base = f"{head}.block_sparse_moe.experts.{e}."
                if kind == "gate_up_proj":
                    out[base + "w1.weight"], out[base + "w3.weight"] = g[e].chunk(2)
                else:
                    out[base + "w2.weight"] = g[e]
        else:
            out[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = g
    return out


@pytest.fixture(scope="session")
def minimax_scenario(tiny_minimax_m2, tmp_path_factory):
    return scenario_runner(tmp_path_factory.mktemp("minimax_m2_scenarios"), {"minimax_m2": tiny_minimax_m2})


def test_tiny_minimax_m2_folder(tiny_minimax_m2):
    """tools/make_tiny_model.py --arch minimax_m2: transformers' MiniMaxM2 classes, the keys SGLang reads, the
    whole-width q/k norms and the block_sparse_moe names on disk, a bias that is not zero."""
    cfg = json.loads((tiny_minimax_m2 / "config.json").read_text())
    assert cfg["architectures"] == ["MiniMaxM2ForCausalLM"] and cfg["model_type"] == "minimax_m2"
    assert (cfg["use_qk_norm"], cfg["qk_norm_type"], cfg["scoring_func"], cfg["use_routing_bias"]) == (
        True, "per_layer", "sigmoid", True)
    assert (cfg["head_dim"], cfg["rotary_dim"], cfg["rope_parameters"]["partial_rotary_factor"]) == (16, 8, 0.5)
    stored = load_file(tiny_minimax_m2 / "model.safetensors")
    p = "model.layers.1."
    assert tuple(stored[p + "self_attn.q_norm.weight"].shape) == (64,)
    assert tuple(stored[p + "self_attn.k_norm.weight"].shape) == (32,)
    assert tuple(stored[p + "block_sparse_moe.experts.7.w3.weight"].shape) == (cfg["intermediate_size"], 64)
    assert float(stored[p + "block_sparse_moe.e_score_correction_bias"].abs().max()) > 0.01
    assert not any(".mlp." in n for n in stored)


def _transformers_tensors(cfg: dict, tmp_path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg)).save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        return {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}


@pytest.mark.parametrize("change", [{}, {"num_key_value_heads": 4, "rotary_dim": 8}, {"num_local_experts": 6},
                                    {"num_local_experts": None, "num_experts": 6}])
def test_minimax_m2_registry_is_transformers(change, tmp_path):
    """ModelArch and the registry's tensors against what transformers' MiniMaxM2 model of the same config writes:
    every tensor's name and shape (q_norm [heads x head_dim], k_norm [kv heads x head_dim], the router's bias, each
    expert's w1/w3/w2) and nothing else."""
    from slime_rl.trainer.convert import arch_from_hf_config, hf_shapes

    cfg = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    arch = arch_from_hf_config(cfg)
    assert (arch.qk_norm_whole, arch.qkv_bias, arch.moe_score_function, arch.moe_expert_bias) == (
        True, False, "sigmoid", True)
    assert (arch.moe_norm_topk_prob, arch.moe_scaling_factor, arch.moe_shared_expert_ffn_hidden_size) == (True, 1.0, 0)
    assert arch.rotary_percent == cfg["rotary_dim"] / cfg["head_dim"]
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))  # transformers reads either
    assert (arch.num_experts, arch.moe_ffn_hidden_size) == (experts, cfg["intermediate_size"])
    assert hf_shapes(arch) == _transformers_tensors(cfg, tmp_path)


def test_minimax_m2_config_defaults_are_transformers():
    """A config.json that leaves out head_dim, num_key_value_heads, rms_norm_eps, max_position_embeddings and the
    expert counts: the arch takes what transformers' MiniMaxM2Config takes for them."""
    from transformers import AutoConfig

    from slime_rl.trainer.convert import arch_from_hf_config

    left_out = ("head_dim", "num_key_value_heads", "rms_norm_eps", "num_local_experts", "num_experts_per_tok",
                "rotary_dim")
    cfg = {k: v for k, v in {**BASE, "hidden_size": 256, "num_attention_heads": 8, "rotary_dim": 64}.items()
           if k not in left_out}
    hf = AutoConfig.for_model(**cfg)
    arch = arch_from_hf_config(cfg)
    assert arch.kv_channels == hf.head_dim == 128 and arch.num_query_groups == hf.num_key_value_heads == 8
    assert arch.norm_eps == hf.rms_norm_eps and arch.max_position_embeddings == hf.max_position_embeddings
    assert (arch.num_experts, arch.moe_topk) == (hf.num_local_experts, hf.num_experts_per_tok) == (256, 8)
    assert arch.rotary_percent == hf.rope_parameters.get("partial_rotary_factor", 1.0) == 1.0


@pytest.mark.parametrize("change,message", [
    ({"use_qk_norm": False}, "use_qk_norm=False is not supported for model_type 'minimax_m2'"),
    ({"use_qk_norm": None}, r"use_qk_norm absent \(read as False\)"),
    ({"qk_norm_type": "per_head"}, "qk_norm_type='per_head' is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax' is not supported"),
    ({"use_routing_bias": False}, "use_routing_bias=False is not supported"),
    ({"rotary_dim": 5}, r"rotary_dim=5 must be an even integer in \(0, head_dim=8\]"),
    ({"partial_rotary_factor": 0.25}, r"partial_rotary_factor=0.25 \(what transformers rotates\) differs from "
                                      r"rotary_dim / head_dim = 4 / 8"),
    ({"rotary_dim": None, "partial_rotary_factor": 0.5}, r"no rotary_dim \(SGLang rotates the whole head\)"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok=1 with a sigmoid router"),
    ({"shared_intermediate_size": 64}, "shared_intermediate_size=64: MiniMax-M2 has no shared expert"),
])
def test_minimax_m2_configs_refused_naming_the_field(change, message):
    from slime_rl.trainer.convert import arch_from_hf_config

    cfg = {k: v for k, v in {**BASE, **change}.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        arch_from_hf_config(cfg, where="ckpt/config.json")


def test_hf_logprobs_see_the_whole_width_norms_and_the_bias(tiny_minimax_m2):
    """The tiny model's log-probs move by far more than LOGP_TOL with per-head q/k norms (each head normalized alone,
    the same weights) or without the router's bias: a trainer that did either would fail the comparisons below."""
    batch = make_batch()
    base = hf_logprobs(hf_model(tiny_minimax_m2), batch)

    class PerHead(torch.nn.Module):
        def __init__(self, norm: torch.nn.Module, head_dim: int) -> None:
            super().__init__()
            self.norm, self.head_dim = norm, head_dim

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x.unflatten(-1, (-1, self.head_dim))
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.norm.variance_epsilon)
            return h.flatten(-2) * self.norm.weight

    model = hf_model(tiny_minimax_m2)
    for layer in model.model.layers:
        layer.self_attn.q_norm = PerHead(layer.self_attn.q_norm, 16)
        layer.self_attn.k_norm = PerHead(layer.self_attn.k_norm, 16)
    assert _max_diff([x.tolist() for x in hf_logprobs(model, batch)], base) > 100 * LOGP_TOL
    model = hf_model(tiny_minimax_m2)
    for layer in model.model.layers:
        layer.mlp.e_score_correction_bias.zero_()
    assert _max_diff([x.tolist() for x in hf_logprobs(model, batch)], base) > 100 * LOGP_TOL


@pytest.mark.slow
def test_minimax_m2_trainer_equals_hf_at_dp2_tp2_pp2_ep2(minimax_scenario, tiny_minimax_m2):
    """One launch of two ranks: DP=2 (padded and packed), TP=2 with sequence parallelism (the q/k norms gather the
    ranks' heads; experts split over ETP), PP=2 (one layer per stage) and EP=2 give HF's float64 log-probs, loss and
    gradient of every tensor (the whole-width q/k norms' weights whole on each rank, not summed over TP); the
    attention is WholeQKNormSelfAttention with megatron's per-head norms off, the router sigmoid with the expert
    bias and no scaling, 8 of 16 channels rotated; every rank's weights out, weight sync's sources and --save-hf's
    folder are the checkpoint's tensors, and under TP=2 the checkpoint of a stepped model (megatron's torch_dist)
    restores q/k norms spoilt after the save."""
    ranks = minimax_scenario("minimax_m2", 2)
    model, batch = hf_model(tiny_minimax_m2), make_batch()
    want_logp = hf_logprobs(model, batch)
    want_loss, want_grad = hf_policy_grad(model, batch)
    want_grad = hub_names(want_grad)
    stored = load_file(tiny_minimax_m2 / "model.safetensors")
    for name, layouts in MINIMAX_RUN_LAYOUTS.items():
        tp, pp, ep = MINIMAX_LAYOUTS[name]
        assert sorted(r[f"{name}/ranks"][:3] for r in ranks) == sorted(
            (t, p, e) for t in range(tp) for p in range(pp) for e in range(ep)) or tp * pp * ep == 1
        for r in ranks:
            assert r[f"{name}/attention"] == ["WholeQKNormSelfAttention"]
            assert r[f"{name}/qk_norms"] == [((64,), (32,), False, "NoneType")]
            assert r[f"{name}/config"] == (name == "tp2sp", False, "sigmoid", True, 1.0, 8)
        for layout in layouts:
            last = [r for r in ranks if r[f"{name}/ranks"][1] == MINIMAX_LAYOUTS[name][1] - 1]  # the logits' stage
            logp = {i: row for r in last for i, row in zip(r[f"{name}/ids"], r[f"{name}/{layout}/logp"], strict=True)}
            assert sorted(logp) == [0, 1, 2, 3]
            assert _max_diff([logp[i] for i in range(4)], want_logp) < LOGP_TOL, (name, layout)
            grad = {k: v for r in ranks for k, v in r[f"{name}/{layout}/grad"].items()}
            _assert_grads_close(grad, want_grad)
            for r in ranks:
                assert abs(r[f"{name}/{layout}/stats"]["loss"] - want_loss) < 1e-6
        if name == "tp2sp":  # the checkpoint of the stepped model brings back the q/k norms spoilt after the save
            for r in ranks:
                assert r[f"{name}/resumed_extra"]["rollout_id"] == 1
                stepped = r[f"{name}/stepped"]
                for norm in ("q_norm", "k_norm"):
                    key = f"model.layers.1.self_attn.{norm}.weight"
                    assert not torch.equal(stepped[key], stored[key])  # the step moved them
                    assert not torch.equal(r[f"{name}/spoilt"][key], stepped[key])
                assert set(r[f"{name}/resumed"]) == set(stepped)
                for n, t in stepped.items():
                    assert torch.equal(r[f"{name}/resumed"][n], t), n
        (exported,) = [r[f"{name}/exported"] for r in ranks if f"{name}/exported" in r]
        for r in ranks:
            assert [n for n, _, _ in r[f"{name}/metadata"]] == list(r[f"{name}/weights"])
        # each rank sends its pipeline stage's tensors (every one, under PP=1), the stages together the checkpoint
        sent = [{k: v for r in ranks for k, v in r[f"{name}/{key}"].items()} for key in ("weights", "sources")]
        for out in (*sent, exported):
            assert set(out) == set(stored)
            for n, t in stored.items():
                assert torch.equal(out[n], t), (name, n)
        if MINIMAX_LAYOUTS[name][1] == 1:
            assert all(set(r[f"{name}/weights"]) == set(stored) for r in ranks)
