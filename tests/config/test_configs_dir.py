"""Every recipe in configs/ parses with the real parser: no unknown keys, valid combinations."""

from pathlib import Path

import pytest

from slime_rl.config import build_config

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.name for r in RECIPES])
def test_recipe_parses(recipe):
    import yaml

    keys = {k.replace("_", "-") for k in yaml.safe_load(recipe.read_text())}
    needed = {"hf-checkpoint": "/models/x", "prompt-data": "/data/x.jsonl", "rollout-batch-size": "4",
              "num-rollout": "1", "rm-type": "digit"}
    argv = ["--config", str(recipe)]
    if "num-epoch" in keys:
        del needed["num-rollout"]
    for k, v in needed.items():
        if k not in keys:
            argv += [f"--{k}", v]
    cfg = build_config(argv, check_paths=False)
    assert cfg.rollout.num_rollout >= 1
    if cfg.data.format_prompt:  # recipes name it relative to the repository root (where launch/ runs)
        from slime_rl.data.dataset import load_format_prompt

        assert load_format_prompt(str(ROOT / cfg.data.format_prompt)).render(content="Q?").startswith("Q?")
    if cfg.reward.rm_type:
        from slime_rl.rewards import BUILTIN

        assert cfg.reward.rm_type in BUILTIN or cfg.reward.rm_type == "remote_rm"


def test_there_are_recipes():
    assert RECIPES


def test_fp32_chain_sum_recipe_is_the_bf16_one_in_fp32():
    """configs/smollm2_chain_sum_grpo_1gpu_fp32.yaml is the measured fp32 variant (BENCHMARKS.md, 2026-12-03):
    a change to the bf16 recipe's settings must reach it, or its numbers describe another recipe."""
    import yaml

    bf16 = yaml.safe_load((ROOT / "configs" / "smollm2_chain_sum_grpo_1gpu.yaml").read_text())
    fp32 = yaml.safe_load((ROOT / "configs" / "smollm2_chain_sum_grpo_1gpu_fp32.yaml").read_text())
    assert bf16.pop("bf16") is True and fp32.pop("bf16") is False
    assert fp32.pop("no-pack-sequences") is True and "no-pack-sequences" not in bf16
    assert fp32 == bf16
    argv = ["--hf-checkpoint", "/m", "--prompt-data", "/d.jsonl"]
    cfg = build_config(["--config", str(ROOT / "configs" / "smollm2_chain_sum_grpo_1gpu_fp32.yaml"), *argv],
                       check_paths=False)
    assert cfg.model.bf16 is False and cfg.trainer.pack_sequences is False
