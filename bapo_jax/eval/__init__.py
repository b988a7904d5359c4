"""Evaluation: avg@k (the paper's metric), unbiased pass@k, maj@k, length statistics, reports.

The CLI is `python -m bapo_jax.eval` (see `bapo_jax/eval/__main__.py` and docs/eval.md).
"""

from bapo_jax.eval.metrics import (
    MajorityVote,
    avg_at_k,
    length_stats,
    maj_at_k,
    majority_vote,
    mean_pass_at_k,
    normalize_answer,
    pass_at_k,
    pass_at_k_values,
    problem_rows,
    summarize,
)
from bapo_jax.eval.report import (
    ProblemResult,
    build_report,
    render_markdown,
    write_report,
    write_samples,
)

__all__ = [
    "MajorityVote",
    "ProblemResult",
    "avg_at_k",
    "build_report",
    "length_stats",
    "maj_at_k",
    "majority_vote",
    "mean_pass_at_k",
    "normalize_answer",
    "pass_at_k",
    "pass_at_k_values",
    "problem_rows",
    "render_markdown",
    "summarize",
    "write_report",
    "write_samples",
]
