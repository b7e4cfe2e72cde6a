"""Fixtures for the rollout tests: a tiny checkpoint whose tokenizer can spell the calculator
example's tags (the default tiny tokenizer has no 'c', '/', '+')."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CALC_LINES = [f"<calc>{a}{op}{b}</calc> <result>{r}</result>"
              for a, op, b, r in [(2, "+", 3, 5), (7, "*", 6, 42), (9, "-", 4, 5), (8, "/", 2, 4)]]


@pytest.fixture(scope="session")
def calc_model(tmp_path_factory) -> Path:
    """Tiny Qwen2 as tools/make_tiny_model.py makes it, its tokenizer also trained on calculator lines."""
    spec = importlib.util.spec_from_file_location("tools_make_tiny_model_calc", ROOT / "tools" / "make_tiny_model.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    digits = tool.corpus_lines
    tool.corpus_lines = lambda seed: digits(seed) + CALC_LINES * 20  # this module object only
    return tool.make_tiny_model(tmp_path_factory.mktemp("tiny_calc"), arch="qwen2", seed=0, vocab_size=80)
