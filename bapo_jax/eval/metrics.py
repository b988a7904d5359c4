"""Evaluation metrics over k sampled responses per problem: avg@k, pass@k, maj@k, lengths.

Notation: a benchmark of P problems, n samples per problem (the CLI's `--k`), c_p of them
scored correct by `math_reward`.

- avg@n (the paper's metric, "average over 16 samples"): mean accuracy over all samples,

      avg@n = 1/P sum_p c_p / n.

- pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"), the
  unbiased estimator of "at least one of k samples is correct" from n >= k samples:

      pass@k = 1/P sum_p [1 - C(n - c_p, k) / C(n, k)].

  Computed exactly in integer arithmetic (`(C(n, k) - C(n - c, k)) / C(n, k)`, one correctly
  rounded division), so it neither overflows (C(1000, 500) ~ 1e299) nor cancels. pass@1 equals
  avg@n.
- maj@n (self-consistency): per problem, the most frequent final answer among the n samples
  wins; the problem counts as solved when that answer is correct. Final answers are the
  contents of the last `\\boxed{}` after `normalize_answer` (a conservative canonical form:
  `\\dfrac` = `\\frac`, `033` = `33`, spacing commands, `\\left`/`\\right`, a trailing full
  stop, `^\\circ`, `\\%` and whitespace are ignored); samples without a box or with an empty
  box do not vote. Ties go to the tied answer that appears first (lowest sample index), so the
  vote is deterministic for a given sample order. The winning answer is correct when any of
  its samples was scored correct (they share one normalized answer; this keeps a rare reward
  timeout on one of them from flipping the vote).
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxtyping import Bool, Int

from bapo_jax.checks import check_int

__all__ = [
    "MajorityVote",
    "avg_at_k",
    "length_stats",
    "maj_at_k",
    "majority_vote",
    "mean_pass_at_k",
    "normalize_answer",
    "pass_at_k",
    "pass_at_k_values",
    "problem_rows",
    "summarize",
]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: 1 - C(n - c, k) / C(n, k), exact up to one rounding.

    n samples, c of them correct, 1 <= k <= n. Equals the fraction of the C(n, k) subsets of
    k samples that hold at least one correct sample.
    """
    n = check_int("n", n, 1)
    c = check_int("c", c, 0)
    k = check_int("k", k, 1)
    if c > n:
        raise ValueError(f"c must be <= n={n}, got {c}")
    if k > n:
        raise ValueError(f"k must be <= n={n} (pass@k needs at least k samples), got {k}")
    if n - c < k:  # every k-subset holds a correct sample
        return 1.0
    total = math.comb(n, k)
    return (total - math.comb(n - c, k)) / total  # int / int: correctly rounded


def _as_correct(correct: Any) -> np.ndarray:
    correct = np.asarray(correct)
    if correct.ndim != 2 or correct.shape[0] < 1 or correct.shape[1] < 1:
        raise ValueError(f"correct must be a non-empty [P, N] array, got shape {correct.shape}")
    if correct.dtype != np.bool_:
        if not np.all((correct == 0) | (correct == 1)):
            raise ValueError("correct must hold only 0/1 (or booleans)")
        correct = correct.astype(bool)
    return correct


def avg_at_k(correct: Bool[np.ndarray, "P N"]) -> float:
    """Mean accuracy over all P x N samples (avg@N, the paper's metric)."""
    return float(np.mean(_as_correct(correct)))


def mean_pass_at_k(correct: Bool[np.ndarray, "P N"], k: int) -> float:
    """pass@k averaged over the P problems, from N >= k samples each."""
    correct = _as_correct(correct)
    n = correct.shape[1]
    return float(np.mean([pass_at_k(n, int(c), k) for c in correct.sum(axis=1)]))


def pass_at_k_values(n: int) -> tuple[int, ...]:
    """The k reported for n samples: 1, 2, 4, ... (powers of two below n), and n."""
    n = check_int("n", n, 1)
    ks = {n}
    k = 1
    while k < n:
        ks.add(k)
        k *= 2
    return tuple(sorted(ks))


# ---- majority vote ---------------------------------------------------------------------------

_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_SPACING = re.compile(r"\\[,;:! ]|\\q?quad(?![A-Za-z])")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?")
_INTEGER = re.compile(r"[+-]?\d+")
_GROUPED_INTEGER = re.compile(r"[+-]?\d{1,3}(?:,\d{3})+")


def normalize_answer(answer: str | None) -> str | None:
    """A canonical form of an extracted final answer for voting (None: no vote).

    Conservative: only rewrites that never change the mathematical value. `\\dfrac`/`\\tfrac`
    -> `\\frac`; `\\left`/`\\right`, spacing commands (`\\,` `\\!` `\\;` `\\quad`), `$`,
    `^\\circ`, percent signs, a trailing full stop and all whitespace are dropped; an integer
    (with optional sign, `{,}` or `,` thousands groups, leading zeros) becomes its decimal form
    (`033` -> `33`, `1{,}000` -> `1000`).
    """
    if answer is None:
        return None
    if not isinstance(answer, str):
        raise ValueError(f"answer must be a str or None, got {type(answer).__name__}")
    s = answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT.sub("", s)
    s = _SPACING.sub("", s)
    s = _DEGREES.sub("", s)
    s = s.replace("\\%", "").replace("%", "").replace("$", "")
    s = "".join(s.split())
    s = s.rstrip(".")
    digits = s.replace("{,}", ",")
    if _GROUPED_INTEGER.fullmatch(digits):
        digits = digits.replace(",", "")
    if _INTEGER.fullmatch(digits):
        s = str(int(digits))
    return s or None


@dataclasses.dataclass(frozen=True)
class MajorityVote:
    """The result of one problem's vote.

    answer: the winning normalized answer (None when no sample has an answer).
    count: samples that voted for it.
    first_index: the lowest sample index that carries it (the tie-break key).
    voters: samples with an answer at all.
    """

    answer: str | None
    count: int
    first_index: int | None
    voters: int


def majority_vote(answers: Sequence[str | None]) -> MajorityVote:
    """Most frequent normalized answer; ties go to the one whose first sample comes first."""
    normalized = [normalize_answer(a) for a in answers]
    counts = collections.Counter(a for a in normalized if a is not None)
    if not counts:
        return MajorityVote(answer=None, count=0, first_index=None, voters=0)
    first = {}
    for i, a in enumerate(normalized):
        if a is not None and a not in first:
            first[a] = i
    winner = min(counts, key=lambda a: (-counts[a], first[a]))
    return MajorityVote(
        answer=winner, count=counts[winner], first_index=first[winner], voters=counts.total()
    )


def _majority_correct(
    answers: Sequence[str | None], correct: np.ndarray
) -> tuple[MajorityVote, bool]:
    vote = majority_vote(answers)
    if vote.answer is None:
        return vote, False
    members = [i for i, a in enumerate(answers) if normalize_answer(a) == vote.answer]
    return vote, bool(np.any(correct[members]))


def maj_at_k(answers: Sequence[Sequence[str | None]], correct: Bool[np.ndarray, "P N"]) -> float:
    """Fraction of problems whose majority answer is correct (maj@N over N samples each).

    answers[p][j]: the extracted final answer of sample j of problem p (None: no box).
    """
    correct = _as_correct(correct)
    if len(answers) != correct.shape[0] or any(len(a) != correct.shape[1] for a in answers):
        raise ValueError(
            f"answers must be {correct.shape[0]} lists of {correct.shape[1]} answers (the shape "
            f"of correct), got lengths {[len(a) for a in answers]}"
        )
    return float(
        np.mean([_majority_correct(a, c)[1] for a, c in zip(answers, correct, strict=True)])
    )


# ---- lengths ---------------------------------------------------------------------------------


def length_stats(lengths: Int[np.ndarray, " S"]) -> dict[str, float | int | None]:
    """count, mean, std, min, p50, p90, max of response lengths in tokens (None when empty)."""
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    if lengths.size == 0:
        return {"count": 0} | dict.fromkeys(("mean", "std", "min", "p50", "p90", "max"))
    if lengths.min() < 0:
        raise ValueError(f"lengths must be >= 0, got min {lengths.min()}")
    return {
        "count": int(lengths.size),
        "mean": float(lengths.mean()),
        "std": float(lengths.std()),
        "min": int(lengths.min()),
        "p50": float(np.percentile(lengths, 50)),
        "p90": float(np.percentile(lengths, 90)),
        "max": int(lengths.max()),
    }


# ---- everything at once ----------------------------------------------------------------------


def _check_inputs(correct, answers, lengths, truncated):
    correct = _as_correct(correct)
    lengths = np.asarray(lengths)
    truncated = np.asarray(truncated, bool)
    if lengths.shape != correct.shape or truncated.shape != correct.shape:
        raise ValueError(
            f"lengths {lengths.shape} and truncated {truncated.shape} must have the shape of "
            f"correct {correct.shape}"
        )
    if len(answers) != correct.shape[0] or any(len(a) != correct.shape[1] for a in answers):
        raise ValueError(f"answers must be {correct.shape[0]} lists of {correct.shape[1]}")
    return correct, lengths, truncated


def problem_rows(
    correct: Bool[np.ndarray, "P N"],
    answers: Sequence[Sequence[str | None]],
    lengths: Int[np.ndarray, "P N"],
    truncated: Bool[np.ndarray, "P N"],
) -> list[dict[str, Any]]:
    """The per-problem table: correct count, accuracy, pass@k (each reported k), the
    majority vote, answer-less and truncated samples, mean length."""
    correct, lengths, truncated = _check_inputs(correct, answers, lengths, truncated)
    n = correct.shape[1]
    rows = []
    for p in range(correct.shape[0]):
        c = int(correct[p].sum())
        vote, vote_correct = _majority_correct(answers[p], correct[p])
        rows.append(
            {
                "num_correct": c,
                "accuracy": c / n,
                "pass": {f"pass@{k}": pass_at_k(n, c, k) for k in pass_at_k_values(n)},
                "majority_answer": vote.answer,
                "majority_count": vote.count,
                "majority_correct": vote_correct,
                "no_answer": sum(normalize_answer(a) is None for a in answers[p]),
                "truncated": int(truncated[p].sum()),
                "mean_length": float(lengths[p].mean()),
            }
        )
    return rows


def summarize(
    correct: Bool[np.ndarray, "P N"],
    answers: Sequence[Sequence[str | None]],
    lengths: Int[np.ndarray, "P N"],
    truncated: Bool[np.ndarray, "P N"],
) -> dict[str, Any]:
    """Benchmark-level metrics and response-length statistics.

    metrics: avg@N, pass@k for `pass_at_k_values(N)`, maj@N, and the spread of accuracy over
    the N "runs" (run j = sample j of every problem): its std and min/max.
    lengths: `length_stats` of all samples, of the correct and the incorrect ones, and the
    fractions truncated (finish "length") and without a boxed answer.
    """
    correct, lengths, truncated = _check_inputs(correct, answers, lengths, truncated)
    n = correct.shape[1]
    metrics: dict[str, float] = {f"avg@{n}": avg_at_k(correct)}
    for k in pass_at_k_values(n):
        metrics[f"pass@{k}"] = mean_pass_at_k(correct, k)
    metrics[f"maj@{n}"] = maj_at_k(answers, correct)
    run_accuracy = correct.mean(axis=0)  # [N]: accuracy of run j
    metrics["run_accuracy_std"] = float(run_accuracy.std())
    metrics["run_accuracy_min"] = float(run_accuracy.min())
    metrics["run_accuracy_max"] = float(run_accuracy.max())
    no_answer = np.asarray([[normalize_answer(a) is None for a in row] for row in answers])
    return {
        "num_problems": int(correct.shape[0]),
        "samples_per_problem": n,
        "metrics": metrics,
        "lengths": {
            "all": length_stats(lengths),
            "correct": length_stats(lengths[correct]),
            "incorrect": length_stats(lengths[~correct]),
            "truncated_fraction": float(truncated.mean()),
            "no_answer_fraction": float(no_answer.mean()),
        },
    }
