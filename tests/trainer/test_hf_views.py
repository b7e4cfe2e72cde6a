"""The TP=1 weight-sync sources of `hf_io.iter_hf_sources`: views of the Megatron parameters,
built once per model and reused by every sync (issue #9).

No megatron needed: the "model" is a plain module tree whose parameters carry the Megatron names
of `stage_param_maps`, filled from random HF tensors through `hf_to_mcore_shard` (the load path).
Expected values are those HF tensors (a bit-exact round trip), or after an update a fresh
conversion by `iter_hf_weights`; the views must follow in-place updates and the cache must be
rebuilt when a parameter is replaced.
"""

from __future__ import annotations

import pytest
import torch

from slime_rl.trainer.convert import arch_from_hf_config, hf_shapes, hf_to_mcore_shard
from slime_rl.trainer.hf_io import iter_hf_sources, iter_hf_weights, stage_param_maps

# two query groups of two heads each: the q/k/v splits are strided, not reshape-able views
CFG = dict(model_type="qwen2", hidden_size=8, intermediate_size=6, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, vocab_size=10, rms_norm_eps=1e-6,
           rope_parameters={"rope_theta": 1e6, "rope_type": "default"}, tie_word_embeddings=True,
           hidden_act="silu")


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
    return arch_from_hf_config(CFG)


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
