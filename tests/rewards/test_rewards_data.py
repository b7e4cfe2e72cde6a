import asyncio
import json

import pytest

from slime_rl.config import DataConfig, LoggingConfig
from slime_rl.data import DataError, PromptDataset, Sample
from slime_rl.observability import REQUIRED_KEYS, MetricsLogger
from slime_rl.rewards import RewardError, call_reward, digit_reward, load_reward


def sample(response, label="7"):
    return Sample(index=0, group_index=0, prompt="p", prompt_ids=[1], label=label, response=response)


def test_digit_reward_first_digit_decides():
    assert digit_reward(sample(" 7 3")) == 1.0
    assert digit_reward(sample("it is 3 then 7")) == 0.0
    assert digit_reward(sample("none")) == 0.0


def test_custom_reward_by_dotted_path_sync_and_async():
    fn = load_reward(None, "tests.plugins.example_reward:length_reward")
    assert asyncio.run(call_reward(fn, sample("abcd"))) == 4.0
    fn = load_reward(None, "tests.plugins.example_reward.async_label_reward")
    assert asyncio.run(call_reward(fn, sample("x7y"))) == 1.0


def test_reward_errors_name_the_flag():
    with pytest.raises(RewardError, match="--custom-rm-path"):
        load_reward(None, "tests.plugins.example_reward:nope")
    with pytest.raises(RewardError, match="--rm-type"):
        load_reward("nope", None)
    fn = load_reward(None, "tests.plugins.example_reward:bad_reward")
    with pytest.raises(RewardError, match="expected a number"):
        asyncio.run(call_reward(fn, sample("x")))


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dataset_reports_row_of_missing_key(tmp_path):
    f = write(tmp_path / "d.jsonl", [{"input": "a", "label": "1"}, {"input": "b"}])
    with pytest.raises(DataError, match=r"line 2: missing key 'label'"):
        PromptDataset(DataConfig(prompt_data=f), CharTokenizer())


def test_dataset_bad_json_row_and_length_filter(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"input": "a", "label": 1}\n{oops\n')
    with pytest.raises(DataError, match="line 2: not valid JSON"):
        PromptDataset(DataConfig(prompt_data=str(bad)), CharTokenizer())
    f = write(tmp_path / "d.jsonl", [{"input": "ab", "label": 1}, {"input": "abcdef", "label": 2}])
    ds = PromptDataset(DataConfig(prompt_data=f, rollout_max_prompt_len=3), CharTokenizer())
    assert len(ds) == 1 and ds.filtered_too_long == 1


def test_dataset_epochs_shuffle_and_resume(tmp_path):
    f = write(tmp_path / "d.jsonl", [{"input": str(i), "label": i} for i in range(5)])
    cfg = DataConfig(prompt_data=f, rollout_shuffle=True, seed=3)
    ds = PromptDataset(cfg, CharTokenizer())
    first = [r.label for r in ds.next_batch(5)]
    assert sorted(first) == list(range(5))  # one epoch = every row once
    ds.next_batch(2)
    state = ds.state_dict()
    expected = [r.label for r in ds.next_batch(4)]
    resumed = PromptDataset(cfg, CharTokenizer())
    resumed.load_state_dict(state)
    assert [r.label for r in resumed.next_batch(4)] == expected


def test_metrics_jsonl_one_line_per_step(tmp_path):
    logger = MetricsLogger(LoggingConfig(run_dir=str(tmp_path)))
    logger.log(0, {k: 1.0 for k in REQUIRED_KEYS if k != "step"})
    logger.log(1, {"train/loss": float("nan")})
    logger.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1]
    assert set(REQUIRED_KEYS) <= set(lines[0])
    assert lines[1]["train/loss"] == "nan"


def _write_rows(path, steps):
    path.write_text("".join(json.dumps({"step": s, "train/loss": float(s)}) + "\n" for s in steps))


def test_fresh_run_sets_an_old_runs_lines_aside(tmp_path):
    old = tmp_path / "metrics.jsonl"
    _write_rows(old, [0, 1, 2])
    before = old.read_bytes()
    logger = MetricsLogger(LoggingConfig(run_dir=str(tmp_path)))
    backup = logger.start(0)
    logger.log(0, {"train/loss": 9.0})
    logger.close()
    assert [json.loads(x)["train/loss"] for x in old.read_text().splitlines()] == [9.0]
    assert backup.name == "metrics.jsonl.old-1" and backup.read_bytes() == before  # nothing lost
    logger = MetricsLogger(LoggingConfig(run_dir=str(tmp_path)))  # a third run: the next free name
    assert logger.start(0).name == "metrics.jsonl.old-2"
    logger.close()


def test_resumed_run_keeps_the_steps_before_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    _write_rows(path, [0, 1, 2, 3])  # the run died after logging step 3; its checkpoint is after step 1
    with path.open("a") as f:
        f.write('{"step": 4, "train/lo')  # a line cut by the crash
    logger = MetricsLogger(LoggingConfig(run_dir=str(tmp_path)))
    assert logger.start(2) is not None
    logger.log(2, {"train/loss": 20.0})
    logger.close()
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert [(r["step"], r["train/loss"]) for r in rows] == [(0, 0.0), (1, 1.0), (2, 20.0)]
    # a resume that loses nothing makes no copy
    logger = MetricsLogger(LoggingConfig(run_dir=str(tmp_path)))
    assert logger.start(3) is None
    logger.close()
    assert not (tmp_path / "metrics.jsonl.old-2").exists()
