"""Hand-computed BAPO cases: every expected number is worked out in the comments.

Default grids: c_low 0.60, 0.62, ..., 0.90 (16 values, 15 moves); c_high 1.20, 1.25, ..., 3.00
(37 values, 36 moves); 51 moves in all. Value statistic (default): P = sum_{A>0} A min(r, c_high),
N = sum_{A<0} |A| max(r, c_low); fraction rho = P / (P + N).
"""

import functools
import itertools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.algorithms import bapo, bapo_search


@functools.partial(jax.jit, static_argnums=(3,))
def _search(ratio, advantages, mask, config, behavior_logp):
    return bapo_search.search_bounds(ratio, advantages, mask, config, behavior_logp)


def search(ratios, advantages, config, mask=None, behavior_probs=None):
    """One sequence [1, T] of the given per-token ratios and advantages."""
    ratio = jnp.asarray([ratios], jnp.float32)
    adv = jnp.asarray([advantages], jnp.float32)
    mask = jnp.ones_like(ratio) if mask is None else jnp.asarray([mask], jnp.float32)
    blogp = None if behavior_probs is None else jnp.log(jnp.asarray([behavior_probs], jnp.float32))
    return _search(ratio, adv, mask, config, blogp)


def assert_result(result, *, c_low, c_high, iterations, reached, rho=None, rho_before=None):
    np.testing.assert_allclose(result.c_low, c_low, rtol=1e-6)
    np.testing.assert_allclose(result.c_high, c_high, rtol=1e-6)
    assert int(result.iterations) == iterations
    assert bool(result.reached) is reached
    if rho is not None:
        np.testing.assert_allclose(result.rho, rho, rtol=1e-6)
    if rho_before is not None:
        np.testing.assert_allclose(result.rho_before, rho_before, rtol=1e-6)


DEFAULT = bapo.BAPOConfig()


def test_target_met_at_start_bounds_makes_no_move():
    # (A=+1, r=1.0), (A=-1, r=1.0): P = min(1, 1.2) = 1, N = max(1, 0.6) = 1 -> rho 0.5 >= 0.4.
    result = search([1.0, 1.0], [1.0, -1.0], DEFAULT)
    assert_result(
        result, c_low=0.6, c_high=1.2, iterations=0, reached=True, rho=0.5, rho_before=0.5
    )


def test_unreachable_target_ends_at_both_max_bounds():
    # (A=+1, r=0.1): P = min(0.1, c_high) = 0.1 for every c_high.
    # (A=-1, r=1.0): N = max(1.0, c_low) = 1.0 for every c_low <= 0.9.
    # rho = 0.1 / 1.1 = 1/11 < 0.4 everywhere: all 36 + 15 = 51 moves, not reached.
    for order in ("upper_first", "lower_first"):
        config = bapo.BAPOConfig(order=order)
        result = search([0.1, 1.0], [1.0, -1.0], config)
        assert_result(
            result,
            c_low=0.9,
            c_high=3.0,
            iterations=51,
            reached=False,
            rho=1 / 11,
            rho_before=1 / 11,
        )


@pytest.mark.parametrize("target,rho", [("fraction", 1.0), ("pos_neg_ratio", math.inf)])
def test_all_positive_advantages(target, rho):
    # N = 0: fraction P / (P + 0) = 1; pos_neg_ratio P / 0 = +inf. Met at the start.
    config = bapo.BAPOConfig(target=target, rho0=0.9)
    result = search([0.5, 2.0, 1.0], [1.0, 0.5, 2.0], config)
    assert_result(result, c_low=0.6, c_high=1.2, iterations=0, reached=True, rho=rho)


@pytest.mark.parametrize("target", ["fraction", "pos_neg_ratio"])
def test_all_negative_advantages(target):
    # P = 0, N > 0: rho = 0 for both targets at every bound; 51 moves, not reached.
    config = bapo.BAPOConfig(target=target)
    result = search([0.5, 2.0, 1.0], [-1.0, -0.5, -2.0], config)
    assert_result(result, c_low=0.9, c_high=3.0, iterations=51, reached=False, rho=0.0)


@pytest.mark.parametrize("target,rho", [("fraction", 1.0), ("pos_neg_ratio", math.inf)])
def test_all_zero_advantages_count_nowhere(target, rho):
    # P = N = 0: fraction defined as 1, pos_neg_ratio as +inf (N = 0). No move.
    config = bapo.BAPOConfig(target=target)
    result = search([0.5, 2.0, 1.0], [0.0, 0.0, 0.0], config)
    assert_result(result, c_low=0.6, c_high=1.2, iterations=0, reached=True, rho=rho)


def test_empty_mask_counts_nothing_and_gives_zero_loss():
    # Masked tokens count nowhere: P = N = 0 -> rho = 1, no move. Loss sums nothing -> 0.
    result = search([0.5, 2.0], [1.0, -1.0], DEFAULT, mask=[0.0, 0.0])
    assert_result(result, c_low=0.6, c_high=1.2, iterations=0, reached=True, rho=1.0)
    logp = jnp.asarray([[-1.0, -2.0]], jnp.float32)
    blogp = jnp.asarray([[-1.5, -1.0]], jnp.float32)
    adv = jnp.asarray([[1.0, -1.0]], jnp.float32)
    mask = jnp.zeros((1, 2), jnp.float32)
    (loss, metrics), grad = _jit_loss_and_grad(logp, blogp, adv, mask, DEFAULT, {})
    chex.assert_trees_all_close(loss, jnp.float32(0.0))
    chex.assert_trees_all_close(grad, jnp.zeros((1, 2)))
    chex.assert_tree_all_finite(metrics)
    chex.assert_trees_all_close(metrics["ratio_min"], jnp.float32(0.0))


def test_c_low_pinned_does_not_stall_the_search():
    # c_low grid {0.6}. (A=+1, r=2.0): P = min(2, c_high); (A=-1, r=1.0): N = 1.
    # rho0 = 0.58 needs P / (P + 1) >= 0.58, i.e. P >= 1.381:
    # c_high 1.35 -> 1.35/2.35 = 0.5745 < 0.58, c_high 1.40 -> 1.4/2.4 = 0.58333 >= 0.58.
    # So 4 moves of c_high (1.25, 1.3, 1.35, 1.4). The
    # paper's literal guard "while c_low can still move" would stop at once with 0 moves.
    for order in ("upper_first", "lower_first"):
        config = bapo.BAPOConfig(rho0=0.58, c_low_start=0.6, c_low_max=0.6, order=order)
        result = search([2.0, 1.0], [1.0, -1.0], config)
        assert_result(
            result,
            c_low=0.6,
            c_high=1.4,
            iterations=4,
            reached=True,
            rho=1.4 / 2.4,
            rho_before=1.2 / 2.2,
        )
    # Unreachable with c_low pinned: only the 36 c_high moves exist.
    config = bapo.BAPOConfig(c_low_start=0.6, c_low_max=0.6)
    result = search([0.1, 1.0], [1.0, -1.0], config)
    assert_result(result, c_low=0.6, c_high=3.0, iterations=36, reached=False)


def test_grid_reaches_0_90_not_0_88():
    # Accumulating 0.6 + 0.02 + ... in float64 gives 0.8800000000000002, and one more step
    # 0.9000000000000002 > 0.9, so an accumulating loop stops at 0.88. So does flooring in float32:
    # (0.9f - 0.6f) / 0.02f = 14.999998 -> 14. The grid is start + i * step with
    # n = floor((0.9 - 0.6) / 0.02 + 1e-6) = 15 in float64: 16 values, the last 0.9.
    accumulated = 0.6
    while accumulated + 0.02 <= 0.9:
        accumulated += 0.02
    np.testing.assert_allclose(accumulated, 0.88, rtol=1e-12)
    grid = bapo_search.grid_values(0.6, 0.9, 0.02)
    assert grid.shape == (16,)
    np.testing.assert_allclose(grid[-1], 0.9, rtol=1e-12)
    # Where flooring without the tolerance loses a value in float64: (1.4 - 1.1) / 0.1 = 2.99999...
    assert math.floor((1.4 - 1.1) / 0.1) == 2
    np.testing.assert_allclose(
        bapo_search.grid_values(1.1, 1.4, 0.1), [1.1, 1.2, 1.3, 1.4], rtol=1e-12
    )

    # Search, gradient statistic, lower_first. (A=+1, r=0.5): P = 0.5 (0.5 < c_high always).
    # (A=-1, r=0.89): N = 0.89 while c_low < 0.89, else 0. rho = 0.5 / 1.39 = 0.3597 < 0.4 up to
    # c_low = 0.88; at c_low = 0.90, N = 0 and rho = 1. 15 moves. A grid ending at 0.88 would
    # instead move c_high through all 36 values and never reach the target.
    config = bapo.BAPOConfig(statistic="gradient", order="lower_first")
    result = search([0.5, 0.89], [1.0, -1.0], config)
    assert_result(result, c_low=0.9, c_high=1.2, iterations=15, reached=True, rho=1.0)
    assert result.c_low == np.float32(0.6 + 15 * 0.02)


def test_value_statistic_raising_c_low_never_raises_rho():
    # With "value", an A<0 token counts |A| max(r, c_low): non-decreasing in c_low, so N grows
    # and rho can only fall. Hand case: (A=+1, r=2.0), (A=-1, r=0.5), c_high = 1.2:
    # c_low 0.6 -> rho = 1.2 / 1.8 = 0.6667;  c_low 0.9 -> rho = 1.2 / 2.1 = 0.5714.
    ratio = jnp.asarray([[2.0, 0.5]], jnp.float32)
    adv = jnp.asarray([[1.0, -1.0]], jnp.float32)
    mask = jnp.ones_like(ratio)
    at_start = bapo_search.balance_statistic(ratio, adv, mask, DEFAULT, 0.6, 1.2)
    at_max = bapo_search.balance_statistic(ratio, adv, mask, DEFAULT, 0.9, 1.2)
    np.testing.assert_allclose([at_start, at_max], [1.2 / 1.8, 1.2 / 2.1], rtol=1e-6)

    # Along the whole c_low grid, for random tokens: rho is non-increasing.
    rng = np.random.default_rng(0)
    ratio = jnp.asarray(np.exp(rng.normal(0, 0.5, (4, 16))), jnp.float32)
    adv = jnp.asarray(rng.choice([-1.0, -0.5, 0.0, 0.5, 1.0], (4, 16)), jnp.float32)
    mask = jnp.ones_like(ratio)
    rhos = [
        float(bapo_search.balance_statistic(ratio, adv, mask, DEFAULT, c_low, 1.2))
        for c_low in DEFAULT.low_grid
    ]
    assert all(b <= a for a, b in itertools.pairwise(rhos)), rhos

    # Consequence for the search: (A=+1, r=2.0), (A=-1, r=0.5), rho0 = 0.69.
    # upper_first: N = 0.6; c_high 1.30 -> 1.3/1.9 = 0.6842 < 0.69;
    #   c_high 1.35 -> 1.35/1.95 = 0.6923 >= 0.69. 3 moves.
    # lower_first: c_low 0.62..0.90 raises N to 0.9 (rho 1.2/2.1 = 0.5714), then c_high up to 3.0
    # gives P = min(2, 3) = 2: rho = 2/2.9 = 0.68966 < 0.69. All 51 moves, not reached.
    upper = search([2.0, 0.5], [1.0, -1.0], bapo.BAPOConfig(rho0=0.69))
    assert_result(upper, c_low=0.6, c_high=1.35, iterations=3, reached=True, rho=1.35 / 1.95)
    lower = search([2.0, 0.5], [1.0, -1.0], bapo.BAPOConfig(rho0=0.69, order="lower_first"))
    assert_result(lower, c_low=0.9, c_high=3.0, iterations=51, reached=False, rho=2.0 / 2.9)


def test_gradient_statistic_with_ratios_exactly_on_grid_values():
    # float32 grid: c_high[6] = 1.2 + 6 * 0.05 -> 1.5 exactly; c_low[10] = 0.6 + 10 * 0.02 -> 0.8f.
    assert np.float32(DEFAULT.high_grid[6]) == np.float32(1.5)
    assert np.float32(DEFAULT.low_grid[10]) == np.float32(0.8)
    # Tokens (A=+1, r=1.5), (A=-1, r=0.8), (A=-1, r=1.0); gradient statistic, rho0 = 0.5.
    # P = 1.5 iff 1.5 < c_high (strict: not at c_high = 1.5, yes from 1.55).
    # N = 0.8 [0.8 > c_low] + 1.0 (always): 1.8 below c_low = 0.8, 1.0 from c_low = 0.8 (strict).
    # upper_first: c_high 1.25..1.5 -> rho 0; 1.55 -> 1.5/3.3 = 0.4545; ...;
    #   3.0 (36 moves) still 0.4545;
    #   c_low 0.62..0.78 -> 0.4545; 0.80 (10th c_low move) -> 1.5/2.5 = 0.6 >= 0.5. 46 moves.
    # lower_first: c_low to 0.9 (15 moves, P = 0 so rho = 0), then c_high: 1.25..1.5 -> 0,
    #   1.55 (7th move) -> 1.5/(1.5 + 1.0) = 0.6. 22 moves.
    ratios, advs = [1.5, 0.8, 1.0], [1.0, -1.0, -1.0]
    upper = search(ratios, advs, bapo.BAPOConfig(statistic="gradient", rho0=0.5))
    assert_result(
        upper, c_low=0.8, c_high=3.0, iterations=46, reached=True, rho=0.6, rho_before=0.0
    )
    lower = search(
        ratios, advs, bapo.BAPOConfig(statistic="gradient", rho0=0.5, order="lower_first")
    )
    assert_result(lower, c_low=0.9, c_high=1.55, iterations=22, reached=True, rho=0.6)


def test_pos_neg_ratio_target():
    # (A=+1, r=2.0), (A=-1, r=0.5); P/N = min(2, c_high) / 0.6, rho0 = 2.2.
    # 1.2/0.6 = 2.0, 1.25/0.6 = 2.083, 1.3/0.6 = 2.1667, 1.35/0.6 = 2.25 >= 2.2: 3 moves.
    config = bapo.BAPOConfig(target="pos_neg_ratio", rho0=2.2)
    result = search([2.0, 0.5], [1.0, -1.0], config)
    assert_result(
        result, c_low=0.6, c_high=1.35, iterations=3, reached=True, rho=2.25, rho_before=2.0
    )
    # The same sums as fractions: 1.35 / (1.35 + 0.6) and 1.2 / (1.2 + 0.6).
    chex.assert_trees_all_close(result.fraction, 1.35 / 1.95, rtol=1e-6)
    chex.assert_trees_all_close(result.fraction_before, 1.2 / 1.8, rtol=1e-6)
    # Given bounds, the loss reports both units at them.
    _, metrics = bapo.policy_loss(
        jnp.log(jnp.asarray([[2.0, 0.5]])),
        jnp.zeros((1, 2)),
        jnp.asarray([[1.0, -1.0]]),
        jnp.ones((1, 2)),
        config,
        bounds=(0.6, 1.35),
    )
    chex.assert_trees_all_close(
        (metrics["rho"], metrics["rho_fraction"]), (2.25, 1.35 / 1.95), rtol=1e-6
    )


def test_weight_by_behavior_prob():
    # (A=+1, r=2.0, pi_b=0.5), (A=-1, r=1.0, pi_b=1.0).
    # Unweighted: 1.2 / 2.2 = 0.545 >= 0.4, no move.
    # Weighted: P = 0.5 min(2, c_high), N = 1: c_high 1.3 -> 0.65/1.65 = 0.394; 1.35 -> 0.675/1.675
    # = 0.40299 >= 0.4: 3 moves.
    plain = search([2.0, 1.0], [1.0, -1.0], DEFAULT, behavior_probs=[0.5, 1.0])
    assert_result(plain, c_low=0.6, c_high=1.2, iterations=0, reached=True, rho=1.2 / 2.2)
    config = bapo.BAPOConfig(weight_by_behavior_prob=True)
    weighted = search([2.0, 1.0], [1.0, -1.0], config, behavior_probs=[0.5, 1.0])
    assert_result(weighted, c_low=0.6, c_high=1.35, iterations=3, reached=True, rho=0.675 / 1.675)
    with pytest.raises(ValueError, match="behavior_logp"):
        search([2.0, 1.0], [1.0, -1.0], config)


@functools.partial(jax.jit, static_argnums=(4,))
def _jit_loss_and_grad(logp, blogp, adv, mask, config, kwargs):
    def loss_fn(lp):
        return bapo.policy_loss(lp, blogp, adv, mask, config, **kwargs)

    return jax.value_and_grad(loss_fn, has_aux=True)(logp)


def _loss_and_grad(ratios, advs, mask, config, **kwargs):
    logp = jnp.log(jnp.asarray([ratios], jnp.float32))  # behaviour log-probs 0: r = exp(logp)
    blogp = jnp.zeros_like(logp)
    adv = jnp.asarray([advs], jnp.float32)
    mask = jnp.asarray([mask], jnp.float32)
    return _jit_loss_and_grad(logp, blogp, adv, mask, config, kwargs)


def test_policy_loss_by_hand():
    # Tokens (A=+1, r=1.5), (A=-1, r=0.5), (A=+0.5, r=1.0), padding.
    # Search: P = 1 min(1.5, 1.2) + 0.5 min(1, 1.2) = 1.7; N = max(0.5, 0.6) = 0.6;
    #   rho = 1.7 / 2.3 = 0.7391 >= 0.4, bounds stay (0.6, 1.2).
    # J = 1.2 (clipped above) - 0.6 (clipped below) + 0.5 = 1.1; loss = -1.1 / 3.
    # dJ/dlogp = A r where unclipped: only token 3, 0.5 -> grad = -0.5 / 3.
    (loss, metrics), grad = _loss_and_grad(
        [1.5, 0.5, 1.0, 1.0], [1.0, -1.0, 0.5, 0.0], [1, 1, 1, 0], DEFAULT
    )
    chex.assert_trees_all_close(loss, jnp.float32(-1.1 / 3), rtol=1e-6)
    chex.assert_trees_all_close(grad, jnp.asarray([[0.0, 0.0, -0.5 / 3, 0.0]]), atol=1e-7)
    expected = {
        "c_low": 0.6, "c_high": 1.2, "rho": 1.7 / 2.3, "rho_before": 1.7 / 2.3,
        "clip_high_frac": 1 / 3, "clip_low_frac": 1 / 3, "dual_clip_frac": 0.0,
        "pos_token_frac": 2 / 3, "ratio_mean": 1.0, "ratio_min": 0.5, "ratio_max": 1.5,
        # k3 KL(pi_b || pi): mean of r - 1 - log r = (0.5 - log 1.5 + (-0.5 + log 2) + 0) / 3.
        "approx_kl": (0.5 - math.log(1.5) - 0.5 + math.log(2.0)) / 3,
        "pg_loss": -1.1 / 3, "loss": -1.1 / 3,
    }  # fmt: skip
    for key, value in expected.items():
        np.testing.assert_allclose(metrics[key], value, rtol=1e-5, atol=1e-7, err_msg=key)
    assert int(metrics["iterations"]) == 0 and bool(metrics["reached"])

    # Global token count: num_tokens = 6 -> loss = -1.1 / 6.
    (loss, _), _ = _loss_and_grad(
        [1.5, 0.5, 1.0, 1.0], [1.0, -1.0, 0.5, 0.0], [1, 1, 1, 0], DEFAULT, num_tokens=6.0
    )
    chex.assert_trees_all_close(loss, jnp.float32(-1.1 / 6), rtol=1e-6)
    # Truncated IS weights (2, 1, 0.5): J = 2.4 - 0.6 + 0.25 = 2.05 -> loss -2.05 / 3.
    (loss, metrics), grad = _loss_and_grad(
        [1.5, 0.5, 1.0, 1.0],
        [1.0, -1.0, 0.5, 0.0],
        [1, 1, 1, 0],
        DEFAULT,
        is_weights=jnp.asarray([[2.0, 1.0, 0.5, 1.0]], jnp.float32),
    )
    chex.assert_trees_all_close(loss, jnp.float32(-2.05 / 3), rtol=1e-6)
    chex.assert_trees_all_close(grad, jnp.asarray([[0.0, 0.0, -0.25 / 3, 0.0]]), atol=1e-7)
    np.testing.assert_allclose(metrics["is_weight_mean"], 3.5 / 3, rtol=1e-6)


def test_dual_clip_in_loss_only():
    # (A=-1, r=4.0), (A=+1, r=1.0). Statistic ignores the dual clip: P = 1, N = max(4, c_low) = 4,
    # rho = 0.2 at every bound -> 51 moves, bounds (0.9, 3.0).
    # Loss without dual clip: J = -4 + 1 = -3 -> loss 1.5; grad = -(A r)/2 = (2.0, -0.5).
    # With dual_clip = 3: J = -min(max(4, 0.9), 3) + 1 = -2 -> loss 1.0; grad = (0, -0.5).
    (loss, metrics), grad = _loss_and_grad([4.0, 1.0], [-1.0, 1.0], [1, 1], DEFAULT)
    chex.assert_trees_all_close(loss, jnp.float32(1.5), rtol=1e-6)
    chex.assert_trees_all_close(grad, jnp.asarray([[2.0, -0.5]]), rtol=1e-6)
    assert int(metrics["iterations"]) == 51
    config = bapo.BAPOConfig(dual_clip=3.0)
    (loss, metrics), grad = _loss_and_grad([4.0, 1.0], [-1.0, 1.0], [1, 1], config)
    chex.assert_trees_all_close(loss, jnp.float32(1.0), rtol=1e-6)
    chex.assert_trees_all_close(grad, jnp.asarray([[0.0, -0.5]]), rtol=1e-6)
    np.testing.assert_allclose(metrics["rho"], 0.2, rtol=1e-6)
    np.testing.assert_allclose(metrics["dual_clip_frac"], 0.5)
    np.testing.assert_allclose([metrics["c_low"], metrics["c_high"]], [0.9, 3.0], rtol=1e-6)


def test_given_bounds_are_used_as_is():
    # Tokens (A=+1, r=1.5), (A=-1, r=0.85), (A=+0.5, r=1.0).
    # Own search: P = 1.2 + 0.5 = 1.7, N = 0.85 -> 0.667, no move: J = 1.2 - 0.85 + 0.5 = 0.85.
    # Given pair (0.8, 1.3): J = 1.3 - max(0.85, 0.8) + 0.5 = 0.95 -> loss -0.95/3;
    #   rho there = (1.3 + 0.5) / (1.8 + 0.85) = 1.8 / 2.65.
    ratios, advs = [1.5, 0.85, 1.0], [1.0, -1.0, 0.5]
    (loss, metrics), _ = _loss_and_grad(ratios, advs, [1, 1, 1], DEFAULT)
    chex.assert_trees_all_close(loss, jnp.float32(-0.85 / 3), rtol=1e-6)
    (loss, metrics), _ = _loss_and_grad(ratios, advs, [1, 1, 1], DEFAULT, bounds=(0.8, 1.3))
    chex.assert_trees_all_close(loss, jnp.float32(-0.95 / 3), rtol=1e-6)
    np.testing.assert_allclose([metrics["c_low"], metrics["c_high"]], [0.8, 1.3], rtol=1e-6)
    np.testing.assert_allclose(metrics["rho"], 1.8 / 2.65, rtol=1e-6)
    assert "iterations" not in metrics
    # A BoundSearchResult from another batch (the update-wide search) passes straight through:
    # that batch is unreachable -> (0.9, 3.0) after 51 moves. J = 1.5 - 0.9 + 0.5 = 1.1.
    other = search([0.1, 1.0], [1.0, -1.0], DEFAULT)
    (loss, metrics), _ = _loss_and_grad(ratios, advs, [1, 1, 1], DEFAULT, bounds=other)
    chex.assert_trees_all_close(loss, jnp.float32(-1.1 / 3), rtol=1e-6)
    assert int(metrics["iterations"]) == 51 and not bool(metrics["reached"])


def test_grid_bucket_equals_searchsorted_at_and_around_every_grid_value():
    # The one-read bucketing must agree with an exact binary search on the float32 grid,
    # including ratios exactly on a grid value and one float32 step either side of it.
    for start, stop, step in [
        (1.2, 3.0, 0.05),
        (0.6, 0.9, 0.02),
        (0.5, 0.95, 0.15),
        (1.0, 1.0, 0.1),
    ]:
        grid = bapo_search.device_grid(start, stop, step)
        probes = np.concatenate(
            [
                grid,
                np.nextafter(grid, np.float32(np.inf)),
                np.nextafter(grid, np.float32(0)),
                np.float32([0.0, 1e-30, 0.3, 1.0, 2.17, 5.0, 1e30, np.inf]),
                # Random fill up to one shape for every grid (one compilation).
                np.random.default_rng(0).uniform(0.0, 4.0, 384 - 3 * grid.shape[0] - 8),
            ]
        ).astype(np.float32)[None, :]
        table = jnp.asarray(np.concatenate([grid, [np.inf]]).astype(np.float32))
        for right, side in [(True, "right"), (False, "left")]:
            got = jax.jit(bapo_search.grid_bucket)(
                probes, table, np.float32(start), np.float32(1 / step), grid.shape[0], right
            )
            np.testing.assert_array_equal(got, np.searchsorted(grid, probes, side=side))
