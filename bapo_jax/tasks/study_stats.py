"""The statistics of a multi-seed study: bootstrap intervals, paired t-tests, Holm's correction.

Runs of different arms with the same seed share their prompt order and sampling seed, so arms
are compared paired by seed: the per-seed differences d_i = x_i(arm) - x_i(baseline) are tested
against zero with a two-sided paired t-test (t = mean(d) / (sd(d) / sqrt(n)), n - 1 degrees of
freedom). With 5 pairs a Wilcoxon signed-rank test cannot go below p = 2 / 2^5 = 0.0625, hence
the t-test. Holm's step-down correction controls the family-wise error across the comparisons
of one table: sort the m p-values, multiply the i-th smallest (i from 0) by m - i, carry the
running maximum, cap at 1.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from jaxtyping import Float
from scipy import stats

BOOTSTRAP_RESAMPLES = 10_000


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean and its percentile-bootstrap interval at `level`."""

    mean: float
    low: float
    high: float
    level: float = 0.95

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def bootstrap_mean(
    values: Float[np.ndarray, " n"] | Sequence[float],
    *,
    level: float = 0.95,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> Interval:
    """Mean of `values` and the percentile bootstrap interval of the mean: `resamples` draws of
    n values with replacement (numpy's default generator seeded with `seed`: deterministic),
    the (1 - level) / 2 and (1 + level) / 2 quantiles of their means."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or len(x) == 0 or not np.all(np.isfinite(x)):
        raise ValueError(f"values must be a non-empty 1-d array of finite numbers, got {x!r}")
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, len(x), size=(resamples, len(x)))].mean(axis=1)
    tail = (1 - level) / 2
    low, high = np.quantile(means, [tail, 1 - tail])
    return Interval(float(x.mean()), float(low), float(high), level)


@dataclasses.dataclass(frozen=True)
class PairedTest:
    """A paired comparison: mean difference (a - b), t statistic, two-sided p, n pairs."""

    mean_diff: float
    t: float
    p: float
    n: int


def paired_t_test(
    a: Float[np.ndarray, " n"] | Sequence[float], b: Float[np.ndarray, " n"] | Sequence[float]
) -> PairedTest:
    """Two-sided paired t-test of mean(a - b) = 0. Differences that are all equal have no
    spread: p = 1 when they are all zero (identical runs), 0 otherwise (t = +-inf)."""
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"a and b must be 1-d of the same length >= 2, got {x.shape}, {y.shape}")
    d = x - y
    n, mean = len(d), float(d.mean())
    sd = float(d.std(ddof=1))
    if sd == 0.0:
        if mean == 0.0:
            return PairedTest(0.0, 0.0, 1.0, n)
        return PairedTest(mean, math.copysign(math.inf, mean), 0.0, n)
    t = mean / (sd / math.sqrt(n))
    p = float(2 * stats.t.sf(abs(t), df=n - 1))
    return PairedTest(mean, t, p, n)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm-adjusted p-values, in the input order (module doc)."""
    p = np.asarray(p_values, dtype=np.float64)
    if p.ndim != 1 or np.any((p < 0) | (p > 1)) or np.any(np.isnan(p)):
        raise ValueError(f"p_values must be numbers in [0, 1], got {list(p_values)}")
    m = len(p)
    order = np.argsort(p, kind="stable")
    adjusted = np.empty(m)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p[i]))
        adjusted[i] = running
    return adjusted.tolist()
