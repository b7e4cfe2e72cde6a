"""bench/recipe_pair.py: the commands it plans (both sides of a pair on the same work, each task on its
shipped recipe and that recipe's learning rate) and the targets it reads from the runs' results."""

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import recipe_pair  # noqa: E402


def _args(tmp_path: Path) -> argparse.Namespace:
    """recipe_pair's defaults (its parser's), with the work folder in tmp_path."""
    return argparse.Namespace(model=Path("/m"), out=tmp_path / "s.json", work=tmp_path, steps=150, seeds=[1234, 1],
                              tasks=["basic_arithmetic", "chain_sum"], recipe=recipe_pair.RECIPE, prompts=16,
                              group=8, max_new_tokens=64, heldout=200, warmup=5, peer_args=[])


def _value(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def test_each_pair_shares_its_work_and_ours_runs_the_shipped_recipe(tmp_path):
    args = _args(tmp_path)
    cmds = recipe_pair.plan(args)
    assert len(cmds["runs"]) == 8 and len(cmds["end"]) == 8
    for task in args.tasks:
        shipped = ROOT / "configs" / f"smollm2_{task}_grpo_1gpu.yaml"
        lr = yaml.safe_load(shipped.read_text())["lr"]
        for seed in args.seeds:
            ours, trl = cmds["runs"][f"{task}_seed{seed}_ours"], cmds["runs"][f"{task}_seed{seed}_trl"]
            assert _value(ours, "--ours-config") == str(shipped)
            assert "--skip-trl" in ours and "--skip-ours" in trl and "--trl-no-autocast" in trl
            for flag in ("--data", "--lr", "--seed", "--prompts", "--group", "--max-new-tokens", "--steps", "--task"):
                assert _value(ours, flag) == _value(trl, flag), flag
            assert float(_value(ours, "--lr")) == float(lr) and _value(ours, "--seed") == str(seed)
            assert "--in-order" in ours and "--in-order" in trl
            # each side's held-out evaluation reads the model that side saved
            assert _value(cmds["end"][f"{task}_seed{seed}_ours"], "--model") == _value(ours, "--save-hf")
            assert _value(cmds["end"][f"{task}_seed{seed}_trl"], "--model") == _value(trl, "--trl-save")
    # the training file leaves out the held-out questions the evaluations read
    data = {_value(c, "--out"): c for c in cmds["data"]}
    for task in args.tasks:
        train = data[str(tmp_path / f"train_{task}.jsonl")]
        assert _value(train, "--exclude") == _value(cmds["start"][task], "--data")


def test_summary_targets(tmp_path):
    args = _args(tmp_path)
    args.tasks, args.seeds = ["chain_sum"], [1]
    key = "chain_sum_seed1"
    ours_reward = [0.5] * 130 + [0.9] * 20
    gaps = [1e-4] * 150
    maxes = [1e-3] * 149 + [0.02]
    (tmp_path / f"{key}_ours.json").write_text(json.dumps({
        "ours_reward": ours_reward, "ours_step_s": 1.0, "ours_logprob_abs_diff": gaps,
        "ours_logprob_abs_diff_max": maxes}))
    (tmp_path / f"{key}_trl.json").write_text(json.dumps({"trl_reward": [0.95] * 150, "trl_step_s": 2.0}))
    (tmp_path / "start_chain_sum.log").write_text("noise\nh: n=200 reward_mean=0.45 acc=0.450 max_new_tokens=64\n")
    (tmp_path / f"end_{key}_ours.log").write_text("x: n=200 reward_mean=0.910 acc=0.910 max_new_tokens=64 (3 s)\n")
    (tmp_path / f"end_{key}_trl.log").write_text("x: n=200 reward_mean=0.900 acc=0.900 max_new_tokens=64 (3 s)\n")
    row = recipe_pair.summarize(args, recipe_pair.plan(args))["runs"][key]
    assert abs(row["ours"]["last20_reward"] - 0.9) < 1e-12 and abs(row["trl"]["last20_reward"] - 0.95) < 1e-12
    assert row["reward_target"] is False  # 0.90 < 0.95 - 0.03
    assert abs(row["ours"]["heldout_gain"] - 0.46) < 1e-9 and abs(row["trl"]["heldout_gain"] - 0.45) < 1e-9
    assert row["heldout_target"] is True
    assert row["gap_target"] is True and row["ours"]["gap_max"] == 0.02
    assert row["ours"]["steps_with_a_token_over_0.01"] == 1
    assert "MISS" in recipe_pair.table({"runs": {key: row}})


def test_a_failed_run_is_reported_not_raised(tmp_path):
    args = _args(tmp_path)
    args.tasks, args.seeds = ["chain_sum"], [1]
    (tmp_path / "start_chain_sum.log").write_text("h: n=200 reward_mean=0.2 acc=0.200 max_new_tokens=64\n")
    (tmp_path / "chain_sum_seed1_trl.log").write_text("Traceback ...\nRuntimeError: CUDA out of memory\n")
    row = recipe_pair.summarize(args, recipe_pair.plan(args))["runs"]["chain_sum_seed1"]
    assert row["trl"] == {"error": "RuntimeError: CUDA out of memory"} and "reward_target" not in row
