"""--log-eval-generations: which eval samples are shown, and where they go (a jsonl always, wandb's
table, tensorboard text)."""

from __future__ import annotations

import json

import pytest

from slime_rl.config import ConfigError, LoggingConfig, build_config
from slime_rl.data import Sample
from slime_rl.observability import MetricsLogger
from slime_rl.rollout.eval import pick_generations
from tests.config.test_config import base_argv


def group(prompt: str, label: str, responses: list[str], first_index: int) -> list[Sample]:
    return [Sample(index=first_index + k, group_index=0, prompt=prompt, prompt_ids=[1], label=label, response=r,
                   reward=float(r == label)) for k, r in enumerate(responses)]


def test_pick_takes_one_sample_per_prompt_first_across_sets():
    sets = {"a": [group("p0", "1", ["1", "2"], 0), group("p1", "3", ["4", "3"], 2)],
            "b": [group("q0", "5", ["5", "5"], 0)]}
    picked = pick_generations(sets, 4)
    # the first sample of every prompt (a's, then b's), then the second of the first prompt
    assert [(x["dataset"], x["prompt"], x["response"]) for x in picked] == [
        ("a", "p0", "1"), ("a", "p1", "4"), ("b", "q0", "5"), ("a", "p0", "2")]
    assert picked[0] == {"dataset": "a", "prompt": "p0", "response": "1", "label": "1", "reward": 1.0}
    assert picked[1]["reward"] == 0.0
    assert pick_generations(sets, 0) == [] and len(pick_generations(sets, 100)) == 6  # all there are


def test_flag_needs_eval_data(tmp_path):
    with pytest.raises(ConfigError, match="--log-eval-generations 3 needs --eval-prompt-data"):
        build_config(base_argv(tmp_path) + ["--log-eval-generations", "3"])
    data = str(tmp_path / "data.jsonl")
    cfg = build_config(base_argv(tmp_path) + ["--log-eval-generations", "3", "--eval-interval", "2",
                                              "--eval-prompt-data", "d", data])
    assert cfg.eval.log_generations == 3 and build_config(base_argv(tmp_path)).eval.log_generations == 0
    with pytest.raises(ConfigError, match="--log-eval-generations: must be an integer >= 0, got -1"):
        build_config(base_argv(tmp_path) + ["--log-eval-generations", "-1"])


SAMPLES = [{"dataset": "d", "prompt": "copy 7 |", "response": " 7", "label": "7", "reward": 1.0},
           {"dataset": "d", "prompt": "copy 3", "response": "\n4", "label": "3", "reward": 0.0}]


def test_jsonl_always_and_a_fresh_run_sets_the_old_aside(tmp_path):
    logger = MetricsLogger(LoggingConfig(run_dir=str(tmp_path)))
    logger.start(0)
    logger.log_generations(-1, SAMPLES)
    logger.log_generations(4, SAMPLES[:1])
    logger.log_generations(5, [])  # nothing to log: no line
    logger.close()
    path = tmp_path / "eval_generations.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert rows == [{"step": -1, **SAMPLES[0]}, {"step": -1, **SAMPLES[1]}, {"step": 4, **SAMPLES[0]}]
    resumed = MetricsLogger(LoggingConfig(run_dir=str(tmp_path)))  # resumed at step 3: step 4's line goes
    resumed.start(3)
    resumed.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [-1, -1]
    fresh = MetricsLogger(LoggingConfig(run_dir=str(tmp_path)))
    fresh.start(0)
    fresh.close()
    assert path.read_text() == "" and (tmp_path / "eval_generations.jsonl.old-2").is_file()


def test_wandb_table_and_tensorboard_text(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    cfg = LoggingConfig(run_dir=str(tmp_path), use_wandb=True, wandb_mode="offline", use_tensorboard=True)
    logger = MetricsLogger(cfg)
    logger.start(0)
    logger.log(0, {"eval/d/reward_mean": 0.5})
    logger.log_generations(0, SAMPLES)
    logger.log(1, {"eval/d/reward_mean": 1.0})
    logger.log_generations(1, SAMPLES[:1])
    assert logger._generation_rows == [[0, "d", "copy 7 |", " 7", "7", 1.0], [0, "d", "copy 3", "\n4", "3", 0.0],
                                       [1, "d", "copy 7 |", " 7", "7", 1.0]]  # the table holds every eval's
    logger.close()
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    tables = list(run.glob("files/media/table/eval/generations_*.table.json"))
    assert len(tables) == 2
    last = max((json.loads(t.read_text()) for t in tables), key=lambda t: len(t["data"]))
    assert last["columns"] == ["step", "dataset", "prompt", "response", "label", "reward"]
    assert last["data"] == logger._generation_rows
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    tb.Reload()
    texts = tb.Tensors("eval/generations/text_summary")
    assert [e.step for e in texts] == [0, 1]
    first = texts[0].tensor_proto.string_val[0].decode()
    assert "copy 7 \\| |  7 | 7 | 1.0 |" in first and "<br>4" in first  # | escaped, newline as <br>
