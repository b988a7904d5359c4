"""`math_reward` on a hand-scored table of real response shapes, plus extraction and
normalisation units.

Each case is (response, gold answer, expected score, why). The expected score is what the
mathematics says, decided by hand; nothing was copied from math-verify's output. Where a
score rests on a convention rather than on equality alone, `why` starts with POLICY and
names it. Cases where math-verify alone disagreed with the mathematics were fixed in
`bapo_jax.rewards.checker.normalize_answer` (marked FIXED).
"""

import numpy as np
import pytest

from bapo_jax.data.datasets import read_math_rows, shipped_set
from bapo_jax.rewards import (
    extract_last_boxed,
    format_reward,
    has_boxed_answer,
    math_reward,
    math_reward_batch,
    reward_stats,
)
from bapo_jax.rewards.checker import as_integer, normalize_answer

# ruff: noqa: E501  (the case table keeps one case per line)

R1_PREAMBLE = "<think>\nLet me compute this carefully.\n</think>\n\n"

# fmt: off
ANSWER_CASES: list[tuple[str, str | int, float, str]] = [
    # -- boxed integers ------------------------------------------------------------------
    ("The answer is \\boxed{70}.", "70", 1.0, "same integer"),
    ("The answer is \\boxed{70}.", "71", 0.0, "different integer"),
    ("So we get $\\boxed{ 70 }$", "70", 1.0, "spaces inside the box"),
    ("Thus the final answer is $\\boxed{204}$. I hope it is correct.", 204, 1.0, "gold given as int"),
    (R1_PREAMBLE + "The number of paths is \\boxed{294}.", "294", 1.0, "R1-style response"),
    # -- leading zeros (AIME answers are integers 000..999) ------------------------------
    ("\\boxed{033}", "33", 1.0, "033 = 33"),
    ("\\boxed{0033}", 33, 1.0, "0033 = 33"),
    ("\\boxed{33}", "033", 1.0, "gold with a leading zero"),
    ("\\boxed{003}", "3", 1.0, "003 = 3"),
    ("\\boxed{000}", "0", 1.0, "000 = 0"),
    ("\\boxed{330}", "33", 0.0, "a trailing zero changes the number"),
    # -- fractions -----------------------------------------------------------------------
    ("\\boxed{\\frac{1}{2}}", "\\frac12", 1.0, "brace-less \\frac12 is 1/2"),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 1.0, "2/4 = 1/2"),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0, "slash fraction"),
    ("\\boxed{\\frac{1}{3}}", "\\frac{1}{2}", 0.0, "1/3 != 1/2"),
    ("\\boxed{-\\frac{3}{4}}", "-\\frac34", 1.0, "negative fraction"),
    ("\\boxed{\\frac{-3}{4}}", "-\\frac{3}{4}", 1.0, "(-3)/4 = -(3/4)"),
    ("\\boxed{\\frac{3}{4}}", "-\\frac{3}{4}", 0.0, "sign differs"),
    ("\\boxed{3\\frac{1}{2}}", "\\frac72", 1.0, "POLICY: an integer before a fraction is a mixed number, 3 1/2 = 7/2"),
    # -- decimals vs fractions -----------------------------------------------------------
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0, "0.5 = 1/2"),
    ("\\boxed{0.75}", "\\frac34", 1.0, "0.75 = 3/4"),
    ("\\boxed{0.7}", "\\frac34", 0.0, "0.7 != 3/4"),
    ("\\boxed{0.33}", "\\frac13", 0.0, "0.33 != 1/3 (differs in the 3rd decimal)"),
    ("\\boxed{1.5}", "\\frac{3}{2}", 1.0, "1.5 = 3/2"),
    ("\\boxed{\\frac{1}{10}}", "0.1", 1.0, "1/10 = 0.1"),
    ("\\boxed{33.0}", "33", 1.0, "33.0 = 33"),
    ("\\boxed{3.3}", "33", 0.0, "3.3 != 33"),
    ("\\boxed{0.333333}", "\\frac13", 1.0, "POLICY: a decimal that equals the exact value to 6 places stands for it"),
    # -- \dfrac and \tfrac ---------------------------------------------------------------
    ("\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}", 1.0, "\\dfrac is \\frac"),
    ("\\boxed{\\tfrac{3}{4}}", "0.75", 1.0, "\\tfrac is \\frac"),
    ("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0, "sqrt(3)/2"),
    ("\\boxed{\\dfrac{5}{2}}", "\\frac{2}{5}", 0.0, "5/2 != 2/5"),
    ("\\[\n\\boxed{\\dfrac{7}{2}}\n\\]", "3.5", 1.0, "display math around the box"),
    # -- units and text inside the box ---------------------------------------------------
    ("\\boxed{5\\text{ cm}}", "5", 1.0, "unit after the number"),
    ("\\boxed{5\\text{ cm}}", "6", 0.0, "a unit does not rescue a wrong number"),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0, "unit word"),
    ("\\boxed{\\text{18 dollars}}", "18", 1.0, "FIXED: number and unit in one \\text"),
    ("\\boxed{\\$18.00}", "18", 1.0, "currency and cents"),
    ("\\boxed{30^\\circ}", "30", 1.0, "degrees"),
    ("\\boxed{4 \\text{ cm}^2}", "4", 1.0, "squared unit"),
    ("\\boxed{\\text{18}}", "18", 1.0, "number written as text"),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", 1.0, "a name answer"),
    ("\\boxed{\\text{Sam}}", "\\text{Evelyn}", 0.0, "a different name"),
    ("\\boxed{18\\%}", "18", 1.0, "POLICY: a percent sign is a unit (the question asked for a percentage)"),
    ("\\boxed{18.}", "18", 1.0, "FIXED: trailing full stop"),
    # -- several boxes: the last complete one wins ---------------------------------------
    ("First \\boxed{3}. Wait, I made an error. Recomputing, \\boxed{5}", "5", 1.0, "last box is right"),
    ("First \\boxed{3}. Wait, I made an error. Recomputing, \\boxed{5}", "3", 0.0, "only the last box counts"),
    ("\\boxed{5} ... so the final answer is \\boxed{5.5}", "5", 0.0, "last box wrong"),
    ("So \\boxed{7}. Let me double-check: \\boxed{8", "7", 1.0, "an unclosed (truncated) box is not an answer"),
    ("\\boxed{\\boxed{12}}", "12", 1.0, "nested box"),
    # -- no box, empty box ---------------------------------------------------------------
    ("The answer is 5.", "5", 0.0, "no box: no answer"),
    ("5", "5", 0.0, "bare number: no box"),
    ("Final answer: \\fbox{5}", "5", 1.0, "\\fbox is a box"),
    ("\\boxed{}", "5", 0.0, "empty box"),
    ("\\boxed{ }", "5", 0.0, "blank box"),
    ("", "5", 0.0, "empty response"),
    # -- thousands separators ------------------------------------------------------------
    ("\\boxed{1,000}", "1000", 1.0, "comma separator"),
    ("\\boxed{1{,}000}", "1000", 1.0, "LaTeX {,} separator"),
    ("\\boxed{1\\,000}", "1000", 1.0, "FIXED: thin-space separator"),
    ("\\boxed{1 000 000}", "1000000", 1.0, "FIXED: space separators"),
    ("\\boxed{10,000}", "1000", 0.0, "10000 != 1000"),
    ("\\boxed{\\$1,234.50}", "1234.5", 1.0, "separator, currency and decimals"),
    # -- negative numbers ----------------------------------------------------------------
    ("\\boxed{-5}", "-5", 1.0, "negative"),
    ("\\boxed{-5}", "5", 0.0, "sign differs"),
    ("\\boxed{5}", "-5", 0.0, "sign differs"),
    ("\\boxed{−7}", "-7", 1.0, "Unicode minus sign"),
    ("\\boxed{-0.25}", "-\\frac{1}{4}", 1.0, "-0.25 = -1/4"),
    # -- intervals -----------------------------------------------------------------------
    ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]", 1.0, "same interval"),
    ("\\boxed{[3,\\infty)}", "(3,\\infty)", 0.0, "closed vs open end"),
    ("\\boxed{(-\\infty,-1)\\cup(1,\\infty)}", "(-\\infty,-1) \\cup (1,\\infty)", 1.0, "union of intervals"),
    ("\\boxed{x \\in [2, 5)}", "[2,5)", 1.0, "membership written out"),
    ("\\boxed{[2,5]}", "[2,5)", 0.0, "5 included vs excluded"),
    # -- expressions, tuples, sets, matrices ---------------------------------------------
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 1.0, "2 sqrt 2 = sqrt 8"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", 1.0, "expanded square"),
    ("\\boxed{x^2+1}", "(x-1)(x+1)", 0.0, "x^2+1 != x^2-1"),
    ("\\boxed{3.14}", "\\pi", 0.0, "3.14 is not pi"),
    ("\\boxed{2\\pi}", "2\\pi", 1.0, "same multiple of pi"),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}", 1.0, "sqrt(2)/2"),
    ("\\boxed{2^{10}}", "1024", 1.0, "2^10 = 1024"),
    ("\\boxed{\\binom{5}{2}}", "10", 1.0, "C(5,2) = 10"),
    ("\\boxed{x = 5}", "5", 1.0, "value given as an assignment"),
    ("\\boxed{y = 2x + 3}", "2x+3", 1.0, "function given as an equation"),
    ("\\boxed{\\left(3, \\frac{\\pi}{2} \\right)}", "\\left(3, \\frac{\\pi}{2} \\right)", 1.0, "same point"),
    ("\\boxed{(3, \\pi/2)}", "\\left(3, \\frac{\\pi}{2} \\right)", 1.0, "same point, other notation"),
    ("\\boxed{(\\frac{\\pi}{2}, 3)}", "\\left(3, \\frac{\\pi}{2} \\right)", 0.0, "ordered pair swapped"),
    ("\\boxed{1, -2}", "-2, 1", 1.0, "all solutions listed: order is irrelevant"),
    ("\\boxed{\\pm 2}", "2, -2", 1.0, "plus-minus is both roots"),
    ("\\boxed{1011_2}", "1011_2", 1.0, "base-2 numeral"),
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 1.0, "same vector"),
    ("\\boxed{\\begin{pmatrix} 2 \\\\ 1 \\end{pmatrix}}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", 0.0, "components swapped"),
    # -- model output is text, never code ------------------------------------------------
    ("\\boxed{__import__('os').getpid()}", "0", 0.0, "a Python expression is not evaluated"),
]
# fmt: on


def test_table_is_large_and_covers_both_outcomes():
    scores = [case[2] for case in ANSWER_CASES]
    assert len(ANSWER_CASES) >= 60
    assert scores.count(1.0) >= 20 and scores.count(0.0) >= 20


@pytest.mark.parametrize(
    ("response", "answer", "expected", "why"), ANSWER_CASES, ids=[c[3] for c in ANSWER_CASES]
)
def test_math_reward_table(response, answer, expected, why):
    assert math_reward(response, answer) == expected, why


def test_batch_api_matches_table():
    before = reward_stats().checks
    scores = math_reward_batch([c[0] for c in ANSWER_CASES], [c[1] for c in ANSWER_CASES])
    np.testing.assert_array_equal(scores, np.array([c[2] for c in ANSWER_CASES], np.float32))
    assert scores.dtype == np.float32 and scores.shape == (len(ANSWER_CASES),)
    assert reward_stats().checks == before + len(ANSWER_CASES)


def test_math_reward_rejects_bad_input():
    with pytest.raises(ValueError, match="responses\\[0\\] must be a str"):
        math_reward(None, "1")
    with pytest.raises(ValueError, match="non-empty answer"):
        math_reward("\\boxed{1}", "  ")
    with pytest.raises(ValueError, match="same length"):
        math_reward_batch(["\\boxed{1}"], ["1", "2"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("no box here", None),
        ("\\boxed{}", ""),
        ("\\boxed{1} and \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),  # escaped braces are text
        ("\\boxed {7}", "7"),  # a space before the brace
        ("\\boxed{3} then \\boxed{4", "3"),  # truncated last box ignored
        ("\\boxed{a}}}", "a"),  # stray closing braces
        ("{\\boxed{5}", "5"),  # a group left open before the box
        ("\\boxed{\\boxed{12}}", "\\boxed{12}"),  # the outer box closes last
        ("\\\\boxed{9}", None),  # a LaTeX line break followed by the word 'boxed'
        ("\\fbox{6}", "6"),
    ],
)
def test_extract_last_boxed(text, expected):
    assert extract_last_boxed(text) == expected


def test_extract_last_boxed_is_linear_on_adversarial_text():
    # 1 MB of unclosed boxes: a rescan from every `\boxed{` would be quadratic.
    text = "\\boxed{" * 150_000
    assert extract_last_boxed(text) is None
    nested = "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}"
    assert extract_last_boxed(nested) == "{" * 10_000 + "1" + "}" * 10_000


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1\\,000", "1000"),
        ("1 000 000", "1000000"),
        ("1~234", "1234"),
        ("12 34", "12 34"),  # not a three-digit group: left alone
        ("18.", "18"),
        ("3...", "3..."),
        ("\\text{18 dollars}", "18\\text{ dollars}"),
        ("\\text{Evelyn}", "\\text{Evelyn}"),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("033", 33),
        ("-7", -7),
        ("+5", 5),
        ("1,000", 1000),
        ("\\$18", 18),
        ("3.0", None),
        ("1,00", None),
        ("x", None),
    ],
)
def test_as_integer(text, expected):
    assert as_integer(text) == expected


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("So the answer is \\boxed{42}.", 1.0),
        ("\\boxed{}", 0.0),
        ("The answer is 42.", 0.0),
        ("\\boxed{42", 0.0),
        ("\\boxed{wrong but boxed}", 1.0),
    ],
)
def test_format_reward(response, expected):
    assert format_reward(response) == expected
    assert has_boxed_answer(response) == (expected == 1.0)


@pytest.mark.parametrize(
    ("name", "split"),
    [("aime2024", "test"), ("aime2025", "test"), ("math500", "test"), ("gsm8k", "test")],
)
def test_every_shipped_gold_answer_boxed_scores_one(name, split):
    rows, _ = read_math_rows(shipped_set(name).path(split))
    responses = [f"Therefore the answer is $\\boxed{{{row.answer}}}$." for row in rows]
    scores = math_reward_batch(responses, [row.answer for row in rows])
    np.testing.assert_array_equal(scores, np.ones(len(rows), np.float32))


def test_aime_answers_of_other_problems_score_by_integer_equality():
    rows, _ = read_math_rows(shipped_set("aime2024").path("test"))
    answers = [row.answer for row in rows]
    shifted = answers[1:] + answers[:1]  # each problem answered with the next one's answer
    expected = np.array(
        [float(int(a) == int(b)) for a, b in zip(answers, shifted, strict=True)], np.float32
    )
    scores = math_reward_batch([f"\\boxed{{{a:0>3}}}" for a in shifted], answers)
    np.testing.assert_array_equal(scores, expected)
    assert expected.sum() < len(rows)  # mostly different answers: the check can fail
