"""glm4 (GLM-4-9B-0414, GLM-Z1-9B-0414): qwen2's layer with a norm after attention and one after the MLP (each
before its residual add: trainer/post_norms.py), half of each head rotated in interleaved pairs (megatron's
rotary_interleaved), and the MLP's gate and up as one HF tensor (gate_up_proj: Layout.FC1_FUSED).

Expected values: tensor names and shapes from transformers' own Glm4 model built from the config; the rotation
from transformers' apply_rotary_pos_emb; log-probs, the loss and every gradient from HF transformers in float64
(trainer_ref.hf_model), with test_trainer_megatron.py's tolerances; the parallel layouts (TP=2 with and without
sequence parallelism, PP=2, CP=2) against one rank on the same batch, with test_trainer_parallel.py's; the
weights out and --save-hf's folder against the checkpoint's tensors, bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.glm4_scenarios import GLM4_LAYOUTS, GLM4_RUN_LAYOUTS
from tests.trainer.parallel_scenarios import equiv_diffs
from tests.trainer.test_trainer_megatron import LOGP_TOL, _assert_grads_close, _max_diff
from tests.trainer.trainer_ref import hf_logprobs, hf_model, hf_policy_grad, make_batch
from tests.trainer.trainer_scenarios import scenario_runner

# a config as GLM-Z1-9B-0414's, small: what transformers builds from it is the reference
BASE = {"model_type": "glm4", "hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
        "vocab_size": 32, "intermediate_size": 24, "num_hidden_layers": 2, "attention_bias": True,
        "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-5, "rope_theta": 1e4, "tie_word_embeddings": False,
        "pad_token_id": 0}  # Glm4Config's default pad id (151329) is outside a small vocabulary
# test_trainer_parallel.py's EQUIV_TOL: one rank vs a parallel layout of the same fp32 model
EQUIV_TOL = {"logp": 1e-5, "grad": 1e-6, "grad_norm_rel": 1e-5, "loss": 1e-6}


@pytest.fixture(scope="session")
def glm4_scenario(tiny_glm4, tmp_path_factory):
    return scenario_runner(tmp_path_factory.mktemp("glm4_scenarios"), {"glm4": tiny_glm4})


@pytest.fixture(scope="session")
def glm4_ref(tiny_glm4):
    model, batch = hf_model(tiny_glm4), make_batch()
    loss, grad = hf_policy_grad(model, batch)
    return {"logp": hf_logprobs(model, batch), "loss": loss, "grad": grad}


def test_tiny_glm4_folder(tiny_glm4):
    """tools/make_tiny_model.py --arch glm4: transformers' Glm4 classes, the config's features, the post norms drawn
    away from 1 and the fused gate_up_proj on disk."""
    from transformers.models.glm4.modeling_glm4 import Glm4DecoderLayer, Glm4MLP

    cfg = json.loads((tiny_glm4 / "config.json").read_text())
    assert cfg["architectures"] == ["Glm4ForCausalLM"] and cfg["model_type"] == "glm4"
    assert (cfg["attention_bias"], cfg["tie_word_embeddings"], cfg["head_dim"]) == (True, False, 16)
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.5
    stored = load_file(tiny_glm4 / "model.safetensors")
    for i in (0, 1):
        p = f"model.layers.{i}."
        assert tuple(stored[p + "mlp.gate_up_proj.weight"].shape) == (2 * cfg["intermediate_size"], cfg["hidden_size"])
        assert p + "mlp.gate_proj.weight" not in stored and p + "self_attn.o_proj.bias" not in stored
        for norm in ("post_self_attn_layernorm", "post_mlp_layernorm"):
            assert float((stored[p + norm + ".weight"] - 1).abs().max()) > 0.05, norm
    model = hf_model(tiny_glm4)
    assert all(isinstance(layer, Glm4DecoderLayer) and isinstance(layer.mlp, Glm4MLP) for layer in model.model.layers)


@pytest.mark.parametrize("change", [{}, {"num_key_value_heads": 4}, {"head_dim": 4, "num_hidden_layers": 3},
                                    {"partial_rotary_factor": 0.25}])
def test_glm4_registry_is_transformers(change):
    """ModelArch and the registry's tensors against the model transformers builds from the same config: every
    tensor's name and shape (the post norms, gate_up_proj [2 x intermediate, hidden]) and nothing else."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_rl.trainer.convert import arch_from_hf_config, hf_shapes

    cfg = {**BASE, **change}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    arch = arch_from_hf_config(cfg)
    assert (arch.post_norms, arch.rotary_interleaved, arch.qkv_bias, arch.qk_layernorm) == (True, True, True, False)
    assert arch.rotary_percent == cfg["partial_rotary_factor"] and arch.kv_channels == cfg["head_dim"]
    state = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert hf_shapes(arch) == state


def test_glm4_config_defaults_are_transformers():
    """A config.json that leaves out head_dim, num_key_value_heads, rms_norm_eps, partial_rotary_factor,
    attention_bias and max_position_embeddings: the arch takes what transformers' Glm4Config takes for them."""
    from transformers import AutoConfig

    from slime_rl.trainer.convert import arch_from_hf_config

    left_out = ("head_dim", "num_key_value_heads", "rms_norm_eps", "partial_rotary_factor", "attention_bias")
    cfg = {k: v for k, v in {**BASE, "hidden_size": 512}.items() if k not in left_out}
    hf = AutoConfig.for_model(**cfg)
    arch = arch_from_hf_config(cfg)
    assert arch.kv_channels == hf.head_dim == 128 and arch.num_query_groups == hf.num_key_value_heads == 2
    assert arch.norm_eps == hf.rms_norm_eps and arch.max_position_embeddings == hf.max_position_embeddings
    assert arch.rotary_percent == hf.rope_parameters["partial_rotary_factor"] == 0.5
    assert arch.qkv_bias and hf.attention_bias


@pytest.mark.parametrize("change,message", [
    ({"attention_bias": False}, "attention_bias=False is not supported for model_type 'glm4'"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported for model_type 'glm4'"),
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor=1.5 must be in \(0, 1\]"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn' is not supported"),
])
def test_glm4_configs_refused_naming_the_field(change, message):
    from slime_rl.trainer.convert import arch_from_hf_config

    with pytest.raises(ValueError, match=message):
        arch_from_hf_config({**BASE, **change}, where="ckpt/config.json")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gate_up_proj_shards_and_back(tp):
    """One HF tensor [gate; up] -> TP rank r holds [gate_r; up_r] (megatron's SwiGLU halves its local rows), built
    here by hand; the shards back -> the HF tensor bit for bit (at TP=1 the shard itself, no copy)."""
    from slime_rl.trainer.convert import arch_from_hf_config, hf_to_mcore_shard, mcore_shards_to_hf

    arch = arch_from_hf_config({**BASE, "num_key_value_heads": 4}, tp_size=tp)
    (pm,) = [p for p in arch.param_maps() if p.mcore == "decoder.layers.0.mlp.linear_fc1.weight"]
    assert pm.hf == ("model.layers.0.mlp.gate_up_proj.weight",)
    fused = torch.randn(48, 16, generator=torch.Generator().manual_seed(0))
    gate, up = fused[:24], fused[24:]
    rows = 24 // tp
    shards = [hf_to_mcore_shard(pm, [fused], arch, r, tp) for r in range(tp)]
    for r, shard in enumerate(shards):
        assert torch.equal(shard, torch.cat([gate[r * rows:(r + 1) * rows], up[r * rows:(r + 1) * rows]]))
    ((name, back),) = mcore_shards_to_hf(pm, shards, arch)
    assert name == pm.hf[0] and torch.equal(back, fused)
    if tp == 1:
        assert back is shards[0]


def test_megatron_interleaved_partial_rope_is_transformers(monkeypatch):
    """megatron-core's RotaryEmbedding (rotary_percent 0.5, rotary_interleaved) and its unfused
    _apply_rotary_pos_emb_bshd, as the trainer runs them, against transformers' Glm4 rotation on the same queries
    (float64 queries): equal up to float32 cos/sin; the halves' rotation (rotary_interleaved off) is not."""
    from transformers import AutoConfig
    from transformers.models.glm4 import modeling_glm4

    from slime_rl.trainer.mcore import rope_utils  # megatron behind the trainer's CPU layer, before any other

    # get_emb moves its frequencies to the current CUDA device (the trainer's CPU layer maps that to the CPU)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: "cpu")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cfg = AutoConfig.for_model(**{**BASE, "head_dim": 16})
    seq, heads, d = 11, 4, 16
    q = torch.randn(1, heads, seq, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    cos, sin = modeling_glm4.Glm4RotaryEmbedding(cfg)(q, torch.arange(seq)[None])
    want, _ = modeling_glm4.apply_rotary_pos_emb(q, q, cos.double(), sin.double())
    t = q.permute(2, 0, 1, 3)  # megatron's [s, b, h, d]
    for interleaved in (True, False):
        rope = RotaryEmbedding(d, rotary_percent=0.5, rotary_interleaved=interleaved, rotary_base=10000,
                               use_cpu_initialization=True)
        freqs = rope.get_emb(seq).double()
        assert freqs.shape[-1] == 8  # the first half of each head rotates
        got = rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved).permute(1, 2, 0, 3)
        assert torch.equal(got[..., 8:], q[..., 8:])
        diff = float((got - want).abs().max())
        # both take cos/sin of float32 angles, transformers in float32 (measured 9.4e-8 apart)
        assert (diff < 1e-6) if interleaved else (diff > 0.1), (interleaved, diff)


def test_hf_logprobs_see_the_post_norms_and_the_interleaving(tiny_glm4):
    """The tiny model's log-probs move by far more than LOGP_TOL without either post norm, or with the rotary
    channels rotated as halves: a trainer that left out either would fail the comparisons below."""
    from transformers.models.glm4 import modeling_glm4

    batch = make_batch()
    base = hf_logprobs(hf_model(tiny_glm4), batch)
    for norm in ("post_self_attn_layernorm", "post_mlp_layernorm"):
        model = hf_model(tiny_glm4)
        for layer in model.model.layers:
            setattr(layer, norm, torch.nn.Identity())
        assert _max_diff([x.tolist() for x in hf_logprobs(model, batch)], base) > 100 * LOGP_TOL, norm
    halves = modeling_glm4.rotate_half

    def rotate_halves(x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def apply(q, k, cos, sin, unsqueeze_dim=1):  # the halves' rotation of the first half of each head
        cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
        rot = cos.shape[-1]
        return tuple(torch.cat([x[..., :rot] * cos + rotate_halves(x[..., :rot]) * sin, x[..., rot:]], dim=-1)
                     for x in (q, k))

    original = modeling_glm4.apply_rotary_pos_emb
    try:
        modeling_glm4.apply_rotary_pos_emb = apply
        moved = hf_logprobs(hf_model(tiny_glm4), batch)
    finally:
        modeling_glm4.apply_rotary_pos_emb = original
    assert modeling_glm4.rotate_half is halves
    assert _max_diff([x.tolist() for x in moved], base) > 100 * LOGP_TOL


@pytest.mark.slow
def test_one_rank_glm4_equals_hf(glm4_scenario, glm4_ref, tiny_glm4):
    """The trainer's GLM-4 (PostNormTransformerLayer, interleaved half-head RoPE, gate_up_proj loaded into
    linear_fc1), padded and packed: HF's float64 log-probs, loss and gradient of every tensor (the post norms and
    gate_up_proj included); the weights out and weight sync's sources are the checkpoint's tensors."""
    (one,) = glm4_scenario("glm4_1", 1)
    assert one["base/layer_classes"] == ["PostNormTransformerLayer"]
    assert one["base/config"] == (False, True, 16, 8)  # no SP, interleaved, head_dim 16 of which 8 rotate
    for layout in ("padded", "packed"):
        assert _max_diff(one[f"base/{layout}/logp"], glm4_ref["logp"]) < LOGP_TOL
        _assert_grads_close(one[f"base/{layout}/grad"], glm4_ref["grad"])
        assert abs(one[f"base/{layout}/stats"]["loss"] - glm4_ref["loss"]) < 1e-6
    grad = one["base/packed/grad"]
    assert {"model.layers.1.post_self_attn_layernorm.weight", "model.layers.0.post_mlp_layernorm.weight",
            "model.layers.0.mlp.gate_up_proj.weight"} <= set(grad)
    stored = load_file(tiny_glm4 / "model.safetensors")
    for key in ("base/weights", "base/sources"):
        assert set(one[key]) == set(stored)
        for name, t in stored.items():
            assert torch.equal(one[key][name], t), (key, name)
    assert [n for n, _, _ in one["base/metadata"]] == list(one["base/weights"])


GLM4_CASES = [(name, scen, layout) for scen, names in (("glm4_tp2", ("tp2sp", "tp2")), ("glm4_pp2cp2", ("pp2", "cp2")))
              for name in names for layout in GLM4_RUN_LAYOUTS.get(name, ("padded", "packed"))]


@pytest.mark.slow
@pytest.mark.parametrize("name,scen,layout", GLM4_CASES, ids=[f"{c[0]}-{c[2]}" for c in GLM4_CASES])
def test_glm4_parallel_layouts_equal_one_rank(glm4_scenario, tiny_glm4, name, scen, layout):
    """TP=2 with sequence parallelism (the post norms normalize each rank's slice of the sequence, their weights'
    gradients summed over TP) and without, PP=2 (one layer per stage) and CP=2 (the interleaved RoPE on each rank's
    two chunks) give one rank's log-probs, gradient, grad norm and loss; every rank's weights out and --save-hf's
    folder are the checkpoint's tensors (gate_up_proj gathered from the TP halves)."""
    (one,) = glm4_scenario("glm4_1", 1)
    ranks = glm4_scenario(scen, 2)
    tp, pp, cp = GLM4_LAYOUTS[name]
    assert sorted(r[f"{name}/ranks"][:3] for r in ranks) == sorted(
        (t, p, c) for t in range(tp) for p in range(pp) for c in range(cp))
    assert {r[f"{name}/config"][:2] for r in ranks} == {(name == "tp2sp", True)}
    assert {tuple(r[f"{name}/post_norm_sp"]) for r in ranks} == {(name == "tp2sp",)}
    diffs = equiv_diffs([one], ranks, name, layout)
    print(f"glm4 {name} {layout} fp32 max diffs: {diffs}")
    for key, tol in EQUIV_TOL.items():
        assert diffs[key] <= tol, f"{name} {layout}: max {key} diff {diffs[key]:.3g} > {tol}"
    want = load_file(tiny_glm4 / "model.safetensors")
    got = {k: v for r in ranks for k, v in r[f"{name}/weights"].items()}
    (exported,) = [r[f"{name}/exported"] for r in ranks if f"{name}/exported" in r]
    for out in (got, exported):
        assert set(out) == set(want)
        for n, t in want.items():
            assert torch.equal(out[n], t), (name, n)


def test_lora_all_linear_leaves_the_one_tensor_gate_up_proj_and_naming_it_is_refused():
    """LoRA's adapters cover a fused linear of separate HF parts (q/k/v, gate/up), not GLM-4's one-tensor
    gate_up_proj: all-linear adapts the attention and down_proj, and naming gate_up_proj is refused naming it."""
    from slime_rl.trainer.convert import arch_from_hf_config
    from slime_rl.trainer.convert.lora_targets import choose

    maps = arch_from_hf_config({**BASE, "num_hidden_layers": 1}).param_maps()
    assert choose(maps, ("all-linear",)) == {"decoder.layers.0.self_attention.linear_qkv.weight": (True, True, True),
                                             "decoder.layers.0.self_attention.linear_proj.weight": (True,),
                                             "decoder.layers.0.mlp.linear_fc2.weight": (True,)}
    with pytest.raises(ValueError, match="--lora-target-modules gate_up_proj: .*GLM-4's one-tensor gate_up_proj"):
        choose(maps, ("q_proj", "gate_up_proj"))
