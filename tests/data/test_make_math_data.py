"""tools/make_math_data.py: the synthetic math set loads as prompts and its answers are right and checkable."""

from __future__ import annotations

import ast
import operator
from fractions import Fraction

import pytest

from slime_rl.config import DataConfig
from slime_rl.data import PromptDataset, read_records
from slime_rl.rewards import is_equivalent
from tests.conftest import _load_tool

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def exact(expr: str) -> Fraction:
    """Evaluate the tool's metadata expression independently: + - * / over Fraction(...) and ints."""
    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp):
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.Constant):
            return Fraction(node.value)
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "Fraction":
            return Fraction(*[ev(n) for n in node.args])
        raise AssertionError(f"unexpected node {ast.dump(node)}")

    return ev(ast.parse(expr, mode="eval").body)


def as_fraction(answer: str) -> Fraction:
    """'-\\frac{3}{4}' / '2.75' / '-12' -> an exact Fraction (the answer spellings the tool writes)."""
    if "\\frac" in answer:
        sign = -1 if answer.startswith("-") else 1
        num, den = answer.split("\\frac{")[1].rstrip("}").split("}{")
        return sign * Fraction(int(num), int(den))
    return Fraction(answer)


@pytest.fixture(scope="module")
def tool():
    return _load_tool("make_math_data")


def test_helpers_spell_answers_like_math12k(tool):
    assert tool.latex(Fraction(-3, 4)) == "-\\frac{3}{4}"
    assert tool.latex(Fraction(6, 3)) == "2"
    assert tool.decimal(Fraction(11, 4)) == "2.75"
    assert tool.decimal(Fraction(-1, 20)) == "-0.05"


def test_rows_are_math12k_shaped_correct_and_checkable(tool, tmp_path):
    path = tool.main(["--out", str(tmp_path / "m.jsonl"), "--n", "300", "--seed", "0"])
    rows = [r for _, r in read_records(path)]
    assert len(rows) == 300
    assert all(set(r) == {"problem", "answer", "metadata"} for r in rows)
    assert {r["metadata"]["kind"] for r in rows} == {"integer", "fraction", "decimal", "linear", "percent"}
    assert any("\\frac" in r["answer"] for r in rows) and any("." in r["answer"] for r in rows)
    for r in rows:
        value = exact(r["metadata"]["expression"])
        assert as_fraction(r["answer"]) == value, r
        assert "\\boxed{}" in r["problem"]
    for r in rows[:40]:  # the math reward accepts the right answer and rejects a neighbour
        assert is_equivalent(f"So the answer is \\boxed{{{r['answer']}}}.", r["answer"])
        wrong = exact(r["metadata"]["expression"]) + 1
        assert not is_equivalent(f"\\boxed{{{wrong.numerator}/{wrong.denominator}}}", r["answer"])


def test_same_seed_same_rows_and_slime_style_loads_with_chat_template(tool, tmp_path, tiny_qwen2):
    from transformers import AutoTokenizer

    assert tool.make_problems(20, seed=3) == tool.make_problems(20, seed=3)
    assert tool.make_problems(20, seed=3) != tool.make_problems(20, seed=4)
    path = tool.main(["--out", str(tmp_path / "s.parquet"), "--n", "10", "--style", "slime"])
    cfg = DataConfig(prompt_data=str(path), input_key="prompt", label_key="label", apply_chat_template=True)
    ds = PromptDataset(cfg, AutoTokenizer.from_pretrained(tiny_qwen2), metadata_key="metadata")
    assert len(ds) == 10
    assert ds.rows[0].prompt.startswith("<|im_start|>user\nCompute $")
    assert ds.rows[0].metadata["kind"] == "integer"
