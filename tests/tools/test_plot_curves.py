"""bench/plot_curves.py: window means, block means and the pairing summary, checked by hand."""

import json

import pytest

from bench.plot_curves import main, summary, window_means


def test_window_and_block_means_by_hand():
    assert window_means([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]
    values = [0.0] * 50 + [1.0] * 50 + [0.5] * 30
    s = summary(values)
    assert s == {"steps_0_49": 0.0, "steps_50_99": 1.0, "steps_100_149": 0.5, "last_20": 0.5}


def test_reads_either_side_and_writes_the_figure(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    (tmp_path / "a.json").write_text(json.dumps({"ours_reward": [0.0, 1.0, 0.0, 1.0]}))
    (tmp_path / "b.json").write_text(json.dumps({"trl_reward": [1.0, 0.0, 1.0, 0.0], "ours_reward": None}))
    (tmp_path / "c.json").write_text(json.dumps({"ours_reward": []}))
    out = tmp_path / "f.png"
    main(["--out", str(out), f"ours={tmp_path / 'a.json'}", f"TRL={tmp_path / 'b.json'}"])
    printed = capsys.readouterr().out
    assert "ours vs TRL: correlation -1.00, mean difference +0.000" in printed
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(SystemExit, match="c.json: neither"):
        main(["--out", str(out), f"x={tmp_path / 'c.json'}"])
    with pytest.raises(SystemExit, match="LABEL=FILE"):
        main(["--out", str(out), str(tmp_path / "a.json")])
