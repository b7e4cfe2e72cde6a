"""Math answer equivalence: is the answer in a response the same number/expression as the label?

Backend: `math-verify` (HuggingFace; parses LaTeX and plain expressions into sympy and compares
them) when it imports, else the fallback here: extract the answer (last `\\boxed{}`, else
"answer is X" / "Answer: X", else the last number), normalise LaTeX spellings, and compare as
strings, then as exact sympy numbers/expressions. Both backends accept `1/2`, `0.5`,
`\\frac{1}{2}`, `\\frac12` and `\\boxed{\\frac12}` for the label `1/2`.

Only the text after the last `</think>` is graded, so numbers in the reasoning do not count.

Thread safety: math-verify bounds its work with `signal.alarm`, which works only in the main
thread. Rewards run in a thread pool (see `loader.call_reward_full`), so off the main thread we
call it without its timeout; the fallback guards itself by refusing long expressions instead.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import threading
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import sympy

# sympy and math-verify are imported at the first comparison, not with the module: every rollout process
# imports the reward registry, most never grade math, and the two cost ~2 s of CPU to import
# math-verify is an optional speed/quality upgrade; the fallback below is complete on its own
HAVE_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None

# math-verify logs a warning on every timeout-less call; our callers know (see the module docstring)
logging.getLogger("math_verify").setLevel(logging.ERROR)

MAX_EXPONENT = 100
MAX_EXPR_CHARS = 80  # longer candidate answers are compared as strings only (sympy can be slow)

_ANSWER_IS = re.compile(r"(?:final answer|answer)\s*(?:is|:)\s*:?\s*(.+)", re.IGNORECASE)
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_SAFE_EXPR = re.compile(r"^[0-9a-z.+\-*/()^ ]+$")
_ALLOWED_NAMES = {"sqrt", "pi", "E"}
# math-verify evaluates what it parses; without its alarm (off the main thread) these never finish:
# an exponent that holds another power (9^9^9), a long exponent ((1+x)^{1000}), a big factorial
_RISKY_POWER = re.compile(r"(\^|\*\*)\s*[{(]?[^{}()\s]*(\^|\*\*)|(\^|\*\*)\s*[{(]?\s*\d{3,}|\d{3,}\s*!")
MAX_VERIFY_CHARS = 2000  # math-verify reads answers from the end; the reasoning above is not needed


def _sympy():
    """sympy, imported at first use."""
    import sympy

    return sympy


def _parse(plain: str, evaluate: bool):
    """sympy's parse_expr with implicit multiplication ('2x' -> 2*x, '2(x+1)' -> 2*(x+1))."""
    from sympy.parsing.sympy_parser import implicit_multiplication, parse_expr, standard_transformations

    return parse_expr(plain, transformations=(*standard_transformations, implicit_multiplication), evaluate=evaluate)


def answer_region(text: str) -> str:
    """The part of a response that holds the answer: after the last `</think>`, when there is one."""
    return text.rsplit("</think>", 1)[-1]


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (or `\\fbox{...}`), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] == " ":  # '\boxed 5' (no braces): up to the next '$' or space
        return text[i + 1:].split("$")[0].split()[0] if text[i + 1:].strip() else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def extract_answer(text: str) -> str | None:
    """The final answer of a response (fallback backend): boxed, else 'answer is X', else the last number."""
    region = answer_region(text)
    boxed = last_boxed(region)
    if boxed is not None:
        return boxed
    matches = _ANSWER_IS.findall(region)
    if matches:
        return matches[-1].strip().splitlines()[0].strip().rstrip(".")
    stripped = region.strip()
    if stripped and len(stripped) <= MAX_EXPR_CHARS and "\n" not in stripped and _to_sympy(normalize(stripped)):
        return stripped
    numbers = _NUMBER.findall(region)
    return numbers[-1] if numbers else None


def _frac_braces(s: str) -> str:
    # \frac12 -> \frac{1}{2}, \frac1{x} -> \frac{1}{x}: single-token arguments get braces
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\s*(\d)\s*\{", r"\\frac{\1}{", s)
    return re.sub(r"\\frac\{([^{}]*)\}\s*(\d)", r"\\frac{\1}{\2}", s)


def normalize(answer: str) -> str:
    """A canonical spelling: no `$`, spaces, `\\left`/`\\right`, units in `\\text{}`, degree signs;
    `\\dfrac`/`\\tfrac` -> `\\frac`; thousands commas dropped; a leading 'x =' dropped."""
    s = str(answer).strip()
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\text\{\s*[a-zA-Z ]*\}", "", s)  # units: '5 \text{ cm}' -> '5'
    s = re.sub(r"\^\s*\{?\\circ\}?|\\%|%|°", "", s)
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # 'x = 3' -> '3'
    s = _frac_braces(s).replace(" ", "").rstrip(".")
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")
    return s


def _latex_to_plain(s: str) -> str:
    s = _frac_braces(s)
    for _ in range(4):  # nested fractions
        s = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
    s = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", s)
    s = s.replace("\\pi", "pi").replace("\\cdot", "*").replace("\\times", "*").replace("{", "(").replace("}", ")")
    return s.replace("^", "**")


def _small_powers(expr: sympy.Basic) -> bool:
    """True when every power has a plain exponent of at most MAX_EXPONENT (10^{10^{10}} never finishes)."""
    sympy = _sympy()
    for node in sympy.preorder_traversal(expr):
        if isinstance(node, sympy.Pow) and node.exp != -1:  # unevaluated a/b is Mul(a, Pow(b, -1))
            exp = node.exp
            if any(isinstance(p, sympy.Pow) and p.exp != -1 for p in sympy.preorder_traversal(exp)):
                return False
            if exp.is_number and abs(exp) > MAX_EXPONENT:
                return False
    return True


@lru_cache(maxsize=4096)
def _to_sympy(s: str) -> sympy.Expr | None:
    """An exact sympy value of a short, plain or LaTeX expression; None when it is not one.

    Input is whitelisted (digits, operators, brackets, a few names) before sympy sees it, because
    `parse_expr` evaluates Python.
    """
    if not s or len(s) > MAX_EXPR_CHARS:
        return None
    sympy = _sympy()
    plain = _latex_to_plain(s)
    if not _SAFE_EXPR.match(plain.lower()) or "__" in plain:
        return None
    names = set(re.findall(r"[a-zA-Z]+", plain))
    if any(len(n) > 1 and n not in _ALLOWED_NAMES for n in names):
        return None
    try:
        if not _small_powers(_parse(plain, evaluate=False)):
            return None
        # rational=True keeps 0.5 exact (1/2), so decimals and fractions compare without tolerance
        expr = _parse(plain, evaluate=True)
        return sympy.nsimplify(expr, rational=True) if expr.has(sympy.Float) else expr
    except (SyntaxError, TypeError, ValueError, ZeroDivisionError, AttributeError, sympy.SympifyError):
        return None


def sympy_equal(pred: str, gold: str) -> bool:
    """Fallback equivalence of two extracted answers: same normal form, or equal as sympy values."""
    a, b = normalize(pred), normalize(gold)
    if a == b:
        return True
    x, y = _to_sympy(a), _to_sympy(b)
    if x is None or y is None:
        return False
    sympy = _sympy()
    try:
        if x.free_symbols != y.free_symbols:
            return False
        if not x.free_symbols:
            return bool(sympy.nsimplify(x - y) == 0) or bool(abs(sympy.N(x - y, 30)) < 1e-12)
        # expressions: equal exactly at a few rational points (simplify can take minutes on (1+x)^99)
        points = (sympy.Rational(2, 7), sympy.Rational(3, 11), sympy.Rational(-5, 13))
        symbols = sorted(x.free_symbols, key=str)
        return all(sympy.simplify((x - y).subs({s: p + k for k, s in enumerate(symbols)})) == 0 for p in points)
    except (TypeError, ValueError, AttributeError, ZeroDivisionError):
        return False


def _math_verify_equal(response: str, gold: str) -> bool | None:
    """math-verify's verdict; None when it cannot parse the label."""
    import math_verify

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    configs = [math_verify.LatexExtractionConfig(), math_verify.ExprExtractionConfig()]
    # a label is read as LaTeX math first: a bare '1+2x+x^2' would otherwise parse as its first number
    gold_parsed = [] if "$" in gold or "\\boxed" in gold else math_verify.parse(
        f"${gold}$", extraction_config=configs, parsing_timeout=timeout)
    if not gold_parsed:
        gold_parsed = math_verify.parse(gold, extraction_config=configs, parsing_timeout=timeout)
    if not gold_parsed:
        return None
    if timeout is None and _RISKY_POWER.search(response[-MAX_VERIFY_CHARS:]):
        return None  # no alarm to stop it: a power tower would hold the GIL for good
    pred_parsed = math_verify.parse(response[-MAX_VERIFY_CHARS:], extraction_config=configs, parsing_timeout=timeout)
    return bool(pred_parsed) and bool(math_verify.verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def is_equivalent(response: str, label: object, backend: str | None = None) -> bool:
    """Does the response's final answer equal `label`? `backend`: 'math_verify', 'sympy' or None
    (math-verify when installed, then the fallback when it says no)."""
    gold = str(label).strip()
    region = answer_region(response)
    if backend is None:
        backend = "math_verify" if HAVE_MATH_VERIFY else "sympy"
    if backend == "math_verify":
        if not HAVE_MATH_VERIFY:
            raise RuntimeError("math-verify is not installed (pip install math-verify)")
        if _math_verify_equal(region, gold):
            return True
        # math-verify misses a few plain-LaTeX spellings (a bare '\\dfrac{1}{2}'); the fallback only
        # adds answers that are exactly equal, so trying it second cannot accept a wrong one
    elif backend != "sympy":
        raise ValueError(f"unknown math backend {backend!r}; expected 'math_verify' or 'sympy'")
    pred = extract_answer(region)
    return pred is not None and sympy_equal(pred, gold)
