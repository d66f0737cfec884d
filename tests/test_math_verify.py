"""Answer extraction, equality (numeric and symbolic in the worker process) and the math reward."""

import time

import pytest

from realcore.api.registry import lookup
from realcore.data.math_verify import extract_answer, math_equal, math_reward


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so \boxed{42}.", "42"),
        (r"first \boxed{1} then \boxed{2}", "2"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{a^{2} + \sqrt{b_{1}}} done", r"a^{2} + \sqrt{b_{1}}"),
        (r"answer \boxed{3} and a broken \boxed{4", "3"),
        (r"$\boxed 7$", "7"),
        ("Natalia sold 48/2 = 24 clips.\n#### 72", "72"),
        ("total\n#### 1,234", "1,234"),
        ("first 3 then 1,234,567 apples", "1,234,567"),
        ("it fell to -5 degrees", "-5"),
        ("10 - 3 = 7", "7"),
        ("5-3", "3"),
        ("pi is about 3.14159.", "3.14159"),
        ("half is 1/2", "1/2"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("72", "72"),
        ("72.0", "72"),
        ("1,234", "1234"),
        ("$1,234.", "1234"),
        ("1/2", "0.5"),
        (r"\frac{1}{2}", "0.5"),
        (r"\dfrac{3}{4}", "0.75"),
        (r"-\frac12", "-0.5"),
        (r"\frac{-1}{2}", "-0.5"),
        (r"\left(\frac{1}{3}\right)", "1/3"),
        ("50\\%", "50"),
        ("25%", "25"),
        (r"\text{5}", "5"),
        ("0.3333333", "1/3"),  # relative tolerance 1e-6
        ("-7", "\u22127"),  # unicode minus
        ("x+x", "2*x"),
        ("2x", "x + x"),
        ("x^2", "x**2"),
        ("sqrt(4)", "2"),
        (r"\sqrt{4}", "2"),
        (r"\frac{\sqrt{3}}{2}", "sqrt(3)/2"),
    ],
)
def test_math_equal_true(pred, gold):
    assert math_equal(pred, gold)


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("71", "72"),
        ("0.5", "0.6"),
        ("0.333", "1/3"),
        ("1,234", "1,235"),
        ("x+1", "x"),
        ("sqrt(5)", "2"),
        ("", "1"),
        ("1", ""),
        ("open(1)", "1"),  # not arithmetic: never reaches sympy's eval
        ("__import__", "1"),
        ("(1,2)", "12"),
        ("1e999999999", "1"),  # must not build a billion-digit number in this process
        ("\\frac{" * 2000 + "1", "1"),  # unbalanced, deeply nested
    ],
)
def test_math_equal_false(pred, gold):
    assert not math_equal(pred, gold)


def test_pathological_input_times_out_and_worker_recovers():
    assert math_equal("x+x", "2*x")  # warm the worker so the timing below excludes its start-up
    t0 = time.monotonic()
    assert not math_equal("9**9**9**9", "1", timeout_s=1.0)
    assert time.monotonic() - t0 < 1.0 + 2.0
    assert math_equal("x*x", "x^2")  # a fresh worker answers the next call
    assert not math_equal("x*x", "2x")


@pytest.mark.parametrize(
    "response, answer, reward",
    [
        ("She sold 48 + 24 = 72 clips.", "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72", 1.0),
        (r"The answer is $\boxed{72}$.", "48 + 24 = 72\n#### 72", 1.0),
        ("So 71.", "#### 72", 0.0),
        ("The total is 1,234 dollars.", "#### 1234", 1.0),
        ("I think it is -4", "-4", 1.0),
        (r"\boxed{2x+2}", "2(x+1)", 1.0),  # a bare answer is used whole, not its last number
        (r"\boxed{\frac{1}{2}}", r"so \boxed{0.5}", 1.0),
        ("no idea", "#### 72", 0.0),
    ],
)
def test_math_reward(response, answer, reward):
    assert math_reward(response, answer) == reward


def test_math_reward_is_registered():
    import realcore.data  # noqa: F401

    assert lookup("reward", "math") is math_reward
