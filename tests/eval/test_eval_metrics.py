"""avg@k, pass@k (against brute-force enumeration of k-subsets), maj@k and length statistics,
every expected value worked out by hand or by enumeration."""

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from bapo_jax.eval import metrics


def brute_force_pass_at_k(correct: np.ndarray, k: int) -> Fraction:
    """The fraction of k-subsets of the samples holding at least one correct one."""
    subsets = list(itertools.combinations(range(len(correct)), k))
    hits = sum(any(correct[i] for i in subset) for subset in subsets)
    return Fraction(hits, len(subsets))


def test_pass_at_k_equals_brute_force_enumeration_for_every_small_case():
    rng = np.random.default_rng(0)
    estimated, enumerated = [], []
    for n in range(1, 9):
        for c in range(n + 1):
            correct = np.zeros(n, bool)
            correct[rng.permutation(n)[:c]] = True  # where the correct ones sit is irrelevant
            for k in range(1, n + 1):
                estimated.append(metrics.pass_at_k(n, c, k))
                enumerated.append(float(brute_force_pass_at_k(correct, k)))
    assert len(estimated) == sum(n * (n + 1) for n in range(1, 9))  # all (n, c, k): 240
    # Both are the same rational number rounded once: equal to the last bit.
    np.testing.assert_array_equal(np.asarray(estimated), np.asarray(enumerated))


def test_mean_pass_at_k_averages_the_per_problem_enumeration():
    rng = np.random.default_rng(1)
    correct = rng.random((5, 7)) < 0.3  # [P, N]
    for k in range(1, 8):
        expected = np.mean([float(brute_force_pass_at_k(row, k)) for row in correct])
        np.testing.assert_allclose(metrics.mean_pass_at_k(correct, k), expected, rtol=1e-15)


def test_pass_at_k_is_stable_where_float_binomials_overflow_or_cancel():
    # C(2000, 1000) ~ 2e600 does not fit a float; the exact integer form has no trouble.
    assert metrics.pass_at_k(2000, 1000, 1000) == 1.0
    np.testing.assert_allclose(metrics.pass_at_k(2000, 1, 1000), 0.5, rtol=1e-15)
    np.testing.assert_allclose(metrics.pass_at_k(1000, 1, 1), 1e-3, rtol=1e-15)
    # Against the product form 1 - prod_{i=n-c+1}^{n} (1 - k / i) of Chen et al. (2021).
    for n, c, k in [(1000, 3, 10), (512, 17, 64), (64, 1, 63), (100, 50, 2)]:
        product = 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))
        np.testing.assert_allclose(metrics.pass_at_k(n, c, k), product, rtol=1e-12)


def test_pass_at_1_is_the_accuracy_and_pass_at_n_is_any_correct():
    for n in range(1, 9):
        for c in range(n + 1):
            np.testing.assert_allclose(metrics.pass_at_k(n, c, 1), c / n, rtol=1e-15)
            assert metrics.pass_at_k(n, c, n) == (1.0 if c else 0.0)


@pytest.mark.parametrize(
    ("n", "c", "k", "message"),
    [
        (4, 1, 5, "k must be <= n=4"),
        (4, 5, 1, "c must be <= n=4"),
        (4, 1, 0, "k must be an int >= 1, got 0"),
        (0, 0, 1, "n must be an int >= 1, got 0"),
        (4, -1, 1, "c must be an int >= 0, got -1"),
        (4, True, 1, "c must be an int >= 0, got True"),
    ],
)
def test_pass_at_k_rejects_bad_counts(n, c, k, message):
    with pytest.raises(ValueError, match=message):
        metrics.pass_at_k(n, c, k)


def test_pass_at_k_values():
    assert metrics.pass_at_k_values(1) == (1,)
    assert metrics.pass_at_k_values(6) == (1, 2, 4, 6)
    assert metrics.pass_at_k_values(16) == (1, 2, 4, 8, 16)


def test_avg_at_k_by_hand():
    correct = np.asarray([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert metrics.avg_at_k(correct) == 0.5  # 6 of 12 samples
    np.testing.assert_allclose(metrics.mean_pass_at_k(correct, 1), 0.5, rtol=1e-15)
    # pass@2: 1 - C(2,2)/C(4,2) = 5/6, 0, 1.
    np.testing.assert_allclose(metrics.mean_pass_at_k(correct, 2), (5 / 6 + 0 + 1) / 3)
    with pytest.raises(ValueError, match="only 0/1"):
        metrics.avg_at_k(np.asarray([[0.5, 1.0]]))
    with pytest.raises(ValueError, match=r"non-empty \[P, N\] array, got shape \(4,\)"):
        metrics.avg_at_k(np.ones(4))


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("033", "33"),
        ("-007", "-7"),
        ("1{,}000", "1000"),
        ("12,345", "12345"),
        ("1,2", "1,2"),  # not a thousands group: a pair stays a pair
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\tfrac{1}{2}", "\\frac{1}{2}"),
        (" \\frac{1}{2} ", "\\frac{1}{2}"),
        ("\\left( 1, 2 \\right]", "(1,2]"),
        ("90^\\circ", "90"),
        ("90^{\\circ}", "90"),
        ("50\\%", "50"),
        ("$x+1$", "x+1"),
        ("3\\,141", "3141"),
        ("42.", "42"),
        ("\\leftarrow", "\\leftarrow"),  # \left inside a longer command is not touched
        ("", None),
        ("  ", None),
        (None, None),
    ],
)
def test_normalize_answer(raw, expected):
    assert metrics.normalize_answer(raw) == expected


def test_majority_vote_counts_normalized_answers_and_breaks_ties_by_first_sample():
    vote = metrics.majority_vote(["12", "033", "\\boxed", "33", None, ""])
    assert (vote.answer, vote.count, vote.first_index, vote.voters) == ("33", 2, 1, 4)
    # 2-2 ties: the answer whose first sample comes first wins, in either order.
    assert metrics.majority_vote(["3", "5", "5", "3"]).answer == "3"
    assert metrics.majority_vote(["5", "3", "3", "5"]).answer == "5"
    assert metrics.majority_vote(["\\dfrac{1}{2}", "7", "7", "\\frac{1}{2}"]).answer == (
        "\\frac{1}{2}"
    )
    none = metrics.majority_vote([None, None, ""])
    assert (none.answer, none.count, none.first_index, none.voters) == (None, 0, None, 0)


def test_maj_at_k_by_hand():
    answers = [
        ["12", "33", "12", None],  # majority 12 (wrong): 0
        ["\\frac{1}{2}", "3", "3", "\\dfrac{1}{2}"],  # tie 2-2 -> \frac{1}{2} (right): 1
        [None, None, None, None],  # no vote: 0
        ["7", "8", "9", "7"],  # majority 7; scored correct once, a timeout on the other: 1
    ]
    correct = np.asarray([[0, 1, 0, 0], [1, 0, 0, 1], [0, 0, 0, 0], [0, 0, 0, 1]])
    assert metrics.maj_at_k(answers, correct) == 0.5
    with pytest.raises(ValueError, match="answers must be 4 lists of 4 answers"):
        metrics.maj_at_k(answers[:3], correct)


def test_length_stats_by_hand():
    stats = metrics.length_stats(np.asarray([1, 2, 3, 4, 10]))
    expected = {
        "count": 5,
        "mean": 4.0,
        "std": math.sqrt(10.0),
        "min": 1,
        "p50": 3.0,
        "p90": 7.6,
        "max": 10,
    }  # p90: 4 + 0.6 * (10 - 4), linear interpolation
    assert stats.keys() == expected.keys()
    np.testing.assert_allclose([stats[k] for k in expected], list(expected.values()), rtol=1e-12)
    empty = metrics.length_stats(np.zeros((0,), int))
    assert empty["count"] == 0 and all(empty[k] is None for k in ("mean", "p90", "max"))


def test_summarize_and_problem_rows_by_hand():
    correct = np.asarray([[1, 0, 0, 0], [1, 1, 0, 0]], bool)
    answers = [["5", "6", "6", None], ["2", "2", "9", "9"]]
    lengths = np.asarray([[10, 20, 30, 40], [5, 5, 100, 100]])
    truncated = np.asarray([[0, 0, 0, 1], [0, 0, 1, 1]], bool)
    summary = metrics.summarize(correct, answers, lengths, truncated)
    m = summary["metrics"]
    assert list(m) == [
        "avg@4",
        "pass@1",
        "pass@2",
        "pass@4",
        "maj@4",
        "run_accuracy_std",
        "run_accuracy_min",
        "run_accuracy_max",
    ]
    np.testing.assert_allclose(
        [m["avg@4"], m["pass@1"], m["pass@2"], m["pass@4"], m["maj@4"]],
        # pass@2: 1 - C(3,2)/C(4,2) = 1/2 and 1 - C(2,2)/C(4,2) = 5/6; maj: 6 (wrong), 2 (tie
        # with 9, first) right.
        [3 / 8, 3 / 8, (1 / 2 + 5 / 6) / 2, 1.0, 0.5],
        rtol=1e-15,
    )
    # runs (columns) score 1, 1/2, 0, 0.
    np.testing.assert_allclose(
        [m["run_accuracy_std"], m["run_accuracy_min"], m["run_accuracy_max"]],
        [np.std([1.0, 0.5, 0.0, 0.0]), 0.0, 1.0],
    )
    assert summary["lengths"]["correct"]["mean"] == (10 + 5 + 5) / 3
    assert summary["lengths"]["incorrect"]["count"] == 5
    assert summary["lengths"]["truncated_fraction"] == 3 / 8
    assert summary["lengths"]["no_answer_fraction"] == 1 / 8

    rows = metrics.problem_rows(correct, answers, lengths, truncated)
    assert [r["num_correct"] for r in rows] == [1, 2]
    assert [r["majority_answer"] for r in rows] == ["6", "2"]
    assert [r["majority_correct"] for r in rows] == [False, True]
    assert [r["no_answer"] for r in rows] == [1, 0]
    assert [r["truncated"] for r in rows] == [1, 2]
    assert [r["mean_length"] for r in rows] == [25.0, 52.5]
    np.testing.assert_allclose(rows[1]["pass"]["pass@2"], 5 / 6, rtol=1e-15)
    with pytest.raises(ValueError, match="must have the shape of correct"):
        metrics.summarize(correct, answers, lengths[:, :3], truncated)
