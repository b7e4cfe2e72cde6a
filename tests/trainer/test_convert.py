"""HF <-> Megatron conversion tables and shard math, and weight sync's cached TP=1 HF views of the
parameters (hf_io.iter_hf_sources), without megatron (pure tensors).

The expected Megatron QKV layout is built here by hand from its definition (per query group: that
group's q heads, then its k head, then its v head), not by the code under test.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch

from slime_rl.trainer.convert import (
    FAMILIES,
    Layout,
    arch_from_hf_config,
    get_family,
    hf_shapes,
    hf_to_mcore_shard,
    mcore_shards_to_hf,
)
from slime_rl.trainer.hf_io import iter_hf_sources, iter_hf_weights, stage_param_maps

CFG = dict(model_type="qwen2", hidden_size=8, intermediate_size=6, num_hidden_layers=1,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=10, rms_norm_eps=1e-6,
           rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, tie_word_embeddings=True,
           hidden_act="silu",
           # read by the MoE families only (qwen3_moe, qwen2_moe): 4 experts of width 6, top-2
           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=6,
           shared_expert_intermediate_size=6,  # qwen2_moe's shared expert
           n_routed_experts=4, n_shared_experts=1)  # glm4_moe's names of the same
# what a family needs beyond CFG (glm4_moe: GLM-4.5's q/k/v biases; no dense layer, transformers' default
# being 1 of CFG's 1 layer)
FAMILY_CFG = {"glm4_moe": {"attention_bias": True, "first_k_dense_replace": 0},
              # glm4: q/k/v biases; Glm4Config's default pad id (151329) lies outside CFG's vocabulary
              "glm4": {"attention_bias": True, "pad_token_id": 0},
              # deepseek_v3: multi-latent attention (every head its own key), small latent widths
              "kimi_k2": {"num_key_value_heads": 4, "first_k_dense_replace": 0, "q_lora_rank": 6, "kv_lora_rank": 4,
                          "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 3, "n_group": 1, "topk_group": 1},
              "deepseek_v3": {"num_key_value_heads": 4, "first_k_dense_replace": 0, "q_lora_rank": 6, "kv_lora_rank": 4,
                              "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 3, "n_group": 1,
                              "topk_group": 1},
              # glm4_moe_lite: deepseek_v3's, every layer sparse by both of its fields (`_family_cfg`)
              "glm4_moe_lite": {"num_key_value_heads": 4, "first_k_dense_replace": 0, "q_lora_rank": 6,
                                "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 3},
              # glm_moe_dsa: glm4_moe_lite's with sparse attention's indexer (2 heads of width 4, top-2 keys)
              "glm_moe_dsa": {"num_key_value_heads": 4, "first_k_dense_replace": 0, "q_lora_rank": 6,
                              "kv_lora_rank": 4, "qk_nope_head_dim": 2, "qk_rope_head_dim": 2, "v_head_dim": 3,
                              "index_topk": 2, "index_n_heads": 2, "index_head_dim": 4,
                              "indexer_rope_interleave": True},
              # minimax_m2: what SGLang reads (q/k norms over all heads, sigmoid + bias), 4 experts of
              # intermediate_size 6, 2 channels of each head rotated
              "minimax_m2": {"use_qk_norm": True, "qk_norm_type": "per_layer", "scoring_func": "sigmoid",
                             "use_routing_bias": True, "num_local_experts": 4, "rotary_dim": 2},
              # qwen3_next: a Gated DeltaNet layer then a gated-attention one, small linear-attention widths
              "qwen3_next": {"num_hidden_layers": 2, "full_attention_interval": 2, "linear_num_key_heads": 2,
                             "linear_num_value_heads": 4, "linear_key_head_dim": 2, "linear_value_head_dim": 3},
              # qwen3_5: qwen3_next's layers with a dense MLP (transformers reads them from text_config)
              "qwen3_5": {"num_hidden_layers": 2, "full_attention_interval": 2, "linear_num_key_heads": 2,
                          "linear_num_value_heads": 4, "linear_key_head_dim": 2, "linear_value_head_dim": 3},
              # qwen3_5_moe: qwen3_5's layers with qwen3_next's MoE block (CFG's experts and shared expert)
              "qwen3_5_moe": {"num_hidden_layers": 2, "full_attention_interval": 2, "linear_num_key_heads": 2,
                              "linear_num_value_heads": 4, "linear_key_head_dim": 2, "linear_value_head_dim": 3}}
# Qwen3.5's vision tower, small (its checkpoint holds one; CFG has no vision_config, so the arch is the text decoder)
QWEN3_5_VISION = {"depth": 1, "hidden_size": 4, "intermediate_size": 4, "num_heads": 1, "out_hidden_size": 8,
                  "num_position_embeddings": 4}


def _family_cfg(cfg: dict) -> dict:
    """`cfg` with FAMILY_CFG's keys of its model_type (glm4_moe_lite: mlp_layer_types for its layer count)."""
    out = cfg | FAMILY_CFG.get(cfg["model_type"], {})
    if cfg["model_type"] == "glm4_moe_lite":  # its head_dim is an alias of qk_rope_head_dim (transformers)
        out["mlp_layer_types"] = ["sparse"] * out["num_hidden_layers"]
        out.pop("head_dim", None)
    return out


TEXT_FAMILIES = sorted(k for k, f in FAMILIES.items() if not f.vision)


def _maps(arch, tied):
    return {pm.mcore: pm for pm in arch.family.param_maps(arch.num_layers, tied)}


def test_arch_from_config_reads_every_field():
    arch = arch_from_hf_config(CFG, tp_size=2, pad_vocab_multiple=4)
    assert (arch.kv_channels, arch.num_query_groups, arch.rotary_base) == (2, 2, 1e6)
    assert arch.padded_vocab_size == 16 and arch.vocab_size == 10  # multiple of 4 * tp
    assert arch.qkv_bias and arch.tie_word_embeddings
    old_style = {k: v for k, v in CFG.items() if k != "rope_parameters"} | {"rope_theta": 500.0}
    assert arch_from_hf_config(old_style).rotary_base == 500.0


@pytest.mark.parametrize("bad, flag", [({"model_type": "gpt2"}, "model_type"),
                                       ({"num_key_value_heads": 1}, "num_key_value_heads"),
                                       ({"use_sliding_window": True}, "use_sliding_window"),
                                       ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1.0}}, "yarn")])
def test_unsupported_configs_raise_naming_the_field(bad, flag):
    with pytest.raises(ValueError, match=flag):
        arch_from_hf_config(CFG | bad, tp_size=2)


def test_qkv_layout_per_query_group_and_tp_split():
    arch = arch_from_hf_config(CFG, tp_size=2)
    d, h = arch.kv_channels, arch.hidden_size
    q = torch.randn(4 * d, h)  # heads q0 q1 (group 0), q2 q3 (group 1)
    k, v = torch.randn(2 * d, h), torch.randn(2 * d, h)
    head = lambda t, i: t[i * d : (i + 1) * d]
    group0 = torch.cat([head(q, 0), head(q, 1), head(k, 0), head(v, 0)])
    group1 = torch.cat([head(q, 2), head(q, 3), head(k, 1), head(v, 1)])
    pm = _maps(arch, True)["decoder.layers.0.self_attention.linear_qkv.weight"]
    assert torch.equal(hf_to_mcore_shard(pm, [q, k, v], arch, 0, 2), group0)  # whole group per rank
    assert torch.equal(hf_to_mcore_shard(pm, [q, k, v], arch, 1, 2), group1)
    assert torch.equal(hf_to_mcore_shard(pm, [q, k, v], arch, 0, 1), torch.cat([group0, group1]))


def test_fc1_each_rank_holds_its_gate_then_its_up():
    arch = arch_from_hf_config(CFG, tp_size=2)
    gate, up = torch.randn(6, 8), torch.randn(6, 8)
    pm = _maps(arch, True)["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(hf_to_mcore_shard(pm, [gate, up], arch, 1, 2), torch.cat([gate[3:], up[3:]]))


@pytest.mark.parametrize("model_type", TEXT_FAMILIES)
@pytest.mark.parametrize("tp", [1, 2])
def test_round_trip_every_param_bit_exact(model_type, tp):
    cfg = _family_cfg(CFG | {"model_type": model_type, "tie_word_embeddings": False, "head_dim": 3})
    arch = arch_from_hf_config(cfg, tp_size=tp, pad_vocab_multiple=3)
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (4 * 3, 8), "k_proj": (2 * 3, 8), "v_proj": (2 * 3, 8), "o_proj": (8, 4 * 3),
              "q_norm": (3,), "k_norm": (3,), "gate_proj": (6, 8), "up_proj": (6, 8), "down_proj": (8, 6),
              "embed_tokens": (10, 8), "lm_head": (10, 8),
              "w1": (6, 8), "w3": (6, 8), "w2": (8, 6)}  # MiniMax-M2's names of an expert's gate, up, down
    hybrid = arch.family.gated_delta_net or arch.family.dsa  # layers differ by kind: the arch's own maps and shapes
    sized = hf_shapes(arch) if hybrid else {}
    maps = arch.param_maps() if hybrid else arch.family.param_maps(arch.num_layers, tied=False,
                                                                   num_experts=arch.num_experts)
    for pm in maps:
        hf = [torch.randn(sized[n] if n in sized else shapes.get(n.split(".")[-2], (8,))[
            : (1 if n.endswith("bias") else 2)], generator=g) for n in pm.hf]
        shards = [hf_to_mcore_shard(pm, hf, arch, r, tp) for r in range(tp)]
        if pm.layout is Layout.VOCAB:
            assert sum(s.shape[0] for s in shards) == arch.padded_vocab_size
        back = mcore_shards_to_hf(pm, shards, arch)
        assert [n for n, _ in back] == list(pm.hf)
        for (_, t), want in zip(back, hf, strict=True):
            assert torch.equal(t, want), pm.mcore


def test_tied_models_have_no_output_layer_and_families_are_explicit():
    for fam in FAMILIES.values():  # vision families share the text layers (the tower is convert/vision.py)
        tied = {pm.mcore for pm in fam.param_maps(2, tied=True)}
        assert "output_layer.weight" not in tied
        assert "output_layer.weight" in {pm.mcore for pm in fam.param_maps(2, tied=False)}
    assert "decoder.layers.1.self_attention.linear_qkv.bias" in {
        pm.mcore for pm in get_family("qwen2").param_maps(2, True)}
    assert "decoder.layers.0.self_attention.q_layernorm.weight" in {
        pm.mcore for pm in get_family("qwen3").param_maps(1, True)}


@pytest.mark.parametrize("model_type", TEXT_FAMILIES)
@pytest.mark.parametrize("tied", [True, False])
def test_hf_shapes_are_those_of_the_transformers_model(model_type, tied, tmp_path):
    """The registry's named dimensions against the state dict transformers builds from the same
    config (the independent reference): same names, same shapes. MoE families: as transformers
    saves it (its module fuses the experts; its checkpoint names them one by one)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from slime_rl.config.families import transformers_config

    cfg = CFG | {"model_type": model_type, "tie_word_embeddings": tied, "head_dim": 3, "num_hidden_layers": 2,
                 "attention_bias": False, "mlp_bias": False, "use_sliding_window": False}
    cfg = _family_cfg(cfg)
    if FAMILIES[model_type].text_config:  # Qwen3.5: the vision-language class, the decoder's fields in text_config
        import transformers

        kind = "Qwen3_5Moe" if FAMILIES[model_type].moe else "Qwen3_5"
        # text_config without the top-level model_type: transformers' own (qwen3_5_moe_text, whose save_pretrained
        # writes the experts one by one; under "qwen3_5_moe" it would write its fused parameters as they are)
        text = {k: v for k, v in copy.deepcopy(cfg).items() if k != "model_type"}
        config = getattr(transformers, f"{kind}Config")(text_config=text, vision_config=QWEN3_5_VISION,
                                                        tie_word_embeddings=tied)
        model = getattr(transformers, f"{kind}ForConditionalGeneration")(config)
    else:
        hf_cfg = transformers_config(copy.deepcopy(cfg))  # transformers writes into rope_parameters
        model = AutoModelForCausalLM.from_config(hf_cfg)
    if FAMILIES[model_type].moe:
        model.save_pretrained(tmp_path)
        with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
            state = {n: f.get_slice(n) for n in f.keys()}
        state = {n: types.SimpleNamespace(shape=tuple(t.get_shape())) for n, t in state.items()}
    else:
        state = model.state_dict()
    want = {n: tuple(t.shape) for n, t in state.items() if not (tied and n == "lm_head.weight")}
    want = {n: s for n, s in want.items()
            if not n.endswith("rotary_emb.inv_freq") and not n.startswith("model.visual.")}  # not the trainer's
    assert hf_shapes(arch_from_hf_config(cfg)) == want


def test_vl_shapes_are_the_checkpoint_tensors(tiny_qwen2_5_vl):
    """Qwen2.5-VL: every tensor of a checkpoint written by transformers (vision tower included),
    with its shape, is what config.json implies, and nothing else."""
    from safetensors import safe_open

    from slime_rl.trainer.convert import load_arch

    with safe_open(str(tiny_qwen2_5_vl / "model.safetensors"), framework="pt") as f:
        stored = {n: tuple(f.get_slice(n).get_shape()) for n in f.keys()}
    arch = load_arch(tiny_qwen2_5_vl)
    assert hf_shapes(arch) == stored
    assert arch.mrope_section == (2, 3, 3) and arch.vision.image_token_id == 126


def test_vl_hub_style_config_gives_the_same_arch(tiny_qwen2_5_vl):
    """Hub configs of Qwen2.5-VL keep the decoder's fields at the top level and say
    rope_scaling {"type": "mrope", "mrope_section": ...}; transformers 5 nests them in text_config."""
    import json

    nested = json.loads((tiny_qwen2_5_vl / "config.json").read_text())
    text = dict(nested["text_config"])
    rope = text.pop("rope_parameters")
    flat = {k: v for k, v in nested.items() if k != "text_config"} | text | {
        "model_type": "qwen2_5_vl", "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    assert arch_from_hf_config(flat) == arch_from_hf_config(nested)
    with pytest.raises(ValueError, match="mrope_section"):
        arch_from_hf_config(flat | {"rope_scaling": {"type": "mrope"}})


# ---- hf_io.iter_hf_sources: weight sync's TP=1 views of the parameters, built once per model and
# reused by every sync (issue #9). The "model" is a plain module tree whose parameters carry the
# Megatron names of `stage_param_maps`, filled from random HF tensors through `hf_to_mcore_shard`
# (the load path). Expected values are those HF tensors (a bit-exact round trip), or after an update
# a fresh conversion by `iter_hf_weights`; the views must follow in-place updates and the cache must
# be rebuilt when a parameter is replaced.


class Node(torch.nn.Module):
    pass


def _model(arch, seed: int = 0) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A module tree with the Megatron parameter names, loaded from random HF tensors."""
    g = torch.Generator().manual_seed(seed)
    hf = {n: torch.randn(s, generator=g) for n, s in hf_shapes(arch).items()}
    root = Node()
    for local, pm, _ in stage_param_maps(arch):
        *path, leaf = local.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, Node())
            mod = getattr(mod, part)
        shard = hf_to_mcore_shard(pm, [hf[n] for n in pm.hf], arch, 0, 1)
        mod.register_parameter(leaf, torch.nn.Parameter(shard.clone()))
    return root, hf


def _as_hf(sources) -> dict[str, torch.Tensor]:
    # what the engine rebuilds from the bucket: the source's elements in order, in the HF shape
    return {n: src.contiguous().view(shape) for n, src, shape in sources}


@pytest.fixture
def arch():
    return arch_from_hf_config(CFG | {"num_hidden_layers": 2})  # two query groups: strided q/k/v views


def test_sources_are_the_hf_tensors_and_views_of_the_parameters(arch):
    model, hf = _model(arch)
    sources = list(iter_hf_sources(model, arch))
    assert [n for n, _, _ in sources] == [n for n, _ in iter_hf_weights(model, arch)]
    got = _as_hf(sources)
    assert set(got) == set(hf)  # tied: no lm_head
    for n, want in hf.items():
        assert torch.equal(got[n], want), n
    ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert all(src.untyped_storage().data_ptr() in ptrs for _, src, _ in sources)
    q = next(src for n, src, _ in sources if n.endswith("q_proj.weight"))
    assert not q.is_contiguous()  # a strided split, copied into the bucket as is


def test_cache_follows_in_place_updates(arch):
    model, _ = _model(arch)
    first = list(iter_hf_sources(model, arch))
    with torch.no_grad():  # an optimizer step: in place, same storage
        for p in model.parameters():
            p.mul_(-1.5).add_(0.25)
    second = list(iter_hf_sources(model, arch))
    assert all(a[1] is b[1] for a, b in zip(first, second, strict=True))  # reused, not rebuilt
    fresh = {n: t.clone() for n, t in iter_hf_weights(model, arch)}
    got = _as_hf(second)
    assert got.keys() == fresh.keys()
    for n, want in fresh.items():
        assert torch.equal(got[n], want), n


@pytest.mark.parametrize("how", ["new_parameter", "data_swap"])
def test_cache_is_rebuilt_when_a_parameter_is_replaced(arch, how):
    model, _ = _model(arch)
    old = {n: src for n, src, _ in iter_hf_sources(model, arch)}
    fc2 = model.get_submodule("decoder.layers.1.mlp.linear_fc2")
    new = torch.randn(fc2.weight.shape, generator=torch.Generator().manual_seed(7))
    if how == "new_parameter":
        fc2.weight = torch.nn.Parameter(new.clone())
    else:
        fc2.weight.data = new.clone()
    got = {n: src for n, src, _ in iter_hf_sources(model, arch)}
    assert torch.equal(got["model.layers.1.mlp.down_proj.weight"], new)
    assert got["model.layers.1.mlp.down_proj.weight"] is not old["model.layers.1.mlp.down_proj.weight"]
    fresh = dict(iter_hf_weights(model, arch))
    for n, src in got.items():
        assert torch.equal(src.contiguous().view(fresh[n].shape), fresh[n]), n


def test_skip_frozen_leaves_out_frozen_parameters_and_follows_changes(arch):
    model, _ = _model(arch)
    norm = model.get_submodule("decoder.final_layernorm")
    assert "model.norm.weight" in [n for n, _, _ in iter_hf_sources(model, arch, skip_frozen=True)]
    norm.weight.requires_grad_(False)
    names = [n for n, _, _ in iter_hf_sources(model, arch, skip_frozen=True)]
    assert "model.norm.weight" not in names and len(names) == len(hf_shapes(arch)) - 1
    assert "model.norm.weight" in [n for n, _, _ in iter_hf_sources(model, arch)]  # not skipping: all
    norm.weight.requires_grad_(True)
    assert "model.norm.weight" in [n for n, _, _ in iter_hf_sources(model, arch, skip_frozen=True)]
