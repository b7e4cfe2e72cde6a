"""A checkpoint of a model family this trainer does not build is refused in preflight, in one sentence naming its
model_type and the supported families, before any check that reads the model's features from its family (today
--expert-model-parallel-size on DeepSeek-V3 said "a dense model", and a dry run without it exited 0). The
config.json files are the hub's (tests/config/hf_configs)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.train import check_model_features
from slime_rl.train import main as train_main

UNSUPPORTED = Path(__file__).parent / "hf_configs"


def _checkpoint(tmp: Path, config: str, folder: Path = UNSUPPORTED) -> Path:
    """An HF folder holding only config.json (no weights: preflight reads only the config)."""
    hf = tmp / config.removesuffix(".json")
    hf.mkdir(exist_ok=True)
    shutil.copy(folder / config, hf / "config.json")
    return hf


def _base(tmp: Path, hf: Path) -> list[str]:
    (tmp / "d.jsonl").write_text('{"input": "1", "label": "1"}\n')
    return ["--hf-checkpoint", str(hf), "--prompt-data", str(tmp / "d.jsonl"), "--rollout-batch-size", "4",
            "--num-rollout", "1", "--rm-type", "digit"]


@pytest.mark.parametrize("config, model_type", [("deepseek_v3.json", "deepseek_v3"), ("glm4_5_air.json", "glm4_moe")])
@pytest.mark.parametrize("extra", [[], ["--actor-num-nodes", "2", "--actor-num-gpus-per-node", "8",
                                        "--expert-model-parallel-size", "16", "--rollout-batch-size", "16"]],
                         ids=["no-EP", "EP16"])
def test_an_unsupported_family_is_refused_naming_its_model_type(config, model_type, extra, tmp_path):
    with pytest.raises(ConfigError) as info:
        check_model_features(build_config(_base(tmp_path, _checkpoint(tmp_path, config)) + extra))
    message = str(info.value)
    assert f"its config.json names model_type '{model_type}', which is not a model family this trainer builds " \
           "(supported: llama, qwen2, qwen2_5_vl, qwen2_moe, qwen3, qwen3_moe)" in message, message
    assert "dense" not in message


@pytest.mark.parametrize("ep", ["1", "8"])
def test_a_dry_run_of_an_unsupported_family_exits_2_with_that_sentence(ep, tmp_path, capsys):
    hf = _checkpoint(tmp_path, "deepseek_v3.json")
    argv = ["--hf-checkpoint", str(hf), "--prompt-data", "/data/not-here.jsonl", "--rollout-batch-size", "16",
            "--num-rollout", "1", "--rm-type", "math", "--rollout-backend", "sglang", "--actor-num-nodes", "2",
            "--actor-num-gpus-per-node", "8", "--expert-model-parallel-size", ep, "--dry-run", "--cluster", "4x8"]
    assert train_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip().splitlines()[-1] == (
        f"slime-rl train: error: --hf-checkpoint {hf}: its config.json names model_type 'deepseek_v3', which is not a "
        "model family this trainer builds (supported: llama, qwen2, qwen2_5_vl, qwen2_moe, qwen3, qwen3_moe)")
    assert "estimates" not in captured.out
