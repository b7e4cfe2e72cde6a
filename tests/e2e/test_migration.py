"""Coming from slime and EasyR1, whole runs on CPU (issue #23's acceptance): a reward function and a
custom generate function written exactly as slime documents them, with slime's own dynamic-sampling
filter named by slime's module path as its scripts name it (the RolloutManager actor resolves it
through config/slime_imports.py), train 2 steps; EasyR1's own example config for Qwen2.5-VL geo3k
(model path and data replaced by a tiny Qwen2.5-VL and local rows; sizes cut to a CPU on the command
line, which wins over the file) trains 2 steps with an EasyR1-style math reward graded by mathruler, as EasyR1's
examples/reward_function/math.py grades (tests/config/easyr1/mathruler_reward.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from slime_rl.config import build_config
from slime_rl.data.vl_counting import make_rows, write_jsonl
from slime_rl.train import preflight, train
from tests.config.test_easyr1_config import write_config
from tests.conftest import ROOT
from tests.loop_checks import digit_data_fixture

digit_data = digit_data_fixture(64, seed=4)


@pytest.mark.slow
def test_slime_style_reward_generate_and_filter_train_two_steps(ray_session, tiny_qwen2, digit_data, tmp_path):
    """slime's extension functions train two steps; the eval before each step goes through the same generate
    function with evaluation=True (as slime's eval does), which scores those samples itself."""
    run = tmp_path / "run"
    evals = tmp_path / "eval.jsonl"
    evals.write_text("".join(digit_data.read_text().splitlines(keepends=True)[:3]))
    cfg = build_config(["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(digit_data), "--run-dir", str(run),
                        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--rollout-batch-size", "2",
                        "--n-samples-per-prompt", "4", "--global-batch-size", "8", "--micro-batch-size", "4",
                        "--rollout-max-response-len", "6", "--num-rollout", "2", "--lr", "0.003",
                        "--over-sampling-batch-size", "2", "--dump-rollouts",
                        "--custom-rm-path", "tests/plugins/slime_style.py:custom_rm",
                        "--custom-generate-function-path", "tests.plugins.slime_style:eval_aware_generate",
                        "--eval-prompt-data", "digits", str(evals), "--eval-interval", "1",
                        "--n-samples-per-eval-prompt", "1",
                        "--dynamic-sampling-filter-path",
                        "slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std"])
    rows = train(*preflight(cfg))
    assert [r["step"] for r in rows] == [0, 1]
    assert [r.get("eval/digits/reward_mean") for r in rows if "eval/digits/reward_mean" in r] and all(
        r["eval/digits/reward_mean"] == 42.0 for r in rows if "eval/digits/reward_mean" in r)
    for r in rows:
        assert r["rollout/groups_kept"] == 2 and np.isfinite(r["train/loss"])
        assert r["rollout/zero_std_group_frac"] == 0.0  # the slime filter dropped every group of equal rewards
        assert r["train/rollout_logprob_abs_diff"] <= 1e-2  # the slime generate kept the engine's log-probs
    for step in (0, 1):
        samples = [json.loads(x) for x in (run / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(samples) == 8
        for s in samples:  # the slime reward: 1 when the response holds the label
            assert s["reward"] == float(str(s["label"]) in s["response"]) and s["response_length"] > 0


@pytest.mark.slow
def test_easyr1_geo3k_config_trains_two_steps_on_a_tiny_vl_model(ray_session, tiny_qwen2_5_vl, tmp_path):
    train_rows = write_jsonl(make_rows(16, seed=1, image_dir=tmp_path / "img", size=56), tmp_path / "train.jsonl")
    val_rows = write_jsonl(make_rows(4, seed=2, image_dir=tmp_path / "img_val", size=56), tmp_path / "val.jsonl")
    reward = f"{ROOT / 'tests' / 'config' / 'easyr1' / 'mathruler_reward.py'}:compute_score"
    path = write_config(tmp_path, model=str(tiny_qwen2_5_vl), train=str(train_rows), val=str(val_rows),
                        edit={"worker.reward.reward_function": reward})
    run = tmp_path / "run"
    cfg = build_config(["--config", str(path), "--run-dir", str(run), "--rollout-backend", "embedded",
                        "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1", "--rollout-num-gpus-per-engine",
                        "1", "--rollout-batch-size", "2", "--global-batch-size", "10", "--micro-batch-size", "5",
                        "--rollout-max-response-len", "4", "--rollout-max-prompt-len", "256", "--min-pixels", "3136",
                        "--max-pixels", "3136", "--num-rollout", "2", "--skip-eval-before-train", "--wandb-mode",
                        "disabled", "--update-weight-buffer-size", "20000"])
    assert cfg.rollout.n_samples_per_prompt == 5 and cfg.algo.use_kl_loss and cfg.algo.eps_clip_high == 0.3
    assert cfg.engine.colocate  # EasyR1's hybrid engine: the engine on the trainer's device, released while it trains
    rows = train(*preflight(cfg))
    assert [r["step"] for r in rows] == [0, 1]
    for r in rows:
        assert np.isfinite(r["train/loss"]) and np.isfinite(r["train/grad_norm"])
        assert "rollout/reward/accuracy" in r and "rollout/reward/format" in r  # the EasyR1 file's extra keys
    assert rows[0]["train/rollout_logprob_abs_diff"] <= 1e-3
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())  # trainer.save_checkpoint_path, at the end
    assert saved, "no checkpoint written at the end of the run"
