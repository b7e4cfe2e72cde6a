"""Flags that depend on the checkpoint being vision-language are checked in preflight, before any
actor starts, with errors that name the flag."""

from __future__ import annotations

from pathlib import Path

import pytest

from slime_rl.config import ConfigError, build_config
from slime_rl.train import check_model_features


def _cfg(model, *extra: str):
    data = Path(model) / "prompts.jsonl"  # never read here
    data.write_text('{"problem": "1", "answer": "1"}\n')
    return build_config(["--hf-checkpoint", str(model), "--prompt-data", str(data), "--rollout-batch-size", "4",
                         "--global-batch-size", "4", "--num-rollout", "1", "--rm-type", "digit", *extra])


def test_freeze_vision_tower_needs_a_vision_checkpoint(tiny_qwen2, tiny_qwen2_5_vl):
    with pytest.raises(ConfigError, match="--freeze-vision-tower.*qwen2"):
        check_model_features(_cfg(tiny_qwen2, "--freeze-vision-tower"))
    check_model_features(_cfg(tiny_qwen2_5_vl, "--freeze-vision-tower"))  # accepted


@pytest.mark.parametrize("extra, flag", [
    (["--context-parallel-size", "2", "--actor-num-gpus-per-node", "2"], "--context-parallel-size"),
    (["--advantage-estimator", "ppo"], "--advantage-estimator"),
])
def test_unsupported_combinations_with_images_are_refused(tiny_qwen2_5_vl, extra, flag):
    with pytest.raises(ConfigError, match=flag):
        check_model_features(_cfg(tiny_qwen2_5_vl, *extra))


def test_missing_config_json_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match="--hf-checkpoint.*config.json"):
        check_model_features(_cfg(tmp_path))
