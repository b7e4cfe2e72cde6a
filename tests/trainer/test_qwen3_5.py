"""qwen3_5 (Qwen3.5-9B / 27B, Qwen3_5ForConditionalGeneration): the trainer trains the vision-language model,
Qwen3-Next's hybrid text decoder (megatron-core's GatedDeltaNet where text_config's layer_types say linear_attention,
gated full attention with q/k norms elsewhere, a quarter of each head rotated, zero-centred norms) with a dense
SwiGLU MLP, the GatedDeltaNet's in_proj as four HF tensors and the checkpoint's names under model.language_model.,
with transformers' vision tower (model.visual.*) on the first stage and 3-D rotary positions whose sections
interleave.

Expected values: tensor names and shapes from the checkpoint transformers writes from the config; the in_proj layout
from megatron's split table, written out here by hand; log-probs, the loss and every gradient (vision tower included)
from transformers' Qwen3_5ForConditionalGeneration in float64 on a batch with images (its own vision forward, its own
get_rope_index) and a text-only row, with test_trainer_megatron.py's tolerances; TP=2 and PP=2 against one rank with
test_trainer_parallel.py's; the weights out and --save-hf's folder (vision tower included) against the checkpoint's
tensors, bit for bit.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer.parallel_scenarios import equiv_diffs
from tests.trainer.qwen3_5_vl_ref import hf_inputs, hf_vl_model, vl_batch
from tests.trainer.test_qwen3_next import EQUIV_TOL, check_one_rank
from tests.trainer.trainer_ref import hf_logprobs, hf_policy_grad
from tests.trainer.trainer_scenarios import scenario_runner

VISUAL = "model.visual."
# a config as Qwen3.5-9B's, small (transformers 5 writes the decoder's fields in text_config)
TEXT = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 32,
        "intermediate_size": 24, "num_hidden_layers": 4, "full_attention_interval": 2, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 6, "linear_value_head_dim": 10,
        "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25,
                            "mrope_section": [1, 1, 0], "mrope_interleaved": True}}
VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
          "num_position_embeddings": 16}


@pytest.fixture(scope="session")
def qwen3_5_batch(tiny_qwen3_5, tmp_path_factory):
    """tests/trainer/qwen3_5_vl_ref.py's batch with images (and a text-only row), and the file the ranks read."""
    folder = tmp_path_factory.mktemp("qwen3_5_rows")
    batch = vl_batch(tiny_qwen3_5, folder)
    torch.save(batch, folder / "batch.pt")
    return batch, folder / "batch.pt"


@pytest.fixture(scope="session")
def qwen3_5_scenario(tiny_qwen3_5, qwen3_5_batch, tmp_path_factory):
    return scenario_runner(tmp_path_factory.mktemp("qwen3_5_scenarios"),
                           {"qwen3_5": tiny_qwen3_5, "qwen3_5_batch": qwen3_5_batch[1]})


@pytest.fixture(scope="session")
def qwen3_5_ref(tiny_qwen3_5, qwen3_5_batch):
    model, batch = hf_vl_model(tiny_qwen3_5), qwen3_5_batch[0]  # Qwen3_5ForConditionalGeneration, the whole model
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    inputs = hf_inputs(model, tiny_qwen3_5, batch)
    loss, grad = hf_policy_grad(model, batch, inputs=inputs)  # its parameter names are the checkpoint's
    return {"logp": hf_logprobs(model, batch, inputs=inputs), "loss": loss, "grad": grad}


@pytest.mark.parametrize("change", [{}, {"full_attention_interval": 4}, {"linear_num_value_heads": 2},
                                    {"layer_types": ["full_attention", "linear_attention"] * 2}])
def test_qwen3_5_registry_is_transformers(change, tmp_path):
    """ModelArch and the registry's tensors against the checkpoint transformers writes from the same config
    (Qwen3_5ForConditionalGeneration): every tensor's name and shape (model.language_model.*, in_proj_qkv / _z / _b /
    _a, conv1d, q_proj's query and gate rows, the dense MLP, lm_head, the vision tower's model.visual.*), nothing
    else; the layer kinds are transformers' layer_types; a quarter of each head rotates, the 3-D sections interleaved
    as rope_parameters say; the planner counts the tower's parameters as transformers' module has them."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from slime_rl.trainer.convert import arch_from_hf_config, hf_shapes

    hf_cfg = Qwen3_5Config(text_config={**TEXT, **change}, vision_config=VISION, tie_word_embeddings=False)
    model = Qwen3_5ForConditionalGeneration(hf_cfg)
    model.save_pretrained(tmp_path, safe_serialization=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    arch = arch_from_hf_config(cfg)
    assert arch.linear_layers == tuple(t == "linear_attention" for t in hf_cfg.text_config.layer_types)
    assert (arch.attention_output_gate, arch.zero_centered_norms, arch.rotary_percent) == (True, True, 0.25)
    assert (arch.num_experts, arch.mrope_section, arch.mrope_interleaved, arch.tie_word_embeddings) == (
        0, (1, 1, 0), True, False)
    assert (arch.vision.model_type, arch.vision.image_token_id) == ("qwen3_5", hf_cfg.image_token_id)
    stored = {n: tuple(t.shape) for f in tmp_path.glob("*.safetensors") for n, t in load_file(f).items()}
    assert any(n.startswith(VISUAL) for n in stored)
    assert hf_shapes(arch) == stored
    from slime_rl.orchestration.estimate import model_shape

    assert model_shape(cfg).vision.params == sum(p.numel() for p in model.model.visual.parameters())


def test_qwen3_5_hub_configs():
    """The hub's config.json of Qwen3.5-9B and 27B (decoder fields in text_config, no layer_types): every fourth layer
    full attention as transformers reads it, 16 linear key heads and 32 (9B) / 48 (27B) value heads of 128."""
    from transformers import AutoConfig

    from slime_rl.trainer.convert import arch_from_hf_config

    for name, layers, hidden, values in (("Qwen3.5-9B", 32, 4096, 32), ("Qwen3.5-27B", 64, 5120, 48)):
        hub = json.loads(open(f"tests/migration/hf_configs/{name}/config.json").read())
        arch = arch_from_hf_config(hub)
        want = AutoConfig.for_model(**hub).text_config.layer_types
        assert arch.linear_layers == tuple(t == "linear_attention" for t in want), name
        assert (arch.num_layers, arch.hidden_size, sum(arch.linear_layers)) == (layers, hidden, layers * 3 // 4)
        assert (arch.linear_num_key_heads, arch.linear_num_value_heads, arch.linear_key_head_dim) == (16, values, 128)
        assert (arch.kv_channels, arch.rotary_percent, arch.num_experts) == (256, 0.25, 0)


def test_qwen3_5_ungated_attention_refused():
    """A text_config whose attn_output_gate is false (SGLang would run the full attention ungated, transformers
    gated) is refused naming the field."""
    from slime_rl.trainer.convert import arch_from_hf_config

    with pytest.raises(ValueError, match="attn_output_gate=False is not supported for model_type 'qwen3_5'"):
        arch_from_hf_config({"model_type": "qwen3_5", "text_config": {**TEXT, "attn_output_gate": False}})


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_5_in_proj_layout_by_hand(tp):
    """in_proj on each TP rank, built here from megatron's split table: [q; k; v; z; b; a] of the rank's key heads (and
    their value heads) from HF's in_proj_qkv ([all q; all k; all v]), in_proj_z, in_proj_b, in_proj_a; and back, bit
    for bit."""
    from slime_rl.trainer.convert import arch_from_hf_config, hf_to_mcore_shard, mcore_shards_to_hf

    arch = arch_from_hf_config({"model_type": "qwen3_5", "text_config": TEXT}, tp_size=tp)
    maps = {pm.mcore: pm for pm in arch.param_maps()}
    pm = maps["decoder.layers.0.self_attention.in_proj.weight"]
    prefix = "model.language_model.layers.0.linear_attn.in_proj_"
    assert pm.hf == tuple(f"{prefix}{x}.weight" for x in ("qkv", "z", "b", "a"))
    gen = torch.Generator().manual_seed(0)
    keys, r, dk, dv, hidden = 2, 2, 6, 10, 32
    q, k = torch.randn(keys, dk, hidden, generator=gen), torch.randn(keys, dk, hidden, generator=gen)
    v, z = torch.randn(keys, r * dv, hidden, generator=gen), torch.randn(keys, r * dv, hidden, generator=gen)
    b, a = torch.randn(keys, r, hidden, generator=gen), torch.randn(keys, r, hidden, generator=gen)
    hf = [torch.cat([q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)]), z.reshape(-1, hidden),
          b.reshape(-1, hidden), a.reshape(-1, hidden)]
    shards = [hf_to_mcore_shard(pm, hf, arch, rank, tp) for rank in range(tp)]
    per = keys // tp
    for rank, shard in enumerate(shards):
        mine = slice(rank * per, (rank + 1) * per)
        assert torch.equal(shard, torch.cat([t[mine].reshape(-1, hidden) for t in (q, k, v, z, b, a)]))
    back = dict(mcore_shards_to_hf(pm, shards, arch))
    assert all(torch.equal(back[n], t) for n, t in zip(pm.hf, hf, strict=True))


@pytest.mark.slow
def test_one_rank_qwen3_5_equals_hf(qwen3_5_scenario, qwen3_5_ref, tiny_qwen3_5):
    """The trainer's Qwen3.5 (GatedDeltaNet in layers 0 and 2 on torch in place of fla, gated attention in 1 and 3,
    zero-centred norms, dense MLPs; the vision tower on the first stage, its features at the image pads, interleaved
    3-D positions) on rows with one and two images and a text-only row, padded and packed: HF's float64 log-probs,
    loss and gradient of every tensor, the vision tower's included (and not zero); the weights out and weight sync's
    sources are the checkpoint's tensors, the tower's under model.visual.*."""
    (one,) = qwen3_5_scenario("qwen3_5_1", 1)
    assert one["base/attention_classes"] == ["GatedDeltaNet", "SelfAttention"] * 2
    check_one_rank(one, qwen3_5_ref, load_file(tiny_qwen3_5 / "model.safetensors"), rotary=8)
    tower = {n: g for n, g in qwen3_5_ref["grad"].items() if n.startswith(VISUAL)}
    assert len(tower) == 21 and all(float(g.abs().max()) > 0 for g in tower.values())


@pytest.mark.slow
def test_qwen3_5_tp2_pp2_equal_one_rank(qwen3_5_scenario, tiny_qwen3_5):
    """TP=2 (packed, sequence parallel; each rank one Gated DeltaNet key head and its two value heads, one query group,
    the whole vision tower) and PP=2 (padded and packed; each stage a Gated DeltaNet and a gated attention layer, the
    tower on the first, the 3-D positions on both) on the batch with images: one rank's log-probs, gradient, grad norm
    and loss; every TP rank's weights out, --save-hf's folder and a model-only --save loaded back into zeroed
    parameters are the whole checkpoint, vision tower included, bit for bit."""
    (one,) = qwen3_5_scenario("qwen3_5_1", 1)
    ranks = qwen3_5_scenario("qwen3_5_tp2", 2)
    assert sorted(r["tp2/ranks"][0] for r in ranks) == [0, 1]
    by_stage = {r["pp2/ranks"][1]: r for r in ranks}
    for stage, numbers in ((0, [1, 2]), (1, [3, 4])):
        assert by_stage[stage]["pp2/layer_numbers"] == numbers
        assert by_stage[stage]["pp2/attention_classes"] == ["GatedDeltaNet", "SelfAttention"]
    assert any(n.startswith(VISUAL) for n in by_stage[0]["pp2/packed/grad"])
    assert not any(n.startswith(VISUAL) for n in by_stage[1]["pp2/packed/grad"])
    for name, layouts in (("tp2", ("packed",)), ("pp2", ("padded", "packed"))):
        for layout in layouts:
            diffs = equiv_diffs([one], ranks, name, layout)
            for key, tol in EQUIV_TOL.items():
                assert diffs[key] <= tol, f"{name} {layout}: max {key} diff {diffs[key]:.3g} > {tol}"
    want = load_file(tiny_qwen3_5 / "model.safetensors")
    (exported,) = [r["tp2/exported"] for r in ranks if "tp2/exported" in r]
    assert all(r["tp2/zeroed"] == 0 for r in ranks)
    for r in ranks:
        assert set(r["tp2/weights"]) == set(r["tp2/reloaded"]) == set(want)
    assert set(exported) == set(want)
    for n, t in want.items():
        assert torch.equal(exported[n], t), n
        assert all(torch.equal(r["tp2/weights"][n], t) and torch.equal(r["tp2/reloaded"][n], t) for r in ranks), n


def test_qwen3_5_without_vision_config_is_its_text_decoder(tmp_path):
    """A config.json without vision_config (a text-only file) builds the text decoder alone: no tower, 1-D positions,
    the planner counts no tower; --save-hf / convert_megatron_to_hf copy model.visual.* and mtp.* from the HF folder
    the model came from (refused in one sentence without its safetensors), while a config with the tower copies only
    mtp.* (none in this checkpoint)."""
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    from slime_rl.orchestration.estimate import model_shape
    from slime_rl.trainer.convert import arch_from_hf_config
    from slime_rl.trainer.hf_export import passthrough_names

    text_only = {"model_type": "qwen3_5", "text_config": TEXT}
    arch = arch_from_hf_config(text_only)
    assert (arch.vision, arch.mrope_section, arch.mrope_interleaved, model_shape(text_only).vision) == (
        None, None, False, None)
    with pytest.raises(ValueError, match=r"model_type 'qwen3_5' exports its mtp\.\*, model\.visual\.\* tensors"):
        passthrough_names(arch, tmp_path)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=TEXT, vision_config=VISION)).save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert passthrough_names(arch, tmp_path) == sorted(n for n in stored if n.startswith(VISUAL))
    whole = arch_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert whole.vision is not None and passthrough_names(whole, tmp_path) == []


def test_qwen3_5_rows_with_images_need_the_vision_config(tiny_qwen3_5, tmp_path):
    """Image rows load for the tiny checkpoint (Qwen3.5's processor: patch 16, merge 2; one <|image_pad|> per merged
    patch), and are refused in one sentence naming the file when config.json has no vision_config (the trainer would
    build the text decoder alone), before any image is read."""
    import shutil
    import types

    from transformers import AutoTokenizer

    from slime_rl.data.readers import DataError
    from slime_rl.data.vl import VisionRows
    from tests.engines.vl_testlib import write_pictures

    cfg = types.SimpleNamespace(prompt_data=str(tmp_path / "d.jsonl"), image_key="images", min_pixels=None,
                                max_pixels=None)
    write_pictures(tmp_path)
    rows = VisionRows(cfg, AutoTokenizer.from_pretrained(tiny_qwen3_5), tmp_path, None)
    ((_, grid),) = rows.images_of({"images": ["a.png"]}, "<image> how many?")
    assert grid[0] == 1 and 4 <= grid[1] * grid[2] // 4 <= 64  # the processor's 4 to 64 merged patches
    text_only = tmp_path / "text_only"
    shutil.copytree(tiny_qwen3_5, text_only)
    config = json.loads((text_only / "config.json").read_text())
    del config["vision_config"]
    (text_only / "config.json").write_text(json.dumps(config))
    rows = VisionRows(cfg, AutoTokenizer.from_pretrained(text_only), tmp_path, None)
    with pytest.raises(DataError, match=r"^.*d\.jsonl: rows have images \('images', --image-key\) but .*text_only's "
                                        r"config\.json \(model_type 'qwen3_5'\) has no vision_config: .*"):
        rows.images_of({"images": ["a.png"]}, "<image> how many?")
