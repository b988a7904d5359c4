"""BAPO's adaptive clipping-bound search, bucketed and jitted.

Paper: Xi et al., "BAPO: Stabilizing Off-Policy Reinforcement Learning for LLMs via Balanced
Policy Optimization with Adaptive Clipping", arXiv 2510.18927, Sec. 3-4 (as implemented:
docs/algorithms.md, "The algorithm").

Before each optimizer update the bounds (c_low, c_high) move on fixed grids until the positive-
advantage tokens carry at least rho_0 of the loss::

    P(c_high) = sum_{A_t > 0} w_t |A_t| v+(r_t; c_high)
    N(c_low)  = sum_{A_t < 0} w_t |A_t| v-(r_t; c_low)

    statistic "value":    v+ = min(r, c_high)            v- = max(r, c_low)
    statistic "gradient": v+ = r * [r < c_high]          v- = r * [r > c_low]
    target "fraction":    rho = P / (P + N)   (1 when P + N = 0)
    target "pos_neg_ratio": rho = P / N       (+inf when N = 0)
    w_t = pi_behaviour(y_t) = exp(behaviour log-prob) when weighted (Eq. 8), else 1.

P depends only on c_high and N only on c_low, so both are tabulated for every grid value in
one pass over the tokens: each token's ratio is bucketed by the fixed float32 grid edges, the
per-bucket sums of w|A| and w|A|r are segment-summed, and prefix / suffix cumulative sums give
P[j] and N[i] for every grid index. The `lax.while_loop` then reads two table entries per move.
All sums are of non-negative terms (suffixes are reverse cumulative sums, never
total - prefix), so float32 keeps a small relative error. Because the tables are sums over
tokens they add across micro-batches and devices: the update-wide scope adds the `GridSums` of
every micro-batch (or lets jit all-reduce a sharded batch) before `search_from_sums`.

Bucket-boundary semantics use the very float32 grid values the loss clips with: a ratio
exactly equal to c_high is "not below c_high", a ratio exactly equal to c_low is "not above
c_low" (those tokens carry no gradient).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Literal, NamedTuple

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

from bapo_jax.algorithms.losses import balance, contribution_sums
from bapo_jax.checks import check_choice

if TYPE_CHECKING:  # Only for annotations: bapo.py imports this module.
    from bapo_jax.algorithms.bapo import BAPOConfig

# n = floor((max - start) / step + GRID_TOLERANCE): without it, (1.4 - 1.1) / 0.1 =
# 2.9999999999999982 would drop the grid value 1.4 (and accumulating 0.6 + 0.02 + ... or
# dividing in float32 stops the default c_low grid at 0.88 instead of 0.90).
GRID_TOLERANCE = 1e-6
Target = Literal["fraction", "pos_neg_ratio"]
Order = Literal["upper_first", "lower_first"]
LANES = 16  # partial sums per bucket in the segment-sum


def grid_values(start: float, stop: float, step: float) -> np.ndarray:
    """The bound grid start + i * step, i = 0..n, n = floor((stop - start)/step + 1e-6), float64.

    Computed once in Python float64; the device holds these values rounded to float32.
    """
    n = math.floor((stop - start) / step + GRID_TOLERANCE)
    return start + np.arange(n + 1, dtype=np.float64) * step


def device_grid(start: float, stop: float, step: float) -> np.ndarray:
    """`grid_values` rounded to float32: the exact numbers the search and the loss compare with."""
    return grid_values(start, stop, step).astype(np.float32)


def grid_bucket(
    ratio: Float[Array, "B T"],
    table: Array,
    start: float | Array,
    inv_step: float | Array,
    num_values: int | Array,
    right: bool | Array,
    offset: int | Array = 0,
) -> Int[Array, "B T"]:
    """#{j : g_j <= r} (right) or #{j : g_j < r} (left) over a float32 grid g_0 < ... < g_{n-1}.

    `table[offset:]` holds g_0..g_{n-1} followed by +inf. Equals `jnp.searchsorted(g, r, side)`
    with one table read per token: the arithmetic position x = (r - start) / step is within
    delta < 0.5 of the true one (float32 rounding, given max/step <= 1e6 as `BAPOConfig`
    enforces), so the count is k0 or k0 + 1 with k0 = floor(x - 1/2) + 1, settled by comparing
    r with g_{k0}. start, inv_step, num_values and right may be per-token arrays (one merged
    table for both grids); NaN ratios land in bucket 0.
    """
    position = (ratio - start) * inv_step - 0.5  # [B, T]
    position = jnp.where(position > -1.0, position, -1.0)  # also maps NaN to -1
    k0 = jnp.minimum(jnp.floor(position) + 1.0, num_values).astype(jnp.int32)  # [B, T]
    at_k0 = jnp.take(table, offset + k0, mode="clip")  # g_{k0}, +inf at k0 = n
    passed = jnp.where(right, at_k0 <= ratio, at_k0 < ratio) & (k0 < num_values)  # r = +inf
    return k0 + passed.astype(jnp.int32)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class GridSums:
    """P and N tabulated on the grids; additive over tokens (micro-batches, devices).

    pos[j] = P at c_high = high_grid[j];  neg[i] = N at c_low = low_grid[i].
    """

    pos: Float[Array, " H"]
    neg: Float[Array, " L"]

    def __add__(self, other: GridSums) -> GridSums:
        return GridSums(pos=self.pos + other.pos, neg=self.neg + other.neg)


class BoundSearchResult(NamedTuple):
    """Outcome of one bound search (all scalars, float32 / int32 / bool).

    c_low, c_high: the chosen bounds. rho: the statistic there (in the config's target's
    units); rho_before: at the start bounds. fraction / fraction_before: the same two as the
    fraction P / (P + N) whatever the target (comparable across targets and with the fixed-clip
    losses' rho). iterations: grid moves made. reached: rho >= rho0.
    """

    c_low: Float[Array, ""]
    c_high: Float[Array, ""]
    rho: Float[Array, ""]
    rho_before: Float[Array, ""]
    fraction: Float[Array, ""]
    fraction_before: Float[Array, ""]
    iterations: Int[Array, ""]
    reached: Bool[Array, ""]


def search_weights(
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    weight_by_behavior_prob: bool,
    behavior_logp: Float[Array, "B T"] | None,
) -> Float[Array, "B T"]:
    """w_t |A_t| for the tokens that count (mask on, A != 0), else 0."""
    counts = (mask > 0) & (advantages != 0)
    weight = jnp.abs(advantages) * mask
    if weight_by_behavior_prob:
        if behavior_logp is None:
            raise ValueError(
                "weight_by_behavior_prob=True needs behavior_logp, got behavior_logp=None"
            )
        weight = weight * jnp.exp(jnp.where(counts, behavior_logp, 0.0))
    return jnp.where(counts, weight, 0.0)


def _fold(pos_sum: Array, neg_sum: Array, target: str) -> Array:
    """rho from P and N: fraction P/(P+N) (1 if both 0) or ratio P/N (+inf if N = 0)."""
    check_choice("target", target, Target)
    if target == "fraction":
        return balance(pos_sum, neg_sum)
    return jnp.where(neg_sum > 0, pos_sum / jnp.where(neg_sum > 0, neg_sum, 1.0), jnp.inf)


def balance_statistic(
    ratio: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    config: BAPOConfig,
    c_low: float | Array,
    c_high: float | Array,
    behavior_logp: Float[Array, "B T"] | None = None,
    target: Target | None = None,
) -> Float[Array, ""]:
    """rho(c_low, c_high) of the config's statistic at any bounds (no grid), in `target`'s
    units (default: the config's target)."""
    ratio, advantages, mask = _check_search_inputs(ratio, advantages, mask, behavior_logp)
    weight = search_weights(advantages, mask, config.weight_by_behavior_prob, behavior_logp)
    pos_sum, neg_sum = contribution_sums(ratio, advantages, weight, c_low, c_high, config.statistic)
    return _fold(pos_sum, neg_sum, config.target if target is None else target)


def _check_search_inputs(ratio, advantages, mask, behavior_logp):
    chex.assert_rank([ratio, advantages, mask], 2)
    chex.assert_equal_shape([ratio, advantages, mask])
    if behavior_logp is not None:
        chex.assert_equal_shape([ratio, behavior_logp])
    sg = jax.lax.stop_gradient
    return sg(ratio), sg(advantages), sg(mask)


def grid_sums(
    ratio: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    config: BAPOConfig,
    behavior_logp: Float[Array, "B T"] | None = None,
) -> GridSums:
    """P at every c_high grid value and N at every c_low grid value, in one pass over tokens.

    Positive tokens fall in bucket k = #{j : h_j <= r} (0..H), so r < h_j iff k <= j;
    negative tokens in bucket k = #{i : l_i < r} (0..L), so r > l_i iff k >= i + 1. One
    segment-sum of w|A| and w|A|r over the H+1+L+1 buckets, then::

        P_value[j] = sum_{k<=j} S+_ar[k] + h_j * sum_{k>j} S+_a[k]      P_gradient[j] = first term
        N_value[i] = sum_{k>i} S-_ar[k] + l_i * sum_{k<=i} S-_a[k]      N_gradient[i] = first term
    """
    ratio, advantages, mask = _check_search_inputs(ratio, advantages, mask, behavior_logp)
    if behavior_logp is not None:
        behavior_logp = jax.lax.stop_gradient(behavior_logp)
    low = device_grid(config.c_low_start, config.c_low_max, config.c_low_step)  # [L]
    high = device_grid(config.c_high_start, config.c_high_max, config.c_high_step)  # [H]
    n_low, n_high = low.shape[0], high.shape[0]

    weight = search_weights(advantages, mask, config.weight_by_behavior_prob, behavior_logp)
    weighted_ratio = jnp.where(weight > 0, weight * ratio, 0.0)  # [B, T]; 0 * inf guarded

    # One merged bucket per token: positive tokens on the c_high grid (buckets 0..H, "right"),
    # the others on the c_low grid (buckets H+1..H+1+L, "left"); zero-weight tokens add 0.
    table = jnp.asarray(np.concatenate([high, [np.inf], low, [np.inf]]).astype(np.float32))
    positive = advantages > 0
    f32 = jnp.float32
    start = jnp.where(positive, f32(config.c_high_start), f32(config.c_low_start))
    inv_step = jnp.where(positive, f32(1.0 / config.c_high_step), f32(1.0 / config.c_low_step))
    offset = jnp.where(positive, 0, n_high + 1)  # [B, T]
    num_values = jnp.where(positive, n_high, n_low)
    k = grid_bucket(ratio, table, start, inv_step, num_values, positive, offset)  # [B, T]
    segment = offset + k
    num_segments = n_high + 1 + n_low + 1
    # Spread consecutive tokens over LANES partial sums: a scatter-add into few buckets is
    # otherwise one long dependency chain per bucket.
    lane = jax.lax.broadcasted_iota(jnp.int32, ratio.shape, 1) % LANES  # [B, T]
    segment = (segment * LANES + lane).reshape(-1)
    sums_a = jax.ops.segment_sum(weight.reshape(-1), segment, num_segments * LANES)
    sums_ar = jax.ops.segment_sum(weighted_ratio.reshape(-1), segment, num_segments * LANES)
    sums_a = jnp.sum(sums_a.reshape(num_segments, LANES), axis=1)  # [H+1+L+1]
    sums_ar = jnp.sum(sums_ar.reshape(num_segments, LANES), axis=1)

    pos_a, neg_a = sums_a[: n_high + 1], sums_a[n_high + 1 :]  # [H+1], [L+1]
    pos_ar, neg_ar = sums_ar[: n_high + 1], sums_ar[n_high + 1 :]
    pos_below_ar = jnp.cumsum(pos_ar)[:n_high]  # [H]: sum over r < h_j
    neg_above_ar = jnp.cumsum(neg_ar[::-1])[::-1][1:]  # [L]: sum over r > l_i
    if config.statistic == "value":
        pos_at_or_above_a = jnp.cumsum(pos_a[::-1])[::-1][1:]  # [H]: sum over r >= h_j
        neg_at_or_below_a = jnp.cumsum(neg_a)[:n_low]  # [L]: sum over r <= l_i
        pos = pos_below_ar + jnp.asarray(high) * pos_at_or_above_a
        neg = neg_above_ar + jnp.asarray(low) * neg_at_or_below_a
    else:  # "gradient" (BAPOConfig checks the choice)
        pos, neg = pos_below_ar, neg_above_ar
    return GridSums(pos=pos, neg=neg)


def search_from_sums(sums: GridSums, config: BAPOConfig) -> BoundSearchResult:
    """Walk the grids with `lax.while_loop`, O(1) per move, from the start bounds.

    upper_first (paper): while rho < rho0 and some bound can move, raise c_high if it can,
    else c_low. lower_first (authors' code): raise c_low while it can, then c_high; written as
    the same single loop with the priority swapped.
    """
    low = device_grid(config.c_low_start, config.c_low_max, config.c_low_step)
    high = device_grid(config.c_high_start, config.c_high_max, config.c_high_step)
    chex.assert_shape(sums.pos, high.shape)
    chex.assert_shape(sums.neg, low.shape)
    last_low, last_high = low.shape[0] - 1, high.shape[0] - 1
    pos = jax.lax.stop_gradient(sums.pos)
    neg = jax.lax.stop_gradient(sums.neg)
    rho0 = jnp.float32(config.rho0)

    def rho_at(i_low, i_high):
        return _fold(pos[i_high], neg[i_low], config.target).astype(jnp.float32)

    def unmet_and_movable(state):
        i_low, i_high, _, rho = state
        return (rho < rho0) & ((i_low < last_low) | (i_high < last_high))

    def move(state):
        i_low, i_high, moves, _ = state
        # upper_first: c_high while it can move; lower_first: c_high once c_low cannot.
        raise_high = i_high < last_high if config.order == "upper_first" else i_low >= last_low
        i_high = i_high + raise_high.astype(jnp.int32)
        i_low = i_low + (~raise_high).astype(jnp.int32)
        return i_low, i_high, moves + 1, rho_at(i_low, i_high)

    zero = jnp.int32(0)
    rho_before = rho_at(zero, zero)
    i_low, i_high, moves, rho = jax.lax.while_loop(
        unmet_and_movable, move, (zero, zero, zero, rho_before)
    )
    return BoundSearchResult(
        c_low=jnp.asarray(low)[i_low],
        c_high=jnp.asarray(high)[i_high],
        rho=rho,
        rho_before=rho_before,
        fraction=balance(pos[i_high], neg[i_low]),
        fraction_before=balance(pos[0], neg[0]),
        iterations=moves,
        reached=rho >= rho0,
    )


def search_bounds(
    ratio: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    config: BAPOConfig,
    behavior_logp: Float[Array, "B T"] | None = None,
) -> BoundSearchResult:
    """Choose (c_low, c_high) for one update: `grid_sums` then `search_from_sums`.

    Inputs are [B, T] float32 (mask 0/1); no gradient flows (stop_gradient), no host sync.
    """
    return search_from_sums(grid_sums(ratio, advantages, mask, config, behavior_logp), config)
