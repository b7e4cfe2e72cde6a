"""qwen3_next (Qwen3-Next-80B-A3B): hybrid layers (megatron-core's GatedDeltaNet where config.json's layer_types say
linear_attention, full attention with a sigmoid output gate and q/k norms elsewhere, a quarter of each head rotated),
zero-centred RMSNorms, an MoE block with a sigmoid-gated shared expert in every layer.

Expected values: tensor names and shapes from transformers' own Qwen3Next model built from the config; the in_proj /
conv1d / gated q_proj layouts from megatron's GatedDeltaNet and Attention split tables, written out here by hand;
log-probs, the loss and every gradient from HF transformers in float64 (trainer_ref.hf_model; its Gated DeltaNet
computes in float32 as megatron's does) with test_trainer_megatron.py's tolerances; TP=2 (the Gated DeltaNet's heads
split over the ranks) against one rank, with test_trainer_parallel.py's; the weights out and --save-hf's folder
against the checkpoint's tensors, bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.parallel_scenarios import equiv_diffs
from tests.trainer.test_moe import _per_expert
from tests.trainer.test_trainer_megatron import LOGP_TOL, _assert_grads_close, _max_diff
from tests.trainer.trainer_ref import hf_logprobs, hf_model, hf_policy_grad, make_batch
from tests.trainer.trainer_scenarios import scenario_runner

# a config as Qwen3-Next-80B-A3B's, small: what transformers builds from it is the reference
BASE = {"model_type": "qwen3_next", "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "vocab_size": 32, "intermediate_size": 24, "num_hidden_layers": 4, "full_attention_interval": 2,
        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 6, "linear_value_head_dim": 10,
        "linear_conv_kernel_dim": 4, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 20, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-6,
        "rope_theta": 1e4, "tie_word_embeddings": False, "pad_token_id": 0}
# test_trainer_parallel.py's EQUIV_TOL: one rank vs a parallel layout of the same fp32 model
EQUIV_TOL = {"logp": 1e-5, "grad": 1e-6, "grad_norm_rel": 1e-5, "loss": 1e-6}


@pytest.fixture(scope="session")
def qwen3_next_scenario(tiny_qwen3_next, tmp_path_factory):
    return scenario_runner(tmp_path_factory.mktemp("qwen3_next_scenarios"), {"qwen3_next": tiny_qwen3_next})


@pytest.fixture(scope="session")
def qwen3_next_ref(tiny_qwen3_next):
    model, batch = hf_model(tiny_qwen3_next), make_batch()
    loss, grad = hf_policy_grad(model, batch)
    return {"logp": hf_logprobs(model, batch), "loss": loss, "grad": _per_expert(grad)}


@pytest.mark.parametrize("change", [{}, {"full_attention_interval": 4}, {"num_key_value_heads": 4},
                                    {"linear_num_value_heads": 2}, {"mlp_only_layers": [1]},
                                    {"layer_types": ["full_attention", "linear_attention"] * 2}])
def test_qwen3_next_registry_is_transformers(change, tmp_path):
    """ModelArch and the registry's tensors against the checkpoint transformers writes from the same config: every
    tensor's name and shape (in_proj_qkvz, in_proj_ba, conv1d [channels, 1, width], q_proj's query and gate rows,
    the experts under the hub's per-expert names) and nothing else; the layer kinds are transformers' layer_types."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from slime_rl.trainer.convert import arch_from_hf_config, hf_shapes

    cfg = {**BASE, **change}
    hf_cfg = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(hf_cfg)
    arch = arch_from_hf_config(cfg)
    assert arch.linear_layers == tuple(t == "linear_attention" for t in hf_cfg.layer_types)
    assert (arch.attention_output_gate, arch.zero_centered_norms, arch.rotary_percent) == (True, True, 0.25)
    model.save_pretrained(tmp_path, safe_serialization=True)
    stored = {n: tuple(t.shape) for f in tmp_path.glob("*.safetensors") for n, t in load_file(f).items()}
    assert hf_shapes(arch) == stored


def test_qwen3_next_hub_config_reads_full_attention_interval():
    """The hub's config.json (no layer_types, full_attention_interval 4, partial_rotary_factor at the top): every
    fourth layer full attention, as transformers reads it."""
    from transformers import AutoConfig

    from slime_rl.trainer.convert import arch_from_hf_config

    hub = json.loads(open("tests/migration/hf_configs/Qwen3-Next-80B-A3B-Thinking/config.json").read())
    arch = arch_from_hf_config(hub)
    want = AutoConfig.for_model(**hub).layer_types
    assert arch.linear_layers == tuple(t == "linear_attention" for t in want)
    assert sum(arch.linear_layers) == 36 and arch.rotary_percent == 0.25 and arch.kv_channels == 256
    assert (arch.linear_num_key_heads, arch.linear_num_value_heads, arch.num_experts, arch.moe_topk) == (
        16, 32, 512, 10)


@pytest.mark.parametrize("change,message", [
    ({"linear_num_key_heads": 3}, "linear_num_value_heads=4 must be a multiple of linear_num_key_heads=3"),
    ({"layer_types": ["full_attention"] * 3}, "layer_types=.* for each of the 4 layers"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False is not supported for model_type 'qwen3_next'"),
])
def test_qwen3_next_configs_refused_naming_the_field(change, message):
    from slime_rl.trainer.convert import arch_from_hf_config

    with pytest.raises(ValueError, match=message):
        arch_from_hf_config({**BASE, **change}, where="ckpt/config.json")
    with pytest.raises(ValueError, match="linear_num_key_heads=2 is not divisible by --tensor-model-parallel-size 4"):
        arch_from_hf_config({**BASE, "num_key_value_heads": 4}, tp_size=4)


@pytest.mark.parametrize("tp", [1, 2])
def test_gated_delta_net_layouts_by_hand(tp):
    """in_proj, conv1d and the gated linear_qkv on each TP rank, built here from megatron's split tables: in_proj
    [q; k; v; z; b; a] of the rank's key heads (and their value heads) from HF's per-key-head rows, conv1d the rank's
    q, k, v channels, linear_qkv per query group [queries; gates; key; value]; and the shards back, bit for bit."""
    from slime_rl.trainer.convert import arch_from_hf_config, hf_to_mcore_shard, mcore_shards_to_hf

    arch = arch_from_hf_config(BASE, tp_size=tp)
    maps = {pm.mcore: pm for pm in arch.param_maps()}
    gen = torch.Generator().manual_seed(0)
    keys, r, dk, dv, hidden = 2, 2, 6, 10, 32
    # HF rows per key head h: q (dk), k (dk), v (r x dv), z (r x dv); ba per key head: b (r), a (r)
    qkvz = torch.randn(keys * (2 * dk + 2 * r * dv), hidden, generator=gen)
    ba = torch.randn(keys * 2 * r, hidden, generator=gen)
    heads = qkvz.reshape(keys, -1, hidden)
    q, k = heads[:, :dk], heads[:, dk:2 * dk]
    v, z = heads[:, 2 * dk:2 * dk + r * dv], heads[:, 2 * dk + r * dv:]
    bah = ba.reshape(keys, 2 * r, hidden)
    b, a = bah[:, :r], bah[:, r:]
    pm = maps["decoder.layers.0.self_attention.in_proj.weight"]
    shards = [hf_to_mcore_shard(pm, [qkvz, ba], arch, rank, tp) for rank in range(tp)]
    per = keys // tp
    for rank, shard in enumerate(shards):
        mine = slice(rank * per, (rank + 1) * per)
        want = torch.cat([t[mine].reshape(-1, hidden) for t in (q, k, v, z, b, a)])
        assert torch.equal(shard, want)
    back = dict(mcore_shards_to_hf(pm, shards, arch))
    assert torch.equal(back[pm.hf[0]], qkvz) and torch.equal(back[pm.hf[1]], ba)

    conv = torch.randn(2 * keys * dk + keys * r * dv, 1, 4, generator=gen)  # HF: all q, all k, all v channels
    pm = maps["decoder.layers.0.self_attention.conv1d.weight"]
    cq, ck, cv = conv[:keys * dk], conv[keys * dk:2 * keys * dk], conv[2 * keys * dk:]
    shards = [hf_to_mcore_shard(pm, [conv], arch, rank, tp) for rank in range(tp)]
    for rank, shard in enumerate(shards):
        want = torch.cat([t.chunk(tp)[rank] for t in (cq, ck, cv)])
        assert torch.equal(shard, want)
    assert torch.equal(dict(mcore_shards_to_hf(pm, shards, arch))[pm.hf[0]], conv)

    heads_, groups, d = 4, 2, 8  # q_proj rows per head: query (d), gate (d)
    qp = torch.randn(heads_ * 2 * d, hidden, generator=gen)
    kp, vp = torch.randn(groups * d, hidden, generator=gen), torch.randn(groups * d, hidden, generator=gen)
    pm = maps["decoder.layers.1.self_attention.linear_qkv.weight"]
    shards = [hf_to_mcore_shard(pm, [qp, kp, vp], arch, rank, tp) for rank in range(tp)]
    qh = qp.reshape(heads_, 2, d, hidden)
    want = []
    for g in range(groups):
        hs = range(g * heads_ // groups, (g + 1) * heads_ // groups)
        want += [qh[h, 0] for h in hs] + [qh[h, 1] for h in hs] + [kp.reshape(groups, d, hidden)[g],
                                                                     vp.reshape(groups, d, hidden)[g]]
    assert torch.equal(torch.cat(shards), torch.cat(want))
    back = dict(mcore_shards_to_hf(pm, shards, arch))
    assert all(torch.equal(back[n], t) for n, t in zip(pm.hf, (qp, kp, vp), strict=True))


def test_torch_gated_delta_net_functions_are_transformers():
    """The CPU trainer's stand-ins for fla's functions against transformers' own torch path: the causal
    convolution (and a packed pair of sequences, each from zeros), and the gated delta rule per packed sequence."""
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    from slime_rl.trainer import gated_delta_net as ours

    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(1, 11, 6, generator=gen), torch.randn(6, 4, generator=gen)
    want = hf.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    got, _ = ours.causal_conv1d(x, w, activation="silu")
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    got, _ = ours.causal_conv1d(x, w, activation="silu", cu_seqlens=torch.tensor([0, 5, 11]))
    tail = hf.causal_conv1d_fn(x[:, 5:].transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    torch.testing.assert_close(got, torch.cat([want[:, :5], tail], dim=1), atol=1e-6, rtol=1e-6)
    assert float((got[:, 5:] - want[:, 5:]).abs().max()) > 1e-3  # the second sequence starts from zeros

    q, k = torch.randn(1, 70, 2, 8, generator=gen), torch.randn(1, 70, 2, 8, generator=gen)
    v = torch.randn(1, 70, 2, 5, generator=gen)
    g, beta = -torch.rand(1, 70, 2, generator=gen), torch.rand(1, 70, 2, generator=gen)
    q, k = ours.l2norm(q), ours.l2norm(k)
    want = torch.cat([hf.torch_chunk_gated_delta_rule(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s])[0]
                      for s in (slice(0, 66), slice(66, 70))], dim=1)
    got, _ = ours.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 66, 70]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_one_rank_qwen3_next_equals_hf(qwen3_next_scenario, qwen3_next_ref, tiny_qwen3_next):
    """The trainer's Qwen3-Next (GatedDeltaNet in layers 0 and 2 on torch in place of fla, gated attention in 1 and
    3, zero-centred norms, the gated shared expert), padded and packed: HF's float64 log-probs, loss and gradient of
    every tensor; the weights out and weight sync's sources are the checkpoint's tensors."""
    (one,) = qwen3_next_scenario("qwen3_next_1", 1)
    assert one["base/attention_classes"] == ["GatedDeltaNet", "SelfAttention"] * 2
    check_one_rank(one, qwen3_next_ref, load_file(tiny_qwen3_next / "model.safetensors"))


def check_one_rank(one: dict, ref: dict, stored: dict, rotary: int = 4) -> None:
    """One rank's run ("base") of a Gated DeltaNet tiny model (layers linear, full, linear, full; `rotary` of each
    head's channels rotated: 4 of 16, Qwen3.5's 8 of 32): padded and packed log-probs, gradient and loss equal HF's
    float64 `ref`; its weights out and weight-sync sources are `stored` bit for bit."""
    assert one["base/config"] == ("gated_delta_net", [1, 0, 1, 0], True, True, rotary)
    for layout in ("padded", "packed"):
        assert _max_diff(one[f"base/{layout}/logp"], ref["logp"]) < LOGP_TOL, layout
        _assert_grads_close(one[f"base/{layout}/grad"], ref["grad"])
        assert abs(one[f"base/{layout}/stats"]["loss"] - ref["loss"]) < 1e-6
    for key in ("base/weights", "base/sources"):
        assert set(one[key]) == set(stored)
        for name, t in stored.items():
            assert torch.equal(one[key][name], t), (key, name)


@pytest.mark.slow
def test_qwen3_next_tp2_equals_one_rank(qwen3_next_scenario, tiny_qwen3_next):
    """TP=2 with sequence parallelism (megatron's MoE layers under TP need it; packed micro-batches): each rank one
    Gated DeltaNet key head and its two value heads, one query group of the gated attention, the output norm's
    gradient summed over the ranks; one rank's log-probs, gradient, grad norm and loss; every rank's weights out,
    --save-hf's folder and a model-only --save loaded back into zeroed parameters are the checkpoint's tensors."""
    layout = "packed"
    (one,) = qwen3_next_scenario("qwen3_next_1", 1)
    ranks = qwen3_next_scenario("qwen3_next_tp2", 2)
    assert sorted(r["tp2/ranks"][0] for r in ranks) == [0, 1] and all(r["tp2/sequence_parallel"] for r in ranks)
    diffs = equiv_diffs([one], ranks, "tp2", layout)
    print(f"qwen3_next tp2 {layout} fp32 max diffs: {diffs}")
    for key, tol in EQUIV_TOL.items():
        assert diffs[key] <= tol, f"tp2 {layout}: max {key} diff {diffs[key]:.3g} > {tol}"
    want = load_file(tiny_qwen3_next / "model.safetensors")
    got = {k: v for r in ranks for k, v in r["tp2/weights"].items()}
    (exported,) = [r["tp2/exported"] for r in ranks if "tp2/exported" in r]
    # a model-only checkpoint (megatron's sharded_state_dict) saved, the parameters zeroed, loaded back
    reloaded = {k: v for r in ranks for k, v in r["tp2/reloaded"].items()}
    assert all(r["tp2/zeroed"] == 0 for r in ranks)
    for out in (got, exported, reloaded):
        assert set(out) == set(want)
        for n, t in want.items():
            assert torch.equal(out[n], t), n


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_qwen3_next_cp2_equals_one_rank(qwen3_next_scenario, layout):
    """CP=2: the gated attention layers in the trainer's context-parallel core attention, the Gated DeltaNet layers
    by megatron's own all-to-all (each rank the whole sequence of one key head and its value heads, then back to its
    two chunks of the sequence); one rank's log-probs, gradient, grad norm and loss."""
    (one,) = qwen3_next_scenario("qwen3_next_1", 1)
    ranks = qwen3_next_scenario("qwen3_next_tp2", 2)
    assert sorted(r["cp2/ranks"][2] for r in ranks) == [0, 1]
    diffs = equiv_diffs([one], ranks, "cp2", layout)
    for key, tol in EQUIV_TOL.items():
        assert diffs[key] <= tol, f"cp2 {layout}: max {key} diff {diffs[key]:.3g} > {tol}"


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_qwen3_next_pp2_equals_one_rank(qwen3_next_scenario, layout):
    """PP=2: each stage builds its own layers' kinds (the first a Gated DeltaNet and a gated attention layer, layers
    1 and 2; the second layers 3 and 4 alike), and gives one rank's log-probs, gradient, grad norm and loss."""
    (one,) = qwen3_next_scenario("qwen3_next_1", 1)
    ranks = qwen3_next_scenario("qwen3_next_tp2", 2)
    by_stage = {r["pp2/ranks"][1]: r for r in ranks}
    assert sorted(by_stage) == [0, 1]
    for stage, numbers in ((0, [1, 2]), (1, [3, 4])):
        assert by_stage[stage]["pp2/layer_numbers"] == numbers
        assert by_stage[stage]["pp2/attention_classes"] == ["GatedDeltaNet", "SelfAttention"]
    diffs = equiv_diffs([one], ranks, "pp2", layout)
    for key, tol in EQUIV_TOL.items():
        assert diffs[key] <= tol, f"pp2 {layout}: max {key} diff {diffs[key]:.3g} > {tol}"


def test_builtin_engine_refuses_gated_delta_net_in_one_sentence():
    """The built-in engine's left-padded key/value batches hold no recurrent state: a qwen3_next checkpoint is
    refused at engine start, naming the family and the backend that serves it; the other families pass."""
    from slime_rl.engines.embedded.server import refuse_unserved_family

    with pytest.raises(ValueError, match=r"^model_type 'qwen3_next': the built-in engine does not serve its Gated "
                                         r"DeltaNet .*; use --rollout-backend sglang$"):
        refuse_unserved_family("qwen3_next")
    for model_type in ("qwen2", "qwen3_moe", "glm4", ""):
        refuse_unserved_family(model_type)
