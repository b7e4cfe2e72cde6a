"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py.

Round trips HF -> Megatron (TP=2, PP=2: four gloo processes with torchrun's environment
variables) -> HF at TP=2, PP=2 (tied Qwen2), at TP=1, PP=2 (untied Llama) and at TP=1, PP=1 (GLM-4): every tensor
torch.equal (same dtype), the same config and tokenizer files. The qwen2 case pads the vocab
(64 -> 96) so that the export must strip the padding. Error paths that need no megatron run in
this process (the tools check before importing it).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import ROOT, _load_tool, free_port
from tests.procs import run_processes

TOOLS = ROOT / "tools"


def run_tool(tool: str, args: list[str], world: int = 1, timeout: float = 300) -> list[str]:
    """Run a tool in `world` processes with torchrun's variables; returns the logs (raises with them)."""
    port = free_port()
    dist = [{"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)} if world > 1 else {} for r in range(world)]
    return run_processes([[sys.executable, str(TOOLS / f"{tool}.py"), *args]] * world, f"{tool} {args}", timeout,
                         envs=dist, tail=4000)


def _assert_same_hf(src: Path, dst: Path) -> None:
    want, got = load_file(src / "model.safetensors"), load_file(dst / "model.safetensors")
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert json.loads((dst / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (dst / f).read_bytes() == (src / f).read_bytes(), f


def _convert(hf: Path, mcore: Path, tp: int, pp: int, pad: int) -> None:
    run_tool("convert_hf_to_megatron", ["--hf-checkpoint", str(hf), "--save", str(mcore), "--tp", str(tp),
                                        "--pp", str(pp), "--make-vocab-size-divisible-by", str(pad)], world=tp * pp)


@pytest.fixture(scope="module")
def qwen2_tp2pp2(tiny_qwen2, tmp_path_factory) -> Path:
    """tiny Qwen2 (tied) converted at TP=2, PP=2 (4 processes), vocab 64 padded to 96."""
    mcore = tmp_path_factory.mktemp("qwen2_tp2pp2") / "mcore"
    _convert(tiny_qwen2, mcore, tp=2, pp=2, pad=48)
    return mcore


@pytest.mark.slow
def test_round_trip_tp2_pp2_tied_qwen2(tiny_qwen2, qwen2_tp2pp2, tmp_path):
    """HF -> Megatron (TP=2, PP=2) -> HF (TP=2, PP=2): the embedding on stage 0 and its copy as the
    output layer on stage 1 are both filled on import; export emits the one HF tensor."""
    from slime_rl.trainer.checkpoint import read_checkpoint_info

    info = read_checkpoint_info(qwen2_tp2pp2)
    assert info.contents == ("model",) and (info.topology["tp"], info.topology["pp"]) == (2, 2)
    assert info.extra["padded_vocab_size"] == 96
    out = tmp_path / "hf"
    run_tool("convert_megatron_to_hf", ["--load", str(qwen2_tp2pp2), "--save", str(out), "--tp", "2", "--pp", "2"],
             world=4)
    _assert_same_hf(tiny_qwen2, out)
    assert "lm_head.weight" not in load_file(out / "model.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # the .tmp folder was renamed


@pytest.mark.slow
def test_round_trip_tp2_pp2_untied_llama(tiny_llama, tmp_path):
    """HF -> Megatron (TP=2, PP=2) -> HF at TP=1, PP=2 (resharded on load); then a config that does
    not match the weights: the error names the tensor and both shapes."""
    mcore, out = tmp_path / "mcore", tmp_path / "hf"
    _convert(tiny_llama, mcore, tp=2, pp=2, pad=1)
    run_tool("convert_megatron_to_hf", ["--load", str(mcore), "--save", str(out), "--tp", "1", "--pp", "2"], world=2)
    _assert_same_hf(tiny_llama, out)
    bad = tmp_path / "wider"
    shutil.copytree(tiny_llama, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "intermediate_size": cfg["intermediate_size"] * 2}))
    # megatron's checkpoint keys stack the layers: (layers, 2 x ffn for [gate; up], hidden)
    ffn = cfg["intermediate_size"]
    with pytest.raises(RuntimeError, match=rf"decoder\.layers\.mlp\.linear_fc1\.weight: checkpoint \(2, {2 * ffn}, "
                       rf"64\) vs model \(2, {4 * ffn}, 64\)"):
        run_tool("convert_megatron_to_hf", ["--load", str(mcore), "--save", str(tmp_path / "bad"),
                                            "--hf-config-dir", str(bad)])


@pytest.mark.slow
def test_round_trip_glm4_tp2_pp2_to_tp1(tiny_glm4, tmp_path):
    """GLM-4 (glm4): HF -> Megatron (TP=2, PP=2) -> HF at TP=1, PP=1 (resharded on load): gate_up_proj through
    megatron's SwiGLU-split linear_fc1 (each TP rank's [gate_r; up_r]) and back whole, the post norms on both
    stages, the untied LM head; every tensor bit for bit."""
    mcore, out = tmp_path / "mcore", tmp_path / "hf"
    _convert(tiny_glm4, mcore, tp=2, pp=2, pad=1)
    run_tool("convert_megatron_to_hf", ["--load", str(mcore), "--save", str(out), "--tp", "1", "--pp", "1"])
    _assert_same_hf(tiny_glm4, out)
    assert {"model.layers.1.post_mlp_layernorm.weight", "model.layers.0.mlp.gate_up_proj.weight"} <= set(
        load_file(out / "model.safetensors"))


@pytest.mark.slow
def test_round_trip_mimo_mtp_layer_tp2_to_tp1(tiny_mimo_mtp, tmp_path):
    """MiMo with its multi-token-prediction layer: HF -> Megatron (TP=2, --mtp-num-layers 1: input_proj's swapped
    halves split over the ranks) -> HF at TP=1 (the checkpoint's MTP layer found by its keys), every tensor bit for
    bit; converted without --mtp-num-layers, the export copies the MTP layer unchanged from the HF folder the model came
    from (--hf-config-dir; the checkpoint's own iter_*/hf/ holds no safetensors to copy it from)."""
    mcore, out = tmp_path / "mcore", tmp_path / "hf"
    run_tool("convert_hf_to_megatron", ["--hf-checkpoint", str(tiny_mimo_mtp), "--save", str(mcore), "--tp", "2",
                                        "--mtp-num-layers", "1"], world=2)
    run_tool("convert_megatron_to_hf", ["--load", str(mcore), "--save", str(out)])
    _assert_same_hf(tiny_mimo_mtp, out)
    plain, out2 = tmp_path / "plain", tmp_path / "hf2"
    run_tool("convert_hf_to_megatron", ["--hf-checkpoint", str(tiny_mimo_mtp), "--save", str(plain)])
    run_tool("convert_megatron_to_hf", ["--load", str(plain), "--save", str(out2), "--hf-config-dir",
                                        str(tiny_mimo_mtp)])
    _assert_same_hf(tiny_mimo_mtp, out2)


@pytest.mark.slow
def test_tp2pp2_checkpoint_loads_at_tp1_like_a_direct_conversion(tiny_qwen2, qwen2_tp2pp2, tmp_path):
    """The TP=2, PP=2 conversion loaded by a TP=1 trainer gives the weights and log-probs of a
    conversion made directly at TP=1 (same padded vocab, 96) and of the HF folder itself."""
    from tests.trainer.checkpoint_scenarios import run_scenario

    direct = tmp_path / "mcore_tp1"
    _convert(tiny_qwen2, direct, tp=1, pp=1, pad=96)
    (rec,) = run_scenario("converted", 1, free_port(), tmp_path, {
        "hf": str(tiny_qwen2), "pad": 96, "ckpts": [str(qwen2_tp2pp2), str(direct)]})
    from_hf, (pp_ckpt, tp1_ckpt) = rec["hf"], rec["ckpts"]
    assert set(pp_ckpt["weights"]) == set(tp1_ckpt["weights"]) == set(load_file(tiny_qwen2 / "model.safetensors"))
    for name, t in tp1_ckpt["weights"].items():
        assert torch.equal(pp_ckpt["weights"][name], t) and torch.equal(from_hf["weights"][name], t), name
    assert pp_ckpt["logp"] == tp1_ckpt["logp"] == from_hf["logp"]
    assert len(pp_ckpt["logp"]) > 1 and all(len(r) > 0 for r in pp_ckpt["logp"])


@pytest.mark.slow
def test_sharded_export_writer(tmp_path):
    from slime_rl.trainer.hf_export import ShardWriter

    writer = ShardWriter(tmp_path, max_bytes=64 * 64 * 4 + 100)
    tensors = {f"t{i}": torch.full((64, 64), float(i)) for i in range(3)} | {"small": torch.ones(3)}
    for name, t in tensors.items():
        writer.add(name, t)
    files = writer.close()
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["small"] == "model-00003-of-00003.safetensors"
    loaded = {k: v for f in files for k, v in load_file(f).items()}
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


@pytest.mark.slow
def test_unsupported_model_type_and_layout(tiny_qwen2, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_qwen2, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    to_mcore = _load_tool("convert_hf_to_megatron").main
    import re

    from slime_rl.trainer.convert import FAMILIES

    supported = re.escape(str(sorted(FAMILIES)))  # the registry's families, every one named
    assert "qwen2" in supported and "llama" in supported
    with pytest.raises(ValueError, match=rf"model_type 'gpt2' is not supported; supported model types: {supported}"):
        to_mcore(["--hf-checkpoint", str(bad), "--save", str(tmp_path / "out")])
    # one process cannot hold TP=2 x PP=1 shards, nor 3 stages
    with pytest.raises(SystemExit, match="run exactly TP x PP x EP processes"):
        to_mcore(["--hf-checkpoint", str(tiny_qwen2), "--save", str(tmp_path / "out"), "--tp", "2"])
    with pytest.raises(SystemExit, match="pipeline-model-parallel-size 3 does not divide the 1 processes"):
        to_mcore(["--hf-checkpoint", str(tiny_qwen2), "--save", str(tmp_path / "out"), "--pp", "3"])
    to_hf = _load_tool("convert_megatron_to_hf").main
    with pytest.raises(SystemExit, match="not a Megatron checkpoint"):
        to_hf(["--load", str(tiny_qwen2), "--save", str(tmp_path / "out")])
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_config_that_does_not_match_the_weights(tiny_qwen2, tmp_path):
    """A config of another size: the error (before megatron is imported) names the tensor and both
    shapes; a config with more layers names the missing tensors."""
    cfg = json.loads((tiny_qwen2 / "config.json").read_text())
    to_mcore = _load_tool("convert_hf_to_megatron").main
    for change, pattern in (
        ({"intermediate_size": cfg["intermediate_size"] + 8},
         rf"shape mismatch model\.layers\.0\.mlp\.gate_proj\.weight: safetensors \({cfg['intermediate_size']}, 64\) "
         rf"vs config\.json \({cfg['intermediate_size'] + 8}, 64\)"),
        ({"num_hidden_layers": 3}, r"missing tensors \['model\.layers\.2\.input_layernorm\.weight'"),
        ({"vocab_size": 80}, r"model\.embed_tokens\.weight: safetensors \(64, 64\) vs config\.json \(80, 64\)"),
    ):
        bad = tmp_path / "bad"
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(tiny_qwen2, bad)
        (bad / "config.json").write_text(json.dumps({**cfg, **change}))
        with pytest.raises(ValueError, match=pattern):
            to_mcore(["--hf-checkpoint", str(bad), "--save", str(tmp_path / "out")])


@pytest.mark.slow
def test_round_trip_qwen2_5_vl_tp2_pp2_to_tp1(tiny_qwen2_5_vl, tmp_path):
    """Qwen2.5-VL: HF -> Megatron (TP=2, PP=2; the vision tower lives on stage 0 and is saved in the
    distributed checkpoint replicated over TP) -> HF at TP=1: every tensor, visual.* included, equal;
    the image processor's files come along."""
    mcore, out = tmp_path / "mcore", tmp_path / "hf"
    _convert(tiny_qwen2_5_vl, mcore, tp=2, pp=2, pad=1)
    run_tool("convert_megatron_to_hf", ["--load", str(mcore), "--save", str(out)])
    _assert_same_hf(tiny_qwen2_5_vl, out)
    assert any(n.startswith("visual.") for n in load_file(out / "model.safetensors"))
    proc = "preprocessor_config.json"
    assert (out / proc).read_bytes() == (tiny_qwen2_5_vl / proc).read_bytes()


@pytest.mark.slow
def test_readme_example_alone_starts_its_shards(tiny_qwen2, tmp_path):
    """README's `python tools/convert_hf_to_megatron.py ... --tp 2`, run alone (no torchrun variables):
    the tool starts its 2 processes itself (it used to fail: "run exactly TP x PP processes")."""
    from slime_rl.trainer.checkpoint import read_checkpoint_info

    alone = tmp_path / "alone"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run([sys.executable, str(TOOLS / "convert_hf_to_megatron.py"), "--hf-checkpoint",
                           str(tiny_qwen2), "--save", str(alone), "--tp", "2"], env=env, timeout=300,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "2 shards (TP 2 x PP 1 x EP 1): running 2 processes under torchrun" in done.stdout
    info = read_checkpoint_info(alone)
    assert info.contents == ("model",) and (info.topology["tp"], info.topology["pp"]) == (2, 1)


# ---- mixture of experts (issue 22): experts spread over EP ranks, resharded on load
@pytest.mark.slow
@pytest.mark.parametrize("folder", ["tiny_qwen2_moe"])
def test_round_trip_moe_tp2ep2_to_pp2ep2(folder, tmp_path, request):
    """HF -> Megatron at TP=2 x EP=2 (4 processes: the experts split over ETP=2 and spread over
    EP=2) -> HF at PP=2 x EP=2 (4 processes) and at one process: every tensor, experts included,
    bit-exact under its HF name; the folder loads in transformers with the source's logits.
    Qwen2-MoE: the shared expert split over TP, its gate, the dense layer 2 on the second stage (the tools'
    expert path is the same for every MoE family; each family's names out of the trainer at EP=2 are its own
    tests', e.g. tests/trainer/test_moe.py for Qwen3-MoE)."""
    from transformers import AutoModelForCausalLM

    from slime_rl.trainer.checkpoint import read_checkpoint_info

    src = request.getfixturevalue(folder)

    mcore = tmp_path / "mcore"
    run_tool("convert_hf_to_megatron", ["--hf-checkpoint", str(src), "--save", str(mcore), "--tp", "2",
                                        "--ep", "2"], world=4)
    info = read_checkpoint_info(mcore)
    assert (info.topology["tp"], info.topology["pp"], info.extra["converted_at_ep"]) == (2, 1, 2)
    out = tmp_path / "hf_pp2ep2"
    run_tool("convert_megatron_to_hf", ["--load", str(mcore), "--save", str(out), "--pp", "2", "--ep", "2"], world=4)
    _assert_same_hf(src, out)
    one = tmp_path / "hf_one"
    run_tool("convert_megatron_to_hf", ["--load", str(mcore), "--save", str(one)])
    _assert_same_hf(src, one)
    tokens = torch.tensor([[1, 5, 9, 33, 2, 17, 40]])
    with torch.no_grad():
        want = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)(tokens).logits
        got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(tokens).logits
    assert torch.equal(got, want)


def test_converter_refuses_expert_parallel_without_experts(tiny_llama, tmp_path):
    with pytest.raises(SystemExit, match="--expert-model-parallel-size 2: llama has no experts"):
        _load_tool("convert_hf_to_megatron").main(["--hf-checkpoint", str(tiny_llama), "--save", str(tmp_path / "x"),
                                                  "--tp", "1", "--ep", "2"])
