"""tools/convert_hf_to_megatron.py and tools/convert_megatron_to_hf.py.

Round trip HF -> Megatron (TP=2, two gloo processes with torchrun's environment variables) ->
HF (TP=1, one process): every tensor torch.equal (same dtype), the same config and tokenizer
files. The qwen2 case pads the vocab (64 -> 96) so that the export must strip the padding.
Error paths that need no megatron run in this process (the tools check before importing it).
"""

from __future__ import annotations

import json
import shutil
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


@pytest.mark.parametrize("family,pad", [("qwen2", 48), ("llama", 1)])
def test_round_trip_tp2_to_tp1(family, pad, request, tmp_path):
    hf = request.getfixturevalue(f"tiny_{family}")
    mcore, out = tmp_path / "mcore", tmp_path / "hf"
    run_tool("convert_hf_to_megatron", ["--hf-checkpoint", str(hf), "--save", str(mcore),
                                        "--make-vocab-size-divisible-by", str(pad)], world=2)
    from slime_rl.trainer.checkpoint import read_checkpoint_info

    info = read_checkpoint_info(mcore)
    assert info.contents == ("model",) and info.topology["tp"] == 2
    assert info.extra["padded_vocab_size"] == (96 if pad == 48 else 64)
    run_tool("convert_megatron_to_hf", ["--load", str(mcore), "--save", str(out)])
    _assert_same_hf(hf, out)
    if family == "llama":
        # the config of another model: the error names the tensors that do not match
        with pytest.raises(RuntimeError, match=r"linear_qkv\.bias.*output_layer\.weight"):
            run_tool("convert_megatron_to_hf", ["--load", str(mcore), "--save", str(tmp_path / "bad"),
                                                "--hf-config-dir", str(request.getfixturevalue("tiny_qwen2"))])


def test_sharded_export_writer(tmp_path):
    writer = _load_tool("convert_megatron_to_hf").ShardWriter(tmp_path, max_bytes=64 * 64 * 4 + 100)
    tensors = {f"t{i}": torch.full((64, 64), float(i)) for i in range(3)} | {"small": torch.ones(3)}
    for name, t in tensors.items():
        writer.add(name, t)
    files = writer.close()
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["small"] == "model-00003-of-00003.safetensors"
    loaded = {k: v for f in files for k, v in load_file(f).items()}
    assert all(torch.equal(loaded[k], v) for k, v in tensors.items())


def test_unsupported_model_type_and_layout(tiny_qwen2, tmp_path):
    bad = tmp_path / "gpt2"
    shutil.copytree(tiny_qwen2, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    to_mcore = _load_tool("convert_hf_to_megatron").main
    with pytest.raises(ValueError, match=r"model_type 'gpt2' is not supported; known families: \['llama'"):
        to_mcore(["--hf-checkpoint", str(bad), "--save", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match="pipeline-model-parallel-size 2"):
        to_mcore(["--hf-checkpoint", str(tiny_qwen2), "--save", str(tmp_path / "out"),
                  "--pipeline-model-parallel-size", "2"])
    to_hf = _load_tool("convert_megatron_to_hf").main
    with pytest.raises(SystemExit, match="not a Megatron checkpoint"):
        to_hf(["--load", str(tiny_qwen2), "--save", str(tmp_path / "out")])
