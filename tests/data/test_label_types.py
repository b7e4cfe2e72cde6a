"""Label types per reward type, checked at load: every bad row named by its 1-based line, up to a cap."""

from __future__ import annotations

import json

import pytest

from slime_rl.config import DataConfig
from slime_rl.data import DataError, PromptDataset
from slime_rl.data.readers import MAX_ERRORS_SHOWN
from slime_rl.rewards.labels import label_problem


class CharTokenizer:
    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) for c in text]}


def write_lines(path, labels, blank_after=None):
    """One row per label; a blank line after row `blank_after` (editors count it, so lines shift)."""
    lines = []
    for i, label in enumerate(labels):
        lines.append(json.dumps({"input": f"q{i}", "label": label}))
        if i == blank_after:
            lines.append("")
    path.write_text("\n".join(lines) + "\n")
    return path


def load(path, rm_type, custom=None):
    return PromptDataset(DataConfig(prompt_data=str(path)), CharTokenizer(), label_check=label_problem(rm_type, custom))


def test_digit_labels_must_be_one_digit_and_every_bad_line_is_named(tmp_path):
    #        line: 1    2     3    4      5     6    7 (blank)  8     9
    labels = ["7", None, 3, [1], "12", True, 0, " 5 ", 4.0]
    f = write_lines(tmp_path / "d.jsonl", labels, blank_after=6)
    with pytest.raises(DataError) as err:
        load(f, "digit")
    msg = str(err.value)
    # bad by hand: null (line 2), a list (4), two digits (5), a boolean (6), a float (10: str(4.0) is "4.0")
    assert "5 bad row(s) of 9" in msg
    for line, kind in [(2, "is null"), (4, "is list"), (5, "is '12'"), (6, "is bool"), (10, "is float")]:
        assert f"line {line}: 'label' (--label-key) {kind}" in msg, (line, msg)
    for good in (1, 3, 7, 8, 9):
        assert f"line {good}:" not in msg
    # the same rows pass where the reward decides itself (custom reward) or reads no label
    assert len(load(f, "digit", custom="my.module:reward").rows) == 9
    assert len(load(f, "format").rows) == 9


def test_math_and_f1_label_types(tmp_path):
    labels = ["1/2", 3, 2.5, None, "", ["1"], {"a": 1}, True, float("nan")]
    f = tmp_path / "m.jsonl"
    f.write_text("\n".join(json.dumps({"input": f"q{i}", "label": x}) for i, x in enumerate(labels)) + "\n")
    with pytest.raises(DataError) as err:
        load(f, "math")
    msg = str(err.value)
    assert "6 bad row(s) of 9" in msg  # null, "", list, dict, bool, NaN
    assert "line 4: 'label' (--label-key) is null" in msg and "line 5: 'label' (--label-key) is an empty string" in msg
    assert "line 6:" in msg and "line 7:" in msg and "line 8:" in msg and "line 9:" in msg and "line 1:" not in msg
    for rm in ("dapo", "math_format"):
        with pytest.raises(DataError, match="6 bad row"):
            load(f, rm)
    # f1 also takes a list of answers (row 6), still not null, "", a dict, a bool or NaN
    with pytest.raises(DataError) as err:
        load(f, "f1")
    assert "5 bad row(s) of 9" in str(err.value) and "line 6:" not in str(err.value)
    g = write_lines(tmp_path / "f.jsonl", [["a", "b"], [], ["a", None]])
    with pytest.raises(DataError) as err:
        load(g, "f1")
    assert "line 2: 'label' (--label-key) is an empty list" in str(err.value)
    assert "line 3: 'label' (--label-key) item 1 is null" in str(err.value)


def test_many_bad_labels_are_capped_then_counted(tmp_path):
    n_bad = MAX_ERRORS_SHOWN + 7
    f = write_lines(tmp_path / "many.jsonl", ["1"] + [None] * n_bad)
    with pytest.raises(DataError) as err:
        load(f, "digit")
    msg = str(err.value)
    assert f"{n_bad} bad row(s) of {n_bad + 1}" in msg
    shown = [f"line {k}:" for k in range(2, 2 + MAX_ERRORS_SHOWN)]
    assert all(s in msg for s in shown) and f"line {2 + MAX_ERRORS_SHOWN}:" not in msg
    assert "... and 7 more" in msg


def test_preflight_checks_labels_with_the_flags_reward(tiny_qwen2, tmp_path):
    from slime_rl.config import build_config
    from slime_rl.train import preflight

    f = write_lines(tmp_path / "p.jsonl", ["3", None, "4"])
    args = ["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(f), "--run-dir", str(tmp_path / "r"),
            "--rollout-batch-size", "1", "--n-samples-per-prompt", "2", "--micro-batch-size", "2",
            "--rollout-max-response-len", "8", "--num-rollout", "1"]
    with pytest.raises(DataError, match=r"line 2: 'label' \(--label-key\) is null; --rm-type digit"):
        preflight(build_config(args + ["--rm-type", "digit"]))
    preflight(build_config(args + ["--rm-type", "format"]))  # reads no label: loads


def test_lines_that_are_no_record_and_bad_labels_are_reported_together(tmp_path):
    """A line that is not JSON used to hide the bad labels of the other lines until it was fixed."""
    f = tmp_path / "mixed.jsonl"
    lines = [json.dumps({"input": "q0", "label": "1"}), "{not json", json.dumps({"input": "q2", "label": None}),
             json.dumps(["a", "list"]), json.dumps({"input": "q4", "label": "12"})]
    f.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError) as err:
        load(f, "digit")
    msg = str(err.value)
    assert "4 bad row(s) of 5" in msg
    order = [msg.index(f"line {k}: ") for k in (2, 3, 4, 5)]  # in the file's order
    assert order == sorted(order) and "line 1:" not in msg
    assert "line 2: not valid JSON" in msg and "line 3: 'label' (--label-key) is null" in msg
    assert "line 4: expected a JSON object, got list" in msg and "line 5: 'label' (--label-key) is '12'" in msg
