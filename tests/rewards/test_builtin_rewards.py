"""Built-in rule rewards on hand-made cases: math (both backends), dapo, format, f1, digit."""

from __future__ import annotations

import pytest

from slime_rl.data import Sample
from slime_rl.rewards import (
    BUILTIN,
    HAVE_MATH_VERIFY,
    check_format,
    dapo_reward,
    digit_reward,
    f1_reward,
    format_reward,
    is_equivalent,
    math_reward,
    token_f1,
)
from slime_rl.rewards.math_grader import extract_answer, last_boxed, normalize, sympy_equal

BACKENDS = ["sympy"] + (["math_verify"] if HAVE_MATH_VERIFY else [])


def sample(response: str, label: object = "1/2", prompt: str = "p") -> Sample:
    return Sample(index=0, group_index=0, prompt=prompt, prompt_ids=[1], label=label, response=response)


RIGHT_HALF = ["1/2", "0.5", "\\frac{1}{2}", "\\boxed{\\frac12}", "The answer is $\\boxed{0.50}$.",
              "<think>maybe 1/3? no</think> so \\boxed{\\dfrac{1}{2}}", "Answer: 1/2"]
WRONG_HALF = ["1/3", "\\boxed{2}", "0.52", "\\boxed{\\frac{2}{1}}", "", "no idea",
              "<think>\\boxed{1/2}</think> final: \\boxed{1/4}"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("response", RIGHT_HALF)
def test_equivalent_spellings_of_one_half_score_one(backend, response):
    assert is_equivalent(response, "1/2", backend) is True


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("response", WRONG_HALF)
def test_wrong_answers_score_zero(backend, response):
    assert is_equivalent(response, "1/2", backend) is False


@pytest.mark.parametrize("backend", BACKENDS)
def test_other_labels(backend):
    assert is_equivalent("\\boxed{9/4}", "2.25", backend)
    assert is_equivalent("\\boxed{-\\frac{3}{4}}", "-0.75", backend)
    assert is_equivalent("\\boxed{1,000}", "1000", backend)
    assert is_equivalent("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", backend)
    assert is_equivalent("\\boxed{(1+x)^2}", "x^2+2x+1", backend)
    assert not is_equivalent("\\boxed{(1+x)^2}", "x^2+3x+1", backend)
    assert not is_equivalent("\\boxed{\\sqrt{2}}", "1.4142", backend)  # exact, not approximate
    assert is_equivalent("\\boxed{7}", 7, backend)  # labels may be numbers in the data file


def test_math_reward_and_labels_as_numbers():
    assert math_reward(sample("\\boxed{\\frac12}")) == 1.0
    assert math_reward(sample("\\boxed{3}")) == 0.0
    assert math_reward(sample("\\boxed{0.5}", label=0.5)) == 1.0
    assert math_reward(sample("\\boxed{1}", label=None)) == 0.0


def test_fallback_pieces():
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("\\boxed{unclosed") is None and last_boxed("none") is None
    assert extract_answer("The final answer is 42.\nDone") == "42"
    assert extract_answer("we get 3 then 17 apples") == "17"
    assert normalize("$x = \\dfrac12$") == "\\frac{1}{2}"
    assert normalize("90^\\circ") == "90" and normalize("5 \\text{ cm}") == "5" and normalize("12,345") == "12345"
    assert sympy_equal("0.125", "\\frac{1}{8}") and not sympy_equal("0.125", "\\frac{1}{9}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_power_towers_are_refused_quickly_off_the_main_thread(backend):
    import threading
    import time

    out: list[bool] = []
    start = time.monotonic()
    t = threading.Thread(target=lambda: out.extend(
        is_equivalent(r, "1", backend) for r in ("\\boxed{9^9^9^9}", "\\boxed{10^{10^{10}}}", "\\boxed{(1+x)^{1000}}")))
    t.start()
    t.join(timeout=30)
    assert out == [False, False, False] and time.monotonic() - start < 30


def test_dapo_is_plus_minus_one_and_logs_acc():
    assert dapo_reward(sample("\\boxed{0.5}")) == {"score": 1.0, "acc": 1.0}
    assert dapo_reward(sample("\\boxed{0.6}")) == {"score": -1.0, "acc": 0.0}
    assert dapo_reward(sample("I ran out of tokens")) == {"score": -1.0, "acc": 0.0}


@pytest.mark.parametrize("response, ok", [
    ("<think>2+2 is 4</think>The answer is 4.", True),
    ("  <think>\nreason\n</think>\n\\boxed{4}  ", True),
    ("The answer is 4.", False),                          # no think block
    ("<think>reason</think>", False),                     # no answer after it
    ("<think>  </think>4", False),                        # blank reasoning
    ("<think>a</think>4<think>b</think>5", False),         # two think blocks
    ("4 <think>a</think> 4", False),                      # text before the think block
    ("<think>a 4", False),                                # unclosed
    ("</think><think>a</think>4", False),                 # wrong order
])
def test_format_rule(response, ok):
    assert check_format(response) is ok
    assert format_reward(sample(response)) == float(ok)


def test_format_when_the_prompt_opened_the_think_block():
    prompt = "<|im_start|>assistant\n<think>\n"
    assert format_reward(sample("reasoning</think>answer 4", prompt=prompt)) == 1.0
    assert format_reward(sample("reasoning</think>answer 4")) == 0.0  # same response, plain prompt
    assert format_reward(sample("answer 4", prompt=prompt)) == 0.0


def test_f1_by_hand():
    # pred tokens: paris is capital (article dropped); ref: paris; common 1 -> P 1/3, R 1, F1 = 0.5
    assert token_f1("Paris is the capital.", "Paris") == pytest.approx(0.5)
    assert token_f1("the cat sat", "a cat sat down") == pytest.approx(2 * 1.0 * (2 / 3) / (1.0 + 2 / 3))
    assert token_f1("dog", "cat") == 0.0 and token_f1("", "") == 1.0
    assert f1_reward(sample("<think>paris? rome?</think> Rome", label="Rome")) == 1.0
    assert f1_reward(sample("Rome city", label=["Paris", "Rome"])) == pytest.approx(2 / 3)


def test_digit_unchanged_and_builtin_names():
    assert digit_reward(sample(" 7 3", label="7")) == 1.0 and digit_reward(sample("3 7", label="7")) == 0.0
    assert set(BUILTIN) == {"digit", "math", "dapo", "format", "f1", "math_format", "reasoning_gym", "deepscaler",
                            "gpqa", "ifbench"}


# slime's rm_hub/deepscaler.py, rule by rule: the solution after the last </think> (else after the
# first ###Response, else 0), its last \boxed{} (none: 0), an empty label 0, a boxed label by its content
@pytest.mark.parametrize("response, label, score", [
    ("<think>1+1</think> so \\boxed{2}", "2", 1.0),
    ("<think>1+1</think> so \\boxed{3}", "2", 0.0),  # wrong
    ("\\boxed{2}", "2", 0.0),  # right, but neither </think> nor ###Response
    ("prompt ###Response: \\boxed{2}", "2", 1.0),
    ("<think>\\boxed{2}</think> it is 2", "2", 0.0),  # the box is in the reasoning only
    ("<think>a</think> The answer is 2.", "2", 0.0),  # no box (--rm-type math would say 1)
    ("<think>a</think> \\boxed{0.5}", "\\boxed{\\frac{1}{2}}", 1.0),  # a boxed label by its content
    ("<think>a</think> \\boxed{2}", "", 0.0),  # an empty label
    ("<think>a</think> \\boxed{2}", 2, 1.0),  # a number label
    ("<think>x</think> \\boxed{1}</think> \\boxed{2}", "2", 1.0),  # after the LAST </think>
])
def test_deepscaler_follows_slimes_rules(response, label, score):
    from slime_rl.rewards.builtin import deepscaler_reward

    assert deepscaler_reward(sample(response, label=label)) == score
    assert BUILTIN["deepscaler"] is deepscaler_reward


@pytest.mark.parametrize("response, acc, fmt", [
    ("<think>half of one</think> The answer is \\boxed{\\frac12}.", 1.0, 1.0),
    ("<think>half of one</think> 1/2", 1.0, 0.0),  # right, but no \boxed{} in the answer
    ("\\boxed{1/2}", 1.0, 0.0),  # right, but no think block
    ("<think>a third</think> \\boxed{1/3}", 0.0, 1.0),  # well formed, wrong
    ("<think></think> \\boxed{1/3}", 0.0, 0.0),  # blank reasoning
])
def test_math_format_weights_accuracy_and_format(response, acc, fmt):
    out = BUILTIN["math_format"](sample(response))
    assert (out["acc"], out["format"]) == (acc, fmt)
    assert out["score"] == pytest.approx(0.9 * acc + 0.1 * fmt)
