"""Staleness-aware BAPO (`BAPOConfig.lag_buckets`): one bound search per version-lag bucket,
against a float64 literal reference on random batches with mixed lags, both statistics and
both scopes; equal to the paper's search when every token has one lag."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.algorithms import bapo
from tests.algorithms.test_bapo_property import near_tie, ref_search

B, T = 6, 20


def _batch(seed: int, lag_of_row=None):
    """Ratios around 1 (stale rows drift further), +-A per row, a ragged mask, lags per row."""
    rng = np.random.default_rng(seed)
    lags = rng.integers(0, 5, size=(B, 1)) if lag_of_row is None else np.full((B, 1), lag_of_row)
    log_ratio = rng.normal(0.0, 0.15 * (1 + lags), size=(B, T))
    behavior_logp = rng.uniform(-3.0, -0.05, size=(B, T))
    adv = np.where(rng.random((B, 1)) < 0.5, 1.0, -1.0) * rng.uniform(0.2, 1.5, size=(B, 1))
    mask = (np.arange(T)[None] < rng.integers(T // 2, T + 1, size=(B, 1))).astype(np.float64)
    logp = behavior_logp + log_ratio
    return (
        logp,
        behavior_logp,
        np.broadcast_to(adv, (B, T)) * mask,
        mask,
        np.broadcast_to(lags, (B, T)),
    )


def _ref_bucket_bounds(logp, behavior_logp, adv, mask, lags, config):
    """Each bucket's search on its own tokens (float64), then each token's bounds."""
    ratio = np.exp(logp - behavior_logp)
    bucket = np.minimum(lags, config.lag_buckets - 1)
    found = [
        ref_search(ratio, adv, mask * (bucket == b), behavior_logp, config)
        for b in range(config.lag_buckets)
    ]
    ties = any(
        near_tie(ratio, adv, mask * (bucket == b), found[b]["visited"], config.rho0, False)
        for b in range(config.lag_buckets)
    )
    c_low = np.array([f["c_low"] for f in found])[bucket]
    c_high = np.array([f["c_high"] for f in found])[bucket]
    return found, c_low, c_high, ties


def _ref_loss_and_grad(logp, behavior_logp, adv, mask, c_low, c_high, dual_clip):
    """The paper's clipped objective with per-token bounds, token mean, and d loss / d logp."""
    n = max(float(mask.sum()), 1.0)
    total, grad = 0.0, np.zeros_like(logp)
    for idx in np.ndindex(logp.shape):
        if mask[idx] == 0:
            continue
        a, r = adv[idx], math.exp(logp[idx] - behavior_logp[idx])
        lo, hi = c_low[idx], c_high[idx]
        if a > 0:
            total += a * min(r, hi)
            grad[idx] = -(a * r if r < hi else 0.0) / n
        elif a < 0:
            clipped, live = max(r, lo), r > lo
            if dual_clip is not None and clipped > dual_clip:
                clipped, live = dual_clip, False
            total += a * clipped
            grad[idx] = -(a * r if live else 0.0) / n
    return -total / n, grad


def _jax_loss(logp, behavior_logp, adv, mask, lags, config, **kw):
    f32 = lambda x: jnp.asarray(x, jnp.float32)

    def loss_fn(lp):
        return bapo.policy_loss(
            lp, f32(behavior_logp), f32(adv), f32(mask), config, lags=jnp.asarray(lags), **kw
        )

    return jax.value_and_grad(loss_fn, has_aux=True)(f32(logp))


@pytest.mark.parametrize("statistic", ["value", "gradient"])
@pytest.mark.parametrize(  # the authors' variant long: in `make test-slow` (CI runs it)
    "order, target, rho0",
    [
        ("upper_first", "fraction", 0.55),
        pytest.param("lower_first", "pos_neg_ratio", 1.2, marks=pytest.mark.slow),
    ],
)
@pytest.mark.parametrize(
    "seed", [0, 1, *(pytest.param(s, marks=pytest.mark.slow) for s in (2, 3, 4))]
)
def test_each_bucket_searches_alone_against_the_float64_reference(
    statistic, order, target, rho0, seed
):
    config = bapo.BAPOConfig(
        rho0=rho0, order=order, target=target, statistic=statistic, lag_buckets=3, dual_clip=3.0
    )
    logp, behavior_logp, adv, mask, lags = _batch(seed)
    found, c_low, c_high, ties = _ref_bucket_bounds(logp, behavior_logp, adv, mask, lags, config)
    if ties:
        pytest.skip("a bucket's path passes within float32 rounding of a grid value or rho0")
    (loss, metrics), grad = _jax_loss(logp, behavior_logp, adv, mask, lags, config)
    for b, f in enumerate(found):
        assert float(metrics[f"c_low/lag{b}"]) == pytest.approx(f["c_low"], abs=1e-6)
        assert float(metrics[f"c_high/lag{b}"]) == pytest.approx(f["c_high"], abs=1e-6)
        if math.isfinite(f["rho"]):
            assert float(metrics[f"rho/lag{b}"]) == pytest.approx(f["rho"], rel=1e-5)
    assert bool(metrics["reached"]) == all(f["reached"] for f in found)
    assert int(metrics["iterations"]) == max(f["iterations"] for f in found)
    ref_loss, ref_grad = _ref_loss_and_grad(logp, behavior_logp, adv, mask, c_low, c_high, 3.0)
    assert float(loss) == pytest.approx(ref_loss, rel=1e-5, abs=1e-7)
    np.testing.assert_allclose(np.asarray(grad), ref_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("statistic", ["value", "gradient"])
@pytest.mark.parametrize("lag", [0, pytest.param(1, marks=pytest.mark.slow), 7])
def test_one_lag_is_the_papers_search(statistic, lag):
    """Every token at one lag: one non-empty bucket, the same bounds, loss and gradient."""
    logp, behavior_logp, adv, mask, lags = _batch(11, lag_of_row=lag)
    plain = bapo.BAPOConfig(rho0=0.55, statistic=statistic)
    staleness = bapo.BAPOConfig(rho0=0.55, statistic=statistic, lag_buckets=4)
    (loss, m), grad = _jax_loss(logp, behavior_logp, adv, mask, lags, staleness)
    (ref, rm), ref_grad = _jax_loss(logp, behavior_logp, adv, mask, lags, plain)
    assert float(loss) == float(ref)
    np.testing.assert_array_equal(np.asarray(grad), np.asarray(ref_grad))
    for key in ("c_low", "c_high", "iterations", "reached"):
        assert float(m[key]) == pytest.approx(float(rm[key]), abs=1e-6), key
    for key in ("rho", "rho_fraction", "rho_before"):
        assert float(m[key]) == pytest.approx(float(rm[key]), rel=1e-5), key


@pytest.mark.parametrize("statistic", ["value", "gradient"])
def test_the_update_wide_sums_add_over_micro_batches(statistic):
    """scope="update" under accumulation: each micro-batch's per-bucket grid sums, added, give
    the whole update's search; its bounds passed to each micro-batch give the full loss."""
    config = bapo.BAPOConfig(rho0=0.55, statistic=statistic, lag_buckets=3)
    logp, behavior_logp, adv, mask, lags = _batch(3)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    ratio = jnp.exp(f32(logp) - f32(behavior_logp)) * f32(mask) + (1 - f32(mask))
    hook = bapo.UPDATE_WIDE_SEARCH
    total = hook.zeros(config)
    for rows in (slice(0, 3), slice(3, 6)):
        part = hook.partial(ratio[rows], f32(adv)[rows], f32(mask)[rows], f32(behavior_logp)[rows],
                            config, lags=jnp.asarray(lags)[rows])  # fmt: skip
        total = total + part
    bounds = hook.finish(total, config)
    sums = bapo.bucket_grid_sums(
        ratio, f32(adv), f32(mask), config, f32(behavior_logp), jnp.asarray(lags)
    )
    whole = bapo.bucket_search(sums, config)
    np.testing.assert_array_equal(np.asarray(bounds.c_low), np.asarray(whole.c_low))
    np.testing.assert_array_equal(np.asarray(bounds.c_high), np.asarray(whole.c_high))
    (full, _), _ = _jax_loss(logp, behavior_logp, adv, mask, lags, config)
    parts = 0.0
    for rows in (slice(0, 3), slice(3, 6)):
        args = (logp[rows], behavior_logp[rows], adv[rows], mask[rows], lags[rows], config)
        (part, _), _ = _jax_loss(*args, bounds=bounds, num_tokens=float(mask.sum()))
        parts += float(part)
    assert parts == pytest.approx(float(full), rel=1e-5)


def test_stale_negatives_do_not_move_the_fresh_tokens_bounds():
    """Fresh tokens balanced at the start bounds, stale ones (lag 2) negative-heavy with ratios
    far below 1: the paper's one search widens every token's bounds; per lag, the fresh
    bucket keeps its start bounds and only the stale bucket's move."""
    ratio = np.ones((4, 6))
    ratio[2:] = 0.3  # stale rows
    adv = np.array([[1.0], [-1.0], [1.0], [-4.0]]) * np.ones((1, 6))
    mask = np.ones((4, 6))
    lags = np.array([[0], [0], [2], [2]]) * np.ones((1, 6), int)
    behavior_logp = np.full((4, 6), -1.0)
    logp = behavior_logp + np.log(ratio)
    plain = bapo.BAPOConfig(rho0=0.45)
    aware = bapo.BAPOConfig(rho0=0.45, lag_buckets=3)
    (_, one), _ = _jax_loss(logp, behavior_logp, adv, mask, lags, plain)
    (_, per_lag), _ = _jax_loss(logp, behavior_logp, adv, mask, lags, aware)
    start = (plain.c_low_start, plain.c_high_start)
    assert (float(one["c_low"]), float(one["c_high"])) != pytest.approx(start)
    fresh = (float(per_lag["c_low/lag0"]), float(per_lag["c_high/lag0"]))
    stale = (float(per_lag["c_low/lag2"]), float(per_lag["c_high/lag2"]))
    assert fresh == pytest.approx(start) and stale != pytest.approx(start)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match=r"lag_buckets must be an int in 1\.\.4, got 5"):
        bapo.BAPOConfig(lag_buckets=5)
    with pytest.raises(ValueError, match=r"lag_buckets must be an int in 1\.\.4, got 0"):
        bapo.BAPOConfig(lag_buckets=0)
    assert bapo.BAPOConfig(lag_buckets=2).uses_lags and not bapo.BAPOConfig().uses_lags
    logp, behavior_logp, adv, mask, _ = _batch(0)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    with pytest.raises(ValueError, match="lag_buckets=2 needs each token's lag"):
        args = (f32(logp), f32(behavior_logp), f32(adv), f32(mask))
        bapo.policy_loss(*args, bapo.BAPOConfig(lag_buckets=2))
