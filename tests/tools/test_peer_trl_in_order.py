"""bench/peer_trl.py --in-order: our side reads the recipe with rollout-shuffle false and nothing else changed.

Both sides then train step k on the file's prompts 16k..16k+15 (TRL's RepeatSampler without shuffle yields
its rows in order); a shuffled recipe would pair each TRL step with other prompts.
"""

from pathlib import Path

import yaml

from bench.peer_trl import in_order_recipe

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "configs" / "smollm2_chain_sum_grpo_1gpu.yaml"


def test_in_order_recipe_turns_the_shuffle_off_and_keeps_the_rest(tmp_path):
    original = yaml.safe_load(RECIPE.read_text())
    assert original["rollout-shuffle"] is True  # else this test checks nothing
    made = in_order_recipe(RECIPE, tmp_path / "r.yaml")
    derived = yaml.safe_load(made.read_text())
    assert derived.pop("rollout-shuffle") is False
    original.pop("rollout-shuffle")
    assert derived == original


def test_our_config_parses_the_derived_recipe_unshuffled(tmp_path):
    from slime_rl.config.load import parse_flags

    made = in_order_recipe(RECIPE, tmp_path / "r.yaml")
    args, _ = parse_flags(["--config", str(made)])
    assert args.rollout_shuffle is False
    shuffled, _ = parse_flags(["--config", str(RECIPE)])
    assert shuffled.rollout_shuffle is True
