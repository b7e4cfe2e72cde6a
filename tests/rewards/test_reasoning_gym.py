"""`--rm-type reasoning_gym` and tools/make_reasoning_gym_data.py: rows the default flags read, scored
by reasoning-gym's own verifier."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from slime_rl.data import Sample, read_records
from slime_rl.rewards import BUILTIN

reasoning_gym = pytest.importorskip("reasoning_gym")
ROOT = Path(__file__).resolve().parents[2]


def _tool():
    spec = importlib.util.spec_from_file_location("tools_make_rg", ROOT / "tools" / "make_reasoning_gym_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    out = tmp_path_factory.mktemp("rg") / "chain_sum.jsonl"
    _tool().main(["--task", "chain_sum", "--n", "20", "--seed", "3", "--out", str(out)])
    return [r for _, r in read_records(str(out))]


def _sample(row, response: str) -> Sample:
    meta = {k: v for k, v in row.items() if k not in ("input", "label")}
    return Sample(index=0, group_index=0, prompt=row["input"][0]["content"], prompt_ids=[], label=row["label"],
                  response=response, metadata=meta)


def test_rows_match_the_library_and_the_default_keys(rows):
    again = reasoning_gym.create_dataset("chain_sum", size=20, seed=3, min_terms=2, max_terms=2, min_digits=1,
                                         max_digits=2)
    for row, entry in zip(rows, again, strict=True):
        assert set(row) == {"input", "label", "reasoning_gym"}  # --input-key / --label-key defaults + metadata
        assert row["input"][0]["content"].startswith(entry["question"]) and row["label"] == entry["answer"]
        # the answer is the value of the expression, checked by hand rather than by the library
        assert int(row["label"]) == eval(row["reasoning_gym"]["expression"])  # noqa: S307 - digits and +/-


@pytest.mark.parametrize(("response", "expected"), [
    ("{answer}", 1.0), ("  {answer}\n", 1.0), ("The answer is {answer}.", 1.0), ("<answer>{answer}</answer>", 1.0),
    ("{wrong}", 0.0), ("", 0.0), ("{wrong} is not {answer}", 1.0),
])
def test_reward_is_the_verifiers_score(rows, response, expected):
    row = rows[0]
    text = response.format(answer=row["label"], wrong=int(row["label"]) + 1)
    out = BUILTIN["reasoning_gym"](_sample(row, text))
    assert out == {"score": expected, "acc": expected}
    # and it is what the library itself says of the best candidate
    entry = {"question": "", "answer": row["label"], "metadata": row["reasoning_gym"]}
    assert reasoning_gym.get_score_answer_fn("chain_sum")(row["label"], entry) == 1.0


def test_partial_credit_comes_from_the_library():
    # basic_arithmetic gives partial credit for the right number among other text (its own rule);
    # here the last number is wrong, so the whole text is the only candidate that can score
    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=1)[0]
    row = {"input": [{"role": "user", "content": entry["question"]}], "label": entry["answer"],
           "reasoning_gym": entry["metadata"]}
    response = f"{entry['answer']}, or {int(entry['answer']) + 1}"
    score = reasoning_gym.get_score_answer_fn("basic_arithmetic")
    expected = max(score(response, entry), score(str(int(entry["answer"]) + 1), entry))
    assert 0 < expected < 1
    out = BUILTIN["reasoning_gym"](_sample(row, response))
    assert out == {"score": expected, "acc": 0.0}


def test_bad_rows_name_the_field_and_row(rows):
    from slime_rl.rewards.reasoning_gym import ReasoningGymLabelError, check_labels

    metas = [{"reasoning_gym": r["reasoning_gym"]} for r in rows]
    check_labels(metas, [r["label"] for r in rows])
    with pytest.raises(ReasoningGymLabelError, match=r"row 1: metadata\['reasoning_gym'\] is missing"):
        check_labels([metas[0], {}], ["1", "2"])
    with pytest.raises(ReasoningGymLabelError, match="row 0: .*'no_such_task': not a reasoning-gym task"):
        check_labels([{"reasoning_gym": {"source_dataset": "no_such_task"}}], ["1"])
    with pytest.raises(ReasoningGymLabelError, match=r"row 0: the label \(--label-key\) is missing"):
        check_labels(metas[:1], [None])


def test_unknown_task_in_the_tool_names_the_flag(tmp_path):
    with pytest.raises(SystemExit, match="--task 'no_such_task'"):
        _tool().main(["--task", "no_such_task", "--n", "2", "--out", str(tmp_path / "x.jsonl")])


def test_preflight_refuses_rows_without_the_verifiers_metadata(tiny_qwen2, rows, tmp_path):
    from slime_rl.config import build_config
    from slime_rl.data import DataError, write_records
    from slime_rl.train import preflight

    bad = [rows[0], {k: v for k, v in rows[1].items() if k != "reasoning_gym"}]
    data = write_records(bad, tmp_path / "bad.jsonl")
    args = ["--hf-checkpoint", str(tiny_qwen2), "--prompt-data", str(data), "--run-dir", str(tmp_path / "run"),
            "--apply-chat-template", "--rm-type", "reasoning_gym", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--global-batch-size", "4", "--num-rollout", "1",
            "--actor-num-gpus-per-node", "1", "--rollout-num-gpus", "1"]
    with pytest.raises(DataError, match=r"bad\.jsonl \(--rm-type reasoning_gym\): row 1: metadata\['reasoning_gym'\]"):
        preflight(build_config(args))
    write_records(rows[:2], data)
    preflight(build_config(args))  # the tool's rows pass


def test_exclude_makes_a_heldout_set_disjoint_from_the_training_file(tmp_path):
    # reasoning-gym draws row i of seed s from Random(s + i): seed 5's rows are seed 0's rows 5, 6, ...,
    # so a "held-out" file made with another seed repeats the training file, which --exclude must undo
    train, held = tmp_path / "train.jsonl", tmp_path / "held.jsonl"
    tool = _tool()
    tool.main(["--task", "basic_arithmetic", "--n", "300", "--seed", "0", "--out", str(train)])
    train_q = {r["input"][-1]["content"] for _, r in read_records(str(train))}
    plain = tool.make_rows("basic_arithmetic", 40, 5)
    overlap = sum(r["input"][-1]["content"] in train_q for r in plain)
    assert overlap > 0  # otherwise this test proves nothing
    tool.main(["--task", "basic_arithmetic", "--n", "40", "--seed", "5", "--out", str(held), "--exclude", str(train)])
    held_rows = [r for _, r in read_records(str(held))]
    assert len(held_rows) == 40
    assert not {r["input"][-1]["content"] for r in held_rows} & train_q
    assert overlap == 40  # every row: seed 5's rows 0..39 are seed 0's rows 5..44
    # the kept rows are a long plain draw's rows in order, with the repeated ones skipped
    expected = [r for r in tool.make_rows("basic_arithmetic", 1000, 5) if r["input"][-1]["content"] not in train_q][:40]
    assert held_rows == expected
    with pytest.raises(SystemExit, match="--exclude"):
        tool.main(["--task", "chain_sum", "--n", "5", "--out", str(held), "--exclude", str(tmp_path / "missing.jsonl")])
