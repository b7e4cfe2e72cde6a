from pathlib import Path

from slime_rl.config.flags import build_parser
from slime_rl.config.reference import render_flag_reference

ROOT = Path(__file__).resolve().parents[2]


def test_docs_flags_md_matches_the_parser():
    doc = (ROOT / "docs" / "flags.md").read_text()
    assert doc == render_flag_reference(), "docs/flags.md is stale: run python tools/gen_flag_reference.py"


def test_every_flag_is_in_the_reference():
    text = render_flag_reference()
    flags = [s for a in build_parser()._actions for s in a.option_strings if s not in ("-h", "--help")]
    assert len(flags) > 80
    missing = [f for f in flags if f"`{f}`" not in text]
    assert not missing, missing
