"""Property tests: BAPO's bucketed jitted search and loss vs a float64 literal-loop reference.

The reference below is a plain transcription of the spec (docs/algorithms.md, "The algorithm"):
at every iteration it recomputes every token's contribution at the current bounds; it shares
no code with the bucketed implementation. Examples where float32 and float64 may legitimately
disagree (the spec's near-ties) are skipped, batch by batch:
  - a counted token's ratio within rounding of a visited grid value, or
  - the statistic within rounding of rho0 at a visited pair of bounds.
"""

import itertools
import math

import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from bapo_jax.algorithms import bapo, bapo_search

B, T = 4, 8  # fixed shapes: one compilation per drawn config
BATCHES = 4  # data batches checked per drawn config
TIE = 1e-5  # relative distance counted as "within rounding"

# ------------------------------------------------------------------------------------------
# Reference (float64, literal loops).


def ref_grid(start, stop, step):
    n = math.floor((stop - start) / step + 1e-6)
    return [start + i * step for i in range(n + 1)]


def ref_statistic(ratio, adv, mask, weight, c_low, c_high, statistic, target):
    pos = neg = 0.0
    for r, a, m, w in zip(ratio.flat, adv.flat, mask.flat, weight.flat, strict=True):
        if m == 0 or a == 0:
            continue
        if statistic == "value":
            if a > 0:
                pos += w * a * min(r, c_high)
            else:
                neg += w * -a * max(r, c_low)
        else:
            if a > 0 and r < c_high:
                pos += w * a * r
            if a < 0 and r > c_low:
                neg += w * -a * r
    if target == "fraction":
        return 1.0 if pos + neg == 0 else pos / (pos + neg)
    return math.inf if neg == 0 else pos / neg


def ref_search(ratio, adv, mask, behavior_logp, config):
    lows = ref_grid(config.c_low_start, config.c_low_max, config.c_low_step)
    highs = ref_grid(config.c_high_start, config.c_high_max, config.c_high_step)
    weight = np.exp(behavior_logp) if config.weight_by_behavior_prob else np.ones_like(ratio)

    def stat(i, j):
        return ref_statistic(
            ratio, adv, mask, weight, lows[i], highs[j], config.statistic, config.target
        )

    i = j = 0
    rho = rho_before = stat(0, 0)
    visited = [(lows[0], highs[0], rho)]
    while rho < config.rho0 and (i < len(lows) - 1 or j < len(highs) - 1):
        if config.order == "upper_first":
            if j < len(highs) - 1:
                j += 1
            else:
                i += 1
        elif i < len(lows) - 1:
            i += 1
        else:
            j += 1
        rho = stat(i, j)
        visited.append((lows[i], highs[j], rho))
    return {
        "c_low": lows[i],
        "c_high": highs[j],
        "rho": rho,
        "rho_before": rho_before,
        "iterations": len(visited) - 1,
        "reached": rho >= config.rho0,
        "visited": visited,
    }


def near_tie(ratio, adv, mask, visited, rho0, exact_ratios):
    """The spec's near-ties on the visited path: rho within rounding of rho0, or a counted
    ratio whose comparison with a grid value may differ between float32 and float64.

    exact_ratios: the device sees exactly these ratios (as float32), so only a ratio between a
    grid value and its float32 rounding compares differently; ratios exactly on a grid value
    that float32 represents (e.g. r = 1.0 at c_high = 1.0) are checked, not skipped. Otherwise
    the device computes its own ratio and any ratio within TIE of a grid value is skipped.
    """
    counted = ratio[(mask > 0) & (adv != 0)]
    for c_low, c_high, rho in visited:
        if math.isfinite(rho) and abs(rho - rho0) <= TIE * max(1.0, abs(rho0)):
            return True
        for bound in (c_low, c_high):
            device_bound = float(np.float32(bound))
            if exact_ratios:
                differs = (counted < bound) != (counted < device_bound)
                differs |= (counted <= bound) != (counted <= device_bound)
            else:
                differs = np.abs(counted - bound) <= TIE * bound
            if np.any(differs):
                return True
    return False


def ref_loss_and_grad(logp, behavior_logp, adv, mask, c_low, c_high, dual_clip):
    n = max(float(mask.sum()), 1.0)
    total = 0.0
    grad = np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        if mask[idx] == 0:
            continue
        a = adv[idx]
        r = math.exp(logp[idx] - behavior_logp[idx])
        d_objective = 0.0  # d J_t / d logp_t; d r / d logp = r
        if a > 0:
            objective = a * min(r, c_high)
            if r < c_high:
                d_objective = a * r
        elif a < 0:
            clipped = max(r, c_low)
            live = r > c_low
            if dual_clip is not None and clipped > dual_clip:
                clipped, live = dual_clip, False
            objective = a * clipped
            if live:
                d_objective = a * r
        else:
            objective = 0.0
        total += objective
        grad[idx] = -d_objective / n
    return -total / n, grad


# ------------------------------------------------------------------------------------------
# Strategies.

GRIDS = [
    {},  # the paper's grids
    {"c_low_start": 0.6, "c_low_max": 0.6},  # c_low pinned
    {"c_low_start": 0.5, "c_low_max": 0.95, "c_low_step": 0.15, "c_high_max": 2.0},
    {"c_high_start": 1.0, "c_high_max": 1.4, "c_high_step": 0.1, "c_low_max": 0.8},
]


# Every combination of the variants is a test case; rho0, grids and dual clip are drawn. The
# lower-first half is in the slow suite (`make test-slow`, which CI runs).
VARIANTS = pytest.mark.parametrize(
    "order,target,statistic,weighted",
    [
        pytest.param(*v, marks=pytest.mark.slow) if v[0] == "lower_first" else v
        for v in itertools.product(
            ["upper_first", "lower_first"],
            ["fraction", "pos_neg_ratio"],
            ["value", "gradient"],
            [False, True],
        )
    ],
)


@st.composite
def configs(draw, batch, order, target, statistic, weighted, dual_clip=False):
    """A config of the given variant. Half the time rho0 lies between the first batch's
    statistic at the start bounds and at both max bounds, so that the search moves part-way."""
    grid = draw(st.sampled_from(GRIDS))
    rho0 = draw(st.floats(0.05, 0.99) if target == "fraction" else st.floats(0.1, 5.0))
    if draw(st.booleans()):
        probe = bapo.BAPOConfig(**grid)
        log_ratio, behavior_logp, advantages, masks = (x[0].astype(np.float64) for x in batch)
        weight = np.exp(behavior_logp) if weighted else np.ones_like(log_ratio)
        ends = [
            ref_statistic(
                np.exp(log_ratio), advantages, masks, weight, c_low, c_high, statistic, target
            )
            for c_low, c_high in [
                (probe.c_low_start, probe.c_high_start),
                (probe.low_grid[-1], probe.high_grid[-1]),
            ]
        ]
        low, high = min(ends), max(ends)
        if 0 < low < high < math.inf:
            rho0 = low + draw(st.floats(0.05, 0.95)) * (high - low)
    return bapo.BAPOConfig(
        rho0=rho0,
        target=target,
        order=order,
        statistic=statistic,
        weight_by_behavior_prob=weighted,
        dual_clip=draw(st.sampled_from([None, 3.0])) if dual_clip else None,
        **grid,
    )


def batches():
    shape = (BATCHES, B, T)

    def arrays(elements):  # every element drawn (no fill value repeated across the array)
        return hnp.arrays(np.float32, shape, elements=elements, fill=st.nothing())

    log_ratio = arrays(st.floats(-1.5, 1.5, width=32))
    behavior_logp = arrays(st.floats(-4.0, 0.0, width=32))
    # |A| >= 2**-10: products near float32's underflow flush to zero on device (count nowhere).
    magnitude = st.floats(2.0**-10, 2.0, width=32)
    advantage = st.one_of(st.just(0.0), magnitude, magnitude.map(lambda a: -a))
    advantages = arrays(advantage)
    masks = arrays(st.sampled_from([0.0, 1.0, 1.0, 1.0]))
    return st.tuples(log_ratio, behavior_logp, advantages, masks)


# Run eagerly: JAX caches each primitive's executable by shape, so a new config costs no
# compilation (a jitted function would compile once per drawn config). jit == eager is
# checked in test_bapo_transforms.py.
def search(ratio, advantages, mask, behavior_logp, config):
    return bapo_search.search_bounds(ratio, advantages, mask, config, behavior_logp)


def loss_and_grad(logp, behavior_logp, advantages, mask, config):
    def loss_fn(lp):
        return bapo.policy_loss(lp, behavior_logp, advantages, mask, config)

    return jax.value_and_grad(loss_fn, has_aux=True)(logp)


# Each example checks BATCHES batches.
SEARCH_SETTINGS = settings(
    max_examples=3, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
LOSS_SETTINGS = settings(SEARCH_SETTINGS, max_examples=2)

# ------------------------------------------------------------------------------------------
# Tests.


def _moves_bucket(moves):
    return "0" if moves == 0 else "all" if moves >= 30 else "some"


@VARIANTS
@SEARCH_SETTINGS
@given(data=st.data(), batch=batches())
def test_search_matches_literal_reference(order, target, statistic, weighted, data, batch):
    config = data.draw(configs(batch, order, target, statistic, weighted))
    log_ratio, behavior_logp, advantages, masks = batch
    checked = 0
    for k in range(BATCHES):
        ratio = np.exp(log_ratio[k]).astype(np.float32)  # the device's ratios, exactly
        adv, mask, blogp = advantages[k], masks[k], behavior_logp[k]
        ref = ref_search(
            ratio.astype(np.float64),
            adv.astype(np.float64),
            mask,
            blogp.astype(np.float64),
            config,
        )
        if near_tie(ratio.astype(np.float64), adv, mask, ref["visited"], config.rho0, True):
            event("batch skipped: near-tie")
            continue
        event(f"moves: {_moves_bucket(ref['iterations'])}")
        got = search(ratio, adv, mask, blogp, config)
        assert int(got.iterations) == ref["iterations"]
        assert got.c_low == np.float32(ref["c_low"]) and got.c_high == np.float32(ref["c_high"])
        assert bool(got.reached) == ref["reached"]
        np.testing.assert_allclose(got.rho, ref["rho"], rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(got.rho_before, ref["rho_before"], rtol=1e-5, atol=1e-7)
        checked += 1
    assume(checked > 0)  # an example whose batches were all near-ties checked nothing


@VARIANTS
@LOSS_SETTINGS
@given(data=st.data(), batch=batches())
def test_loss_and_gradient_match_literal_reference(order, target, statistic, weighted, data, batch):
    config = data.draw(configs(batch, order, target, statistic, weighted, dual_clip=True))
    log_ratio, behavior_logp, advantages, masks = batch
    checked = 0
    for k in range(BATCHES):
        blogp = behavior_logp[k]
        logp = (blogp + log_ratio[k]).astype(np.float32)
        adv, mask = advantages[k], masks[k]
        ratio = np.exp(logp.astype(np.float64) - blogp.astype(np.float64))
        ref = ref_search(ratio, adv.astype(np.float64), mask, blogp.astype(np.float64), config)
        if near_tie(ratio, adv, mask, ref["visited"], config.rho0, False):
            continue
        if config.dual_clip is not None and np.any(
            np.abs(ratio[(mask > 0) & (adv < 0)] - config.dual_clip) <= TIE * config.dual_clip
        ):
            continue
        checked += 1
        ref_loss, ref_grad = ref_loss_and_grad(
            logp.astype(np.float64),
            blogp.astype(np.float64),
            adv.astype(np.float64),
            mask,
            ref["c_low"],
            ref["c_high"],
            config.dual_clip,
        )
        (loss, metrics), grad = loss_and_grad(logp, blogp, adv, mask, config)
        assert int(metrics["iterations"]) == ref["iterations"]
        scale = float(np.sum(np.abs(adv) * np.exp(log_ratio[k]) * mask)) / max(mask.sum(), 1.0)
        np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6 * scale + 1e-12)
        np.testing.assert_allclose(grad, ref_grad, rtol=1e-5, atol=1e-9)
    assume(checked > 0)
