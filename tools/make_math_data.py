"""Make a synthetic math dataset in the math12k shape, for smoke tests of the `math`/`dapo` rewards.

Why: real math sets (EasyR1's `hiyouga/math12k`, slime's `dapo-math-17k`) need a download; these
few hundred problems exercise the same path offline, with answers the `math` reward can check:
integers, reduced fractions written as LaTeX (`\\frac{3}{4}`) and terminating decimals.

Shapes (`--style`):
- `math12k` (default, EasyR1): {"problem": str, "answer": str, "metadata": {...}}; train with
  `--input-key problem --label-key answer --metadata-key metadata`.
- `slime` (dapo-math-17k): {"prompt": [{"role": "user", "content": str}], "label": str,
  "metadata": {...}}; train with `--input-key prompt --label-key label --apply-chat-template`.

`metadata` holds the problem kind and, for arithmetic, the expression (Python syntax over exact
fractions) that the answer is the value of, so a test can recompute every answer independently.
The format follows the output's suffix: .jsonl, .json or .parquet.

    python tools/make_math_data.py --out data/math_synth.jsonl --n 300 --seed 0
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from slime_rl.data import write_records

SUFFIX = " Put your final answer within \\boxed{}."


def latex(value: Fraction) -> str:
    """An exact answer as math12k writes it: '-3', '\\frac{3}{4}', '-\\frac{1}{2}'."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def decimal(value: Fraction) -> str:
    """A terminating decimal without trailing zeros: Fraction(11, 4) -> '2.75'."""
    den = value.denominator
    while den % 2 == 0:
        den //= 2
    while den % 5 == 0:
        den //= 5
    assert den == 1, f"{value} has no terminating decimal"
    text = f"{float(value):.6f}".rstrip("0").rstrip(".")
    assert Fraction(text) == value, (text, value)
    return text


def _frac(rng: random.Random) -> Fraction:
    """A proper-looking fraction that is not a whole number (2/2 would print as \\frac{1}{1})."""
    while True:
        value = Fraction(rng.randint(1, 9), rng.randint(2, 12))
        if value.denominator > 1:
            return value


def integer_arithmetic(rng: random.Random) -> tuple[str, str, dict]:
    a, b, c = rng.randint(-50, 99), rng.randint(2, 19), rng.randint(-30, 30)
    op = rng.choice(["+", "-"])
    expr = f"{a} * {b} {op} {c}"
    value = Fraction(a) * b + (c if op == "+" else -c)
    problem = f"Compute ${a} \\times {b} {op} {c if c >= 0 else f'({c})'}$."
    return problem, latex(value), {"kind": "integer", "expression": expr}


def fraction_sum(rng: random.Random) -> tuple[str, str, dict]:
    x, y = _frac(rng), _frac(rng)
    op = rng.choice(["+", "-"])
    value = x + y if op == "+" else x - y
    expr = f"Fraction({x.numerator}, {x.denominator}) {op} Fraction({y.numerator}, {y.denominator})"
    problem = (f"What is $\\frac{{{x.numerator}}}{{{x.denominator}}} {op} \\frac{{{y.numerator}}}{{{y.denominator}}}$? "
               "Express your answer as a common fraction in lowest terms.")
    return problem, latex(value), {"kind": "fraction", "expression": expr}


def decimal_product(rng: random.Random) -> tuple[str, str, dict]:
    x = Fraction(rng.randint(1, 99), rng.choice([4, 5, 10, 20, 25]))
    y = rng.randint(2, 12)
    value = x * y
    expr = f"Fraction('{decimal(x)}') * {y}"
    return f"Compute ${decimal(x)} \\times {y}$ as a decimal.", decimal(value), {"kind": "decimal", "expression": expr}


def linear_equation(rng: random.Random) -> tuple[str, str, dict]:
    a = rng.choice([n for n in range(-9, 10) if n not in (0, 1)])
    x = Fraction(rng.randint(-20, 20), rng.choice([1, 1, 2, 3, 4]))
    b = rng.randint(-20, 20)
    c = a * x + b
    if c.denominator != 1:  # keep the equation's numbers integers; scale both sides
        a, b, c = a * c.denominator, b * c.denominator, c * c.denominator
    expr = f"(Fraction({c.numerator}) - {b}) / {a}"
    problem = f"Solve for $x$: ${a}x {'+' if b >= 0 else '-'} {abs(b)} = {c.numerator}$."
    return problem, latex(x), {"kind": "linear", "expression": expr}


def percent_of(rng: random.Random) -> tuple[str, str, dict]:
    p, n = rng.choice([5, 10, 12, 15, 20, 25, 30, 40, 50, 75]), rng.randint(1, 400)
    value = Fraction(p, 100) * n
    expr = f"Fraction({p}, 100) * {n}"
    answer = latex(value) if value.denominator == 1 else decimal(value)
    return f"What is ${p}\\%$ of ${n}$?", answer, {"kind": "percent", "expression": expr}


KINDS: tuple[Callable[[random.Random], tuple[str, str, dict]], ...] = (
    integer_arithmetic, fraction_sum, decimal_product, linear_equation, percent_of)


def make_problems(n: int, seed: int, style: str = "math12k", suffix: str = SUFFIX) -> list[dict]:
    """n rows, the kinds in turn (so every kind is present), numbers drawn from `seed`."""
    if style not in ("math12k", "slime"):
        raise ValueError(f"--style {style!r}: expected 'math12k' or 'slime'")
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        problem, answer, metadata = KINDS[i % len(KINDS)](rng)
        text = problem + suffix
        if style == "math12k":
            rows.append({"problem": text, "answer": answer, "metadata": metadata})
        else:
            rows.append({"prompt": [{"role": "user", "content": text}], "label": answer, "metadata": metadata})
    return rows


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="data/math_synth.jsonl", help="output file (.jsonl, .json or .parquet)")
    parser.add_argument("--n", type=int, default=300, help="number of problems")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--style", choices=["math12k", "slime"], default="math12k")
    parser.add_argument("--no-suffix", action="store_true", help="do not append the \\boxed{} instruction")
    args = parser.parse_args(argv)
    rows = make_problems(args.n, args.seed, args.style, "" if args.no_suffix else SUFFIX)
    path = write_records(rows, args.out)
    print(f"wrote {len(rows)} problems to {path}")
    return path


if __name__ == "__main__":
    main()
