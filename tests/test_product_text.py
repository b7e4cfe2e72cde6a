"""The product speaks of itself: docs, comments, configs, code, tests and result file names name dates,
commits and commands, never how the work was organised (the word session or stop followed by a run
number, or a file name ending in such a counter).
Raw result files keep their recorded content; their names are checked."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORDING = re.compile(r"\b(sessions? [0-9]+|stop [0-9]+|session[0-9]+)\b", re.IGNORECASE)
NAME = re.compile(r"(_s[0-9]{1,2}[._]|session|_stop[0-9])", re.IGNORECASE)


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def test_no_work_organisation_in_product_text():
    hits = []
    for name in _tracked():
        path = ROOT / name
        if name.startswith("bench/results/") or not path.is_file() or path.suffix in (".png", ".gz", ".tgz"):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        hits += [f"{name}:{i}: {m.group(0)}" for i, line in enumerate(text.splitlines(), 1)
                 for m in WORDING.finditer(line)]
    assert not hits, "\n".join(hits[:20])


def test_result_file_names_carry_no_run_counter():
    bad = [n for n in _tracked() if n.startswith("bench/results/") and NAME.search(Path(n).name)]
    assert not bad, bad
