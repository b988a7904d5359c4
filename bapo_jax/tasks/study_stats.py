"""The statistics of a multi-seed study: intervals, paired t-tests, equivalence, power, Holm.

Runs of different arms with the same seed share their prompt order and sampling seed, so arms
are compared paired by seed: the per-seed differences d_i = x_i(arm) - x_i(baseline) are tested
against zero with a two-sided paired t-test (t = mean(d) / (sd(d) / sqrt(n)), n - 1 degrees of
freedom). With 5 pairs a Wilcoxon signed-rank test cannot go below p = 2 / 2^5 = 0.0625, hence
the t-test. Holm's step-down correction controls the family-wise error across the comparisons
of one table: sort the m p-values, multiply the i-th smallest (i from 0) by m - i, carry the
running maximum, cap at 1.

For a handful of seeds (the study v2): `paired_interval`, the t interval of the mean paired
difference (a percentile bootstrap over 5 values covers well under its nominal level); `tost`,
equivalence within +-margin by two one-sided paired t-tests; `paired_power`, the power of the
paired t-test from the noncentral t; `detectable_effect`, the smallest difference a design
detects with 80% power; `seeds_needed`, the fewest seeds that detect a given one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
from jaxtyping import Float
from scipy import optimize, stats

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


# ---- intervals, equivalence and power for a handful of seeds -------------------------------------
@dataclasses.dataclass(frozen=True)
class PairedInterval:
    """The mean of the paired differences d = a - b, its t interval at `level`
    (mean +- t_{(1+level)/2, n-1} sd / sqrt(n)), their sd and n."""

    mean_diff: float
    low: float
    high: float
    sd: float
    n: int
    level: float = 0.95

    def __str__(self) -> str:
        return f"{self.mean_diff:+.3f} [{self.low:+.3f}, {self.high:+.3f}]"


def _differences(a, b) -> np.ndarray:
    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2 or not np.all(np.isfinite(x - y)):
        raise ValueError(f"a and b must be finite, 1-d, of one length >= 2: {x.shape}, {y.shape}")
    return x - y


def paired_interval(
    a: Float[np.ndarray, " n"] | Sequence[float],
    b: Float[np.ndarray, " n"] | Sequence[float],
    level: float = 0.95,
) -> PairedInterval:
    """The paired t confidence interval of mean(a - b) (exact under normal differences; with
    5 seeds a percentile bootstrap's nominal 95% covers about 84%)."""
    if not 0 < level < 1:
        raise ValueError(f"level must be in (0, 1), got {level}")
    d = _differences(a, b)
    n, mean, sd = len(d), float(d.mean()), float(d.std(ddof=1))
    half = float(stats.t.ppf((1 + level) / 2, df=n - 1)) * sd / math.sqrt(n)
    return PairedInterval(mean, mean - half, mean + half, sd, n, level)


def tost(
    a: Float[np.ndarray, " n"] | Sequence[float],
    b: Float[np.ndarray, " n"] | Sequence[float],
    margin: float,
) -> float:
    """p of the two one-sided paired t-tests of equivalence within +-`margin` (H0: |mean(a -
    b)| >= margin): the larger of P(T >= t_low) and P(T <= t_high), t_low = (mean + margin) /
    se, t_high = (mean - margin) / se. p < alpha iff the (1 - 2 alpha) interval lies inside
    (-margin, margin)."""
    if not margin > 0:
        raise ValueError(f"margin must be > 0, got {margin}")
    d = _differences(a, b)
    n, mean, sd = len(d), float(d.mean()), float(d.std(ddof=1))
    if sd == 0.0:
        return 0.0 if abs(mean) < margin else 1.0
    se = sd / math.sqrt(n)
    p_low = float(stats.t.sf((mean + margin) / se, df=n - 1))
    p_high = float(stats.t.cdf((mean - margin) / se, df=n - 1))
    return max(p_low, p_high)


def paired_power(effect: float, sd: float, n: int, alpha: float) -> float:
    """Power of the two-sided paired t-test at level `alpha` with n pairs whose differences have
    mean `effect` and sd `sd`: P(|T'| > t_{1-alpha/2, n-1}), T' noncentral t with n - 1
    degrees of freedom and noncentrality effect / (sd / sqrt(n))."""
    if sd <= 0 or n < 2 or not 0 < alpha < 1:
        raise ValueError(f"need sd > 0, n >= 2, alpha in (0, 1): got {sd}, {n}, {alpha}")
    df, nc = n - 1, abs(effect) / (sd / math.sqrt(n))  # symmetric in the effect's sign
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    near = float(stats.nct.sf(crit, df, nc))
    far = float(stats.nct.cdf(-crit, df, nc))  # < alpha / 2; scipy gives NaN far out in it
    if not math.isfinite(near):
        raise ValueError(f"no power for effect {effect}, sd {sd}, n {n} (noncentral t failed)")
    return near + (far if math.isfinite(far) else 0.0)


def detectable_effect(sd: float, n: int, alpha: float, power: float = 0.8) -> float:
    """The smallest mean difference the paired t-test at level `alpha` detects with `power`
    (n pairs, difference sd `sd`): the root of paired_power(effect) = power."""
    if not 0 < power < 1:
        raise ValueError(f"power must be in (0, 1), got {power}")
    high = sd
    while paired_power(high, sd, n, alpha) < power:
        high *= 2
    return float(optimize.brentq(lambda e: paired_power(e, sd, n, alpha) - power, 0.0, high))


def seeds_needed(
    sd: float, effect: float, alpha: float, power: float = 0.8, most: int = 100
) -> int | None:
    """The fewest pairs (>= 2) whose paired t-test at `alpha` detects `effect` with `power`;
    None when `most` are not enough."""
    for n in range(2, most + 1):
        if paired_power(effect, sd, n, alpha) >= power:
            return n
    return None
