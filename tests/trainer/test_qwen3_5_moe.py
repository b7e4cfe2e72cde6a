"""qwen3_5_moe (Qwen3.5-35B-A3B, Qwen3.6-35B-A3B; Qwen3_5MoeForConditionalGeneration): qwen3_5's hybrid text decoder
(Gated DeltaNet and gated full attention, zero-centred norms, names under model.language_model.) with qwen3_next's MoE
block in every layer (softmax top-k renormalised, a sigmoid-gated shared expert); the published checkpoints store a
layer's routed experts fused, `mlp.experts.gate_up_proj` [experts, 2 x width, hidden] and `mlp.experts.down_proj`
[experts, hidden, width], which the trainer reads per expert and --save-hf writes back fused; transformers' vision tower
(model.visual.*) on the first stage, trained, with interleaved 3-D rotary positions, as for qwen3_5.

Expected values: tensor names and shapes from transformers' own model built from text_config, in both the fused form
(its parameters, as the hub stores them) and the per-expert form (what its save_pretrained writes); which rows of the
fused tensor are an expert's gate and up from transformers' save_pretrained, which splits them itself; log-probs, the
loss and every gradient from transformers' Qwen3_5MoeForConditionalGeneration in float64 on a batch with images and a
text-only row (tests/trainer/qwen3_5_vl_ref.py) with test_trainer_megatron.py's tolerances; TP=2, PP=2 and EP=2 against
one rank with test_trainer_parallel.py's; the weights out, weight sync's sources and --save-hf's folder (fused, vision
tower included) against the checkpoint, bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.trainer.parallel_scenarios import equiv_diffs
from tests.trainer.qwen3_5_vl_ref import hf_inputs, hf_vl_model, vl_batch
from tests.trainer.test_moe import _per_expert
from tests.trainer.test_qwen3_next import EQUIV_TOL, check_one_rank
from tests.trainer.trainer_ref import hf_logprobs, hf_policy_grad
from tests.trainer.trainer_scenarios import scenario_runner

VISUAL = "model.visual."
# a config as Qwen3.5-35B-A3B's, small (transformers 5 writes the decoder's fields in text_config)
TEXT = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 32,
        "num_hidden_layers": 4, "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 6, "linear_value_head_dim": 10, "linear_conv_kernel_dim": 4, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 12, "shared_expert_intermediate_size": 20,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                            "mrope_section": [1, 1, 0], "mrope_interleaved": True}}
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
          "num_position_embeddings": 16}


def _hf_folders(tmp_path, text: dict) -> tuple:
    """transformers' Qwen3_5MoeForConditionalGeneration of `text`, written twice: its parameters as they are
    (fused/, the published layout) and by its save_pretrained (split/, one expert at a time)."""
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    hf_cfg = Qwen3_5MoeConfig(text_config=text, vision_config=VISION, tie_word_embeddings=False)
    model = Qwen3_5MoeForConditionalGeneration(hf_cfg)
    fused, split = tmp_path / "fused", tmp_path / "split"
    model.save_pretrained(split, safe_serialization=True)
    model.save_pretrained(fused, safe_serialization=True)
    save_file({n: t.contiguous() for n, t in model.state_dict().items()}, str(fused / "model.safetensors"))
    return hf_cfg, fused, split


@pytest.fixture(scope="session")
def qwen3_5_moe_batch(tiny_qwen3_5_moe, tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_moe_rows")
    batch = vl_batch(tiny_qwen3_5_moe, folder)
    torch.save(batch, folder / "batch.pt")
    return batch, folder / "batch.pt"


@pytest.fixture(scope="session")
def qwen3_5_moe_scenario(tiny_qwen3_5_moe, qwen3_5_moe_batch, tmp_path_factory):
    return scenario_runner(tmp_path_factory.mktemp("qwen3_5_moe_scenarios"),
                           {"qwen3_5_moe": tiny_qwen3_5_moe, "qwen3_5_moe_batch": qwen3_5_moe_batch[1]})


@pytest.fixture(scope="session")
def qwen3_5_moe_ref(tiny_qwen3_5_moe, qwen3_5_moe_batch):
    model, batch = hf_vl_model(tiny_qwen3_5_moe), qwen3_5_moe_batch[0]
    assert type(model).__name__ == "Qwen3_5MoeForConditionalGeneration"
    inputs = hf_inputs(model, tiny_qwen3_5_moe, batch)
    loss, grad = hf_policy_grad(model, batch, inputs=inputs)
    # its parameter names are the checkpoint's, its experts fused; weight sync's are per expert
    return {"logp": hf_logprobs(model, batch, inputs=inputs), "loss": loss, "grad": _per_expert(grad)}


def _stored_per_expert(folder) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors (vision tower included), its fused experts cut per expert as transformers' forward
    reads them."""
    return _per_expert(load_file(folder / "model.safetensors"))


@pytest.mark.parametrize("change", [{}, {"full_attention_interval": 4, "num_experts_per_tok": 1}])
def test_qwen3_5_moe_registry_is_transformers(change, tmp_path):
    """ModelArch and the registry against transformers' model of the same text_config: every decoder tensor's name
    and shape, per expert as its save_pretrained writes them and fused as its parameters are (the published layout),
    and the vision tower's (model.visual.*), nothing else; every layer an MoE block with the shared expert,
    renormalised top-k, the layer kinds transformers' layer_types."""
    from slime_rl.trainer.convert import arch_from_hf_config, hf_shapes
    from slime_rl.trainer.fused_experts import fused_shapes
    from slime_rl.trainer.hf_files import check_hf_weights

    hf_cfg, fused, split = _hf_folders(tmp_path, {**TEXT, **change})
    cfg = json.loads((fused / "config.json").read_text())
    arch = arch_from_hf_config(cfg)
    text = hf_cfg.text_config
    assert arch.linear_layers == tuple(t == "linear_attention" for t in text.layer_types)
    assert arch.moe_layers == (True,) * 4 and arch.moe_norm_topk_prob
    assert (arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size, arch.moe_shared_expert_ffn_hidden_size) == (
        text.num_experts, text.num_experts_per_tok, text.moe_intermediate_size, text.shared_expert_intermediate_size)
    assert (arch.attention_output_gate, arch.zero_centered_norms, arch.rotary_percent) == (True, True, 0.25)
    assert (arch.mrope_section, arch.mrope_interleaved, arch.vision.model_type, arch.tie_word_embeddings) == (
        (1, 1, 0), True, "qwen3_5_moe", False)
    for folder, want in ((split, hf_shapes(arch)), (fused, fused_shapes(hf_shapes(arch)))):
        stored = {n: tuple(t.shape) for n, t in load_file(folder / "model.safetensors").items()}
        assert any(n.startswith(VISUAL) for n in want)
        assert want == stored, folder.name
        check_hf_weights(folder, arch)  # either form passes the header check


def test_qwen3_5_moe_hub_configs():
    """The hub's config.json of Qwen3.5-35B-A3B and Qwen3.6-35B-A3B (decoder fields in text_config, no layer_types,
    no intermediate_size): 40 layers, every fourth full attention as transformers reads it, 256 experts of width 512
    (top 8) and a shared expert of 512 in every layer, the dense width megatron never builds one expert's."""
    from transformers import AutoConfig

    from slime_rl.trainer.convert import arch_from_hf_config

    for name in ("Qwen3.5-35B-A3B", "Qwen3.6-35B-A3B"):
        hub = json.loads(open(f"tests/migration/hf_configs/{name}/config.json").read())
        arch = arch_from_hf_config(hub)
        want = AutoConfig.for_model(**hub).text_config.layer_types
        assert arch.linear_layers == tuple(t == "linear_attention" for t in want), name
        assert (arch.num_layers, arch.hidden_size, sum(arch.linear_layers), arch.moe_layers) == (40, 2048, 30,
                                                                                                (True,) * 40)
        assert (arch.num_experts, arch.moe_topk, arch.moe_ffn_hidden_size, arch.moe_shared_expert_ffn_hidden_size,
                arch.ffn_hidden_size, arch.moe_norm_topk_prob) == (256, 8, 512, 512, 512, True)
        assert (arch.linear_num_key_heads, arch.linear_num_value_heads, arch.kv_channels) == (16, 32, 256)


@pytest.mark.parametrize("change,message", [
    ({"norm_topk_prob": False}, "norm_topk_prob=False is not supported for model_type 'qwen3_5_moe'"),
    ({"attn_output_gate": False}, "attn_output_gate=False is not supported for model_type 'qwen3_5_moe'"),
])
def test_qwen3_5_moe_configs_refused_naming_the_field(change, message):
    """SGLang reads norm_topk_prob (transformers always renormalises) and attn_output_gate (transformers always
    gates): a file that turns either off is refused naming the field."""
    from slime_rl.trainer.convert import arch_from_hf_config

    with pytest.raises(ValueError, match=message):
        arch_from_hf_config({"model_type": "qwen3_5_moe", "text_config": {**TEXT, **change}})


def test_fused_experts_read_per_expert_and_written_back(tmp_path):
    """read_hf_tensors gives an expert's gate, up and down from the fused checkpoint exactly as from the per-expert
    one transformers' save_pretrained splits out of the same parameters (gate rows first), bit for bit, reading only
    the names asked for (missing_ok leaves out what neither holds); fuse() stacks them back into the fused tensors."""
    from slime_rl.trainer.convert import arch_from_hf_config, hf_shapes
    from slime_rl.trainer.fused_experts import fuse
    from slime_rl.trainer.hf_files import read_hf_tensors

    _, fused, split = _hf_folders(tmp_path, TEXT)
    arch = arch_from_hf_config(json.loads((fused / "config.json").read_text()))
    names = list(hf_shapes(arch))
    got, want = read_hf_tensors(fused, names), read_hf_tensors(split, names)
    assert list(got) == names and set(want) == set(names)
    for n in names:
        assert torch.equal(got[n], want[n]), n
    e = "model.language_model.layers.2.mlp.experts.3."
    part = read_hf_tensors(fused, [e + "up_proj.weight", e + "nothing.weight"], missing_ok=True)
    assert list(part) == [e + "up_proj.weight"] and tuple(part[e + "up_proj.weight"].shape) == (12, 32)
    with pytest.raises(KeyError, match="nothing"):
        read_hf_tensors(fused, [e + "nothing.weight"])
    stored = load_file(fused / "model.safetensors")
    back = dict(fuse(((n, got[n]) for n in names), arch.num_experts))
    assert set(back) == set(stored)
    for n, t in back.items():
        assert torch.equal(t, stored[n]), n


@pytest.mark.slow
def test_one_rank_qwen3_5_moe_equals_hf(qwen3_5_moe_scenario, qwen3_5_moe_ref, tiny_qwen3_5_moe):
    """The trainer's Qwen3.5-MoE (GatedDeltaNet in layers 0 and 2, gated attention in 1 and 3, zero-centred norms,
    every layer's routed experts and gated shared expert; the vision tower and interleaved 3-D positions) on rows with
    images and a text-only row, padded and packed: HF's float64 log-probs, loss and gradient of every tensor (each
    expert's, the tower's); the weights out and weight sync's sources are the checkpoint's tensors, the fused experts
    cut per expert."""
    (one,) = qwen3_5_moe_scenario("qwen3_5_moe_1", 1)
    assert one["base/attention_classes"] == ["GatedDeltaNet", "SelfAttention"] * 2
    check_one_rank(one, qwen3_5_moe_ref, _stored_per_expert(tiny_qwen3_5_moe), rotary=8)


@pytest.mark.slow
def test_qwen3_5_moe_tp2_pp2_ep2_equal_one_rank(qwen3_5_moe_scenario, tiny_qwen3_5_moe):
    """TP=2 (packed, sequence parallel), PP=2 (each stage a Gated DeltaNet and a gated attention layer) and EP=2 (each
    rank reads its 4 experts' slices of the fused tensors), padded and packed where run, on the batch with images:
    one rank's log-probs, gradient, grad norm and loss; every rank's weights out are the checkpoint's tensors per
    expert, and --save-hf's folder at TP=2 and at EP=2 is the checkpoint itself, experts fused and vision tower
    included, bit for bit."""
    (one,) = qwen3_5_moe_scenario("qwen3_5_moe_1", 1)
    ranks = qwen3_5_moe_scenario("qwen3_5_moe_tp2", 2)
    assert sorted(r["tp2/ranks"][0] for r in ranks) == [0, 1] and all(r["tp2/sequence_parallel"] for r in ranks)
    assert sorted(r["ep2/ranks"][2] for r in ranks) == [0, 1]
    by_stage = {r["pp2/ranks"][1]: r for r in ranks}
    for stage, numbers in ((0, [1, 2]), (1, [3, 4])):
        assert by_stage[stage]["pp2/layer_numbers"] == numbers
        assert by_stage[stage]["pp2/attention_classes"] == ["GatedDeltaNet", "SelfAttention"]
    for name, layouts in (("tp2", ("packed",)), ("pp2", ("padded", "packed")), ("ep2", ("padded", "packed"))):
        for layout in layouts:
            diffs = equiv_diffs([one], ranks, name, layout)
            for key, tol in EQUIV_TOL.items():
                assert diffs[key] <= tol, f"{name} {layout}: max {key} diff {diffs[key]:.3g} > {tol}"
    stored = load_file(tiny_qwen3_5_moe / "model.safetensors")
    per_expert = _stored_per_expert(tiny_qwen3_5_moe)
    for name in ("tp2", "ep2"):
        got = {k: v for r in ranks for k, v in r[f"{name}/weights"].items()}
        assert set(got) == set(per_expert), name
        assert all(torch.equal(got[n], t) for n, t in per_expert.items()), name
        (exported,) = [r[f"{name}/exported"] for r in ranks if f"{name}/exported" in r]
        assert set(exported) == set(stored), name
        for n, t in stored.items():
            assert torch.equal(exported[n], t), (name, n)
