"""bench/logprob_gap_summary.py: the outlier count of a run, checked on a hand-made series."""

import json

import pytest

from bench.logprob_gap_summary import main, summarize


def test_counts_the_steps_with_a_token_over_the_threshold():
    result = {"ours_logprob_abs_diff": [1e-7, 2e-4, None, 3e-5],
              "ours_logprob_abs_diff_max": [1e-5, 0.05, None, 0.02]}
    r = summarize(result, threshold=1e-2)
    assert r["steps"] == 3 and r["steps_over"] == 2
    assert r["first_steps_over"] == [1, 3]  # step indices of the run, the missing step 2 kept in place
    assert r["max_max"] == 0.05 and r["max_median"] == 0.02
    assert r["mean_median"] == 3e-5
    assert summarize(result, threshold=0.03)["steps_over"] == 1


def test_a_result_without_our_side_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="ours_logprob_abs_diff_max"):
        summarize({"trl_reward": [0.1]}, threshold=1e-2)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match="bad.json"):
        main([str(bad)])


def test_writes_one_row_per_run(tmp_path):
    for name, maxes in (("a", [0.1, 0.2]), ("b", [1e-5, 1e-5])):
        (tmp_path / f"{name}.json").write_text(json.dumps({"ours_logprob_abs_diff_max": maxes}))
    main([str(tmp_path / "a.json"), str(tmp_path / "gone.json"), str(tmp_path / "b.json"), "--out",
          str(tmp_path / "s.json")])
    runs = json.loads((tmp_path / "s.json").read_text())["runs"]
    assert runs["a"]["steps_over"] == 2 and runs["b"]["steps_over"] == 0
    assert "gone" not in runs  # a failed run (no file) is left out, the others still summarized
    with pytest.raises(SystemExit, match="no results"):
        main([str(tmp_path / "gone.json")])
