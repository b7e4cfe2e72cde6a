import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_plot_tool_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    for run in ("a", "b"):
        (tmp_path / run).mkdir()
        rows = [{"step": s, "rollout/reward_mean": s / 10, "train/kl": 1e-3, "train/rollout_logprob_abs_diff": 1e-7,
                 "perf/rollout_s": 1.0, "perf/train_s": 0.5, "perf/weight_sync_s": 0.1} for s in range(5)]
        (tmp_path / run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "curves.png"
    subprocess.run([sys.executable, str(ROOT / "tools" / "plot_metrics.py"), str(tmp_path / "a"),
                    str(tmp_path / "b" / "metrics.jsonl"), "--out", str(out)], check=True, cwd=ROOT)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    from PIL import Image

    assert Image.open(out).size == (18 * 80, 7 * 80)


def test_plot_bad_line_names_file_and_line(tmp_path):
    from slime_rl.observability.plot import read_metrics

    f = tmp_path / "metrics.jsonl"
    f.write_text('{"step": 0}\nnot json\n')
    with pytest.raises(ValueError, match="line 2"):
        read_metrics(f)
