"""BAPO: Balanced Policy Optimization with Adaptive Clipping (Xi et al., arXiv 2510.18927).

Public API: `BAPOConfig` and `policy_loss` (the algorithm: docs/algorithms.md; the bound search
itself, `search_bounds`, is `bapo_search.py`).

Per response token t, with r_t = pi_theta(y_t) / pi_behaviour(y_t) and raw ratio bounds::

    J = token_mean( min(r_t A_t, clip(r_t, c_low, c_high) A_t) )                 (paper Eq. 5)

Before every optimizer update the bounds restart at (a-, a+) = (c_low_start, c_high_start) and
climb their grids (steps delta_2 = c_low_step, delta_1 = c_high_step, caps b-, b+) until the
positive-advantage tokens carry at least rho_0 of the loss (bapo_search.py has the statistic,
the bucketed tables and the `lax.while_loop`). The search sees no gradient.

Scope. `scope="update"` (paper, default): one search over every token of the optimizer update.
Without gradient accumulation that is simply `policy_loss(...)` on the (possibly sharded)
mini-batch: under jit the sums are global. With accumulation the loss's registered
`UPDATE_WIDE_SEARCH` hook (`registry.UpdateStatistic`) has the train step compute the ratios of
all micro-batches first (an extra forward pass), add their `grid_sums`, call
`search_from_sums` once and pass the result as `bounds=` to every micro-batch's `policy_loss`
together with the global `num_tokens`. `scope="micro_batch"` (authors' code)
lets each micro-batch search its own bounds: call `policy_loss` without `bounds`.

Staleness-aware BAPO (`lag_buckets` = K > 1; this project's option, docs/algorithms.md). With
the lag of a token l_t = (version trained) - (version that sampled it) and its bucket
b_t = min(l_t, K - 1), the search runs once per bucket on that bucket's tokens alone,

    (c_low_b, c_high_b) = search(r, A, mask * [b_t = b])        b = 0 .. K - 1

(the same grids, order, target and statistic; `vmap` over the buckets inside the same jit),
and token t is clipped at (c_low_{b_t}, c_high_{b_t}). Each lag's positive tokens then carry at
least rho_0 of that lag's loss whatever the others do: stale negatives, whose ratios drift
furthest, cannot pull the fresh tokens' bounds. With every token at one lag this is the
paper's search exactly (one non-empty bucket; an empty one keeps its start bounds and clips
nothing).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from bapo_jax.algorithms import losses
from bapo_jax.algorithms.bapo_search import (
    BoundSearchResult,
    GridSums,
    Order,
    Target,
    balance_statistic,
    grid_sums,
    grid_values,
    search_bounds,
    search_from_sums,
)
from bapo_jax.algorithms.losses import Statistic
from bapo_jax.algorithms.registry import UpdateStatistic, register_loss
from bapo_jax.checks import check_choice, check_field, is_finite_number, is_int

Scope = Literal["update", "micro_batch"]
# grid_bucket's one-step correction of its float32 arithmetic guess needs max/step << 2**23.
MAX_GRID_RESOLUTION = 1e6
MAX_LAG_BUCKETS = 4  # lags 0, 1, 2, >= 3: the metrics declare one key per bucket


@dataclasses.dataclass(frozen=True)
class BAPOConfig(losses.LossTerms):
    """BAPO hyper-parameters (paper symbols; defaults = paper Sec. 5.1).

    rho0 (rho_0): target the statistic must reach; in (0, 1] for target="fraction", > 0 for
      target="pos_neg_ratio" (authors' yaml uses 1.0, their example script 0.5).
    c_low_start (a-), c_low_max (b-), c_low_step (delta_2): the c_low grid 0.6, 0.62, ..., 0.9.
    c_high_start (a+), c_high_max (b+), c_high_step (delta_1): the c_high grid 1.2, 1.25, ...,
      3.0. Bounds are raw ratios, not epsilons; grid values are start + i * step, i = 0..n,
      n = floor((max - start)/step + 1e-6).
    order: "upper_first" (paper: raise c_high while it can, then c_low) or "lower_first"
      (authors' code: c_low to its max first, then c_high).
    target: "fraction" P/(P+N) (paper) or "pos_neg_ratio" P/N (authors' code).
    statistic: "value" (clipped surrogate values count; paper and code) or "gradient" (only
      tokens still carrying gradient count, with |r A|; this project's option).
    weight_by_behavior_prob: weight each token by pi_behaviour(y_t) in the statistic (Eq. 8).
    dual_clip: None, or the cap c of A min(max(r, c_low), c) for A < 0 (authors' code uses
      3.0); loss only, never the statistic.
    scope: "update" (paper) or "micro_batch" (authors' code); read by the trainer.
    lag_buckets (K): 1 (paper) or 2..4: staleness-aware BAPO, one search per lag bucket (lags
      0 .. K - 2 and >= K - 1; module doc); the trainer then passes each token's lag.
    Shared keyword-only loss terms (aggregation, kl_coef, kl_estimator, entropy_coef, is_cap)
    come from `losses.LossTerms`.
    """

    rho0: float = 0.4
    c_low_start: float = 0.6
    c_low_max: float = 0.9
    c_low_step: float = 0.02
    c_high_start: float = 1.2
    c_high_max: float = 3.0
    c_high_step: float = 0.05
    order: Order = "upper_first"
    target: Target = "fraction"
    statistic: Statistic = "value"
    weight_by_behavior_prob: bool = False
    dual_clip: float | None = None
    scope: Scope = "update"
    lag_buckets: int = 1

    def __post_init__(self):
        super().__post_init__()
        check, finite = check_field, is_finite_number
        check_choice("order", self.order, Order)
        check_choice("target", self.target, Target)
        check_choice("statistic", self.statistic, Statistic)
        check_choice("scope", self.scope, Scope)
        check(
            isinstance(self.weight_by_behavior_prob, bool),
            "weight_by_behavior_prob",
            "a bool",
            self.weight_by_behavior_prob,
        )
        if self.target == "fraction":
            check(finite(self.rho0) and 0 < self.rho0 <= 1, "rho0", "in (0, 1]", self.rho0)
        else:
            check(finite(self.rho0) and self.rho0 > 0, "rho0", "> 0 and finite", self.rho0)
        for name in ("c_low", "c_high"):
            start = getattr(self, f"{name}_start")
            stop = getattr(self, f"{name}_max")
            step = getattr(self, f"{name}_step")
            check(finite(start), f"{name}_start", "a finite number", start)
            check(finite(stop), f"{name}_max", "a finite number", stop)
            check(finite(step) and step > 0, f"{name}_step", "> 0", step)
            check(stop >= start, f"{name}_max", f">= {name}_start ({start})", stop)
            check(
                stop / step <= MAX_GRID_RESOLUTION,
                f"{name}_step",
                f">= {name}_max / {MAX_GRID_RESOLUTION:g} (grid too fine for float32)",
                step,
            )
        check(0 < self.c_low_start <= 1, "c_low_start", "in (0, 1]", self.c_low_start)
        check(self.c_high_start >= 1, "c_high_start", ">= 1", self.c_high_start)
        check(
            self.c_low_max <= self.c_high_start,
            "c_low_max",
            f"<= c_high_start ({self.c_high_start}) so that c_low never exceeds c_high",
            self.c_low_max,
        )
        losses.check_dual_clip(self.dual_clip, floor=self.c_low_max)
        check(
            is_int(self.lag_buckets, 1) and self.lag_buckets <= MAX_LAG_BUCKETS,
            "lag_buckets",
            f"an int in 1..{MAX_LAG_BUCKETS}",
            self.lag_buckets,
        )

    @property
    def uses_lags(self) -> bool:
        return self.lag_buckets > 1

    @property
    def low_grid(self):
        """The c_low grid in float64 (the device uses it rounded to float32)."""
        return grid_values(self.c_low_start, self.c_low_max, self.c_low_step)

    @property
    def high_grid(self):
        """The c_high grid in float64 (the device uses it rounded to float32)."""
        return grid_values(self.c_high_start, self.c_high_max, self.c_high_step)


Bounds = BoundSearchResult | tuple[float | Array, float | Array]


def lag_bucket(lags: Int[Array, "B T"], config: BAPOConfig) -> Int[Array, "B T"]:
    """b_t = min(l_t, K - 1) (negative lags, a token newer than the trained version, count 0)."""
    return jnp.clip(lags, 0, config.lag_buckets - 1)


def bucket_grid_sums(
    ratio, advantages, mask, config: BAPOConfig, behavior_logp=None, lags=None
) -> GridSums:
    """`grid_sums` of the whole batch (K = 1), or of each lag bucket ([K, H] and [K, L])."""
    if config.lag_buckets == 1:
        return grid_sums(ratio, advantages, mask, config, behavior_logp)
    bucket = lag_bucket(_require_lags(lags, config), config)

    def of_bucket(b):
        in_bucket = mask * (bucket == b).astype(mask.dtype)
        return grid_sums(ratio, advantages, in_bucket, config, behavior_logp)

    return jax.vmap(of_bucket)(jnp.arange(config.lag_buckets))


def bucket_search(sums: GridSums, config: BAPOConfig) -> BoundSearchResult:
    """`search_from_sums`, once per lag bucket when K > 1 (fields [K])."""
    if config.lag_buckets == 1:
        return search_from_sums(sums, config)
    return jax.vmap(lambda one: search_from_sums(one, config))(sums)


def _require_lags(lags, config: BAPOConfig):
    if lags is None:
        raise ValueError(
            f"BAPOConfig.lag_buckets={config.lag_buckets} needs each token's lag (lags=), got None"
        )
    return lags


def _grid_sums_of(ratio, advantages, mask, base_logp, config: BAPOConfig, lags=None) -> GridSums:
    # The loss's own log-probs: both scopes weight alike (Eq. 8).
    return bucket_grid_sums(ratio, advantages, mask, config, base_logp, lags)


def _no_grid_sums(config: BAPOConfig) -> GridSums:
    lead = () if config.lag_buckets == 1 else (config.lag_buckets,)
    return GridSums(
        pos=jnp.zeros((*lead, len(config.high_grid)), jnp.float32),
        neg=jnp.zeros((*lead, len(config.low_grid)), jnp.float32),
    )


# scope="update" under gradient accumulation: the micro-batches' GridSums add, one search.
UPDATE_WIDE_SEARCH = UpdateStatistic(
    keyword="bounds",
    applies=lambda config: config.scope == "update",
    zeros=_no_grid_sums,
    partial=_grid_sums_of,
    finish=bucket_search,
)


@register_loss(
    "bapo",
    BAPOConfig,
    # rho comes from the (update-wide) search: the same in every micro-batch.
    metrics={
        **losses.POLICY_METRICS,
        "rho": "mean",
        "rho_before": "mean",
        "rho_fraction": "mean",
        "rho_fraction_before": "mean",
        "iterations": "max",
        "reached": "all",
        **{
            f"{key}/lag{b}": "mean"
            for key in ("c_low", "c_high", "rho")
            for b in range(MAX_LAG_BUCKETS)
        },
    },
    update_statistic=UPDATE_WIDE_SEARCH,
    config_metrics=lambda config: {"rho0": config.rho0},
    progress=losses.POLICY_PROGRESS,
    last=losses.POLICY_LAST,
)
def policy_loss(
    logp: Float[Array, "B T"],
    behavior_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    config: BAPOConfig,
    *,
    is_weights: Float[Array, "B T"] | None = None,
    ref_logp: Float[Array, "B T"] | None = None,
    bounds: Bounds | None = None,
    num_tokens: float | Array | None = None,
    num_sequences: float | Array | None = None,
    entropy: Float[Array, "B T"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
    lags: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """BAPO loss with its metrics.

    r = exp(logp - behavior_logp) on the mask; (c_low, c_high) = `search_bounds(r, A, mask)`
    unless `bounds` is given (a `BoundSearchResult` from an update-wide search, or a plain
    (c_low, c_high) pair); J_t = min(r A, clip(r, c_low, c_high) A) (dual clip for A < 0 when
    set), times `is_weights` when given; loss = -sum_mask(J) / num_tokens (num_tokens defaults
    to the mask's sum; empty mask -> 0) under the default aggregation, plus the optional KL
    penalty and entropy bonus of `losses.LossTerms`.

    Metrics: c_low, c_high, rho_before, rho (the target's units), rho_fraction_before,
    rho_fraction (P / (P + N) whatever the target), iterations, reached (from the search; a
    given pair reports only rho and rho_fraction at that pair), clip_high_frac / clip_low_frac
    / dual_clip_frac (shares of response tokens: A > 0 with r >= c_high, A < 0 with
    r <= c_low, A < 0 with r > dual_clip),
    pos_token_frac, ratio_mean/min/max, approx_kl (to the behaviour policy), pg_loss, loss,
    kl_ref when ref_logp is given, entropy when given, is_weight_mean when is_weights is given.

    With `lag_buckets` K > 1 (`lags` [B, T] required): one search per lag bucket (module doc),
    each token clipped at its bucket's bounds; c_low / c_high are then the token mean of the
    bounds applied, rho and rho_fraction the statistic at them over all tokens, iterations the
    most moves of a bucket, reached whether every bucket reached rho0, and per bucket b
    c_low/lag<b>, c_high/lag<b>, rho/lag<b> (an empty bucket: its start bounds, rho 1).
    """
    losses.check_loss_inputs(
        logp,
        behavior_logp,
        advantages,
        mask,
        config,
        is_weights=is_weights,
        ref_logp=ref_logp,
        entropy=entropy,
    )
    ratio = losses.safe_ratio(logp, behavior_logp, mask)  # [B, T]
    sg = jax.lax.stop_gradient
    if config.lag_buckets > 1:
        if bounds is None:
            sums = bucket_grid_sums(sg(ratio), advantages, mask, config, behavior_logp, lags)
            bounds = bucket_search(sums, config)
        c_low, c_high, search_metrics = _per_bucket_bounds(
            bounds, sg(ratio), advantages, mask, config, behavior_logp, lags
        )
    else:
        if bounds is None:
            bounds = search_bounds(sg(ratio), advantages, mask, config, behavior_logp)
        c_low, c_high, search_metrics = _one_search_bounds(
            bounds, sg(ratio), advantages, mask, config, behavior_logp
        )
    c_low = sg(jnp.asarray(c_low, jnp.float32))
    c_high = sg(jnp.asarray(c_high, jnp.float32))

    objective = losses.clipped_surrogate(ratio, advantages, c_low, c_high, config.dual_clip)
    loss, metrics = losses.finish_policy_loss(
        objective,
        logp,
        mask,
        config,
        is_weights=is_weights,
        ref_logp=ref_logp,
        entropy=entropy,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        segment_ids=segment_ids,
    )
    metrics.update(losses.clip_metrics(ratio, advantages, mask, c_low, c_high, config.dual_clip))
    metrics.update(search_metrics)
    return loss, metrics


def _per_bucket_bounds(bounds, ratio, advantages, mask, config: BAPOConfig, behavior_logp, lags):
    """Each token's bounds from its bucket's search ([B, T] each) and the search metrics."""
    if not isinstance(bounds, BoundSearchResult):
        raise ValueError(
            f"lag_buckets={config.lag_buckets}: bounds must be the per-bucket BoundSearchResult "
            f"of `bucket_search`, got {bounds!r}"
        )
    bucket = lag_bucket(_require_lags(lags, config), config)
    c_low, c_high = bounds.c_low[bucket], bounds.c_high[bucket]  # [B, T] each
    args = (ratio, advantages, mask, config, c_low, c_high, behavior_logp)
    rho = balance_statistic(*args)
    start = (config.c_low_start, config.c_high_start)
    before = (ratio, advantages, mask, config, *start, behavior_logp)
    # The token mean of the bounds applied, bucket by bucket (exact when one bucket is used).
    share = jax.vmap(lambda b: jnp.sum(mask * (bucket == b)))(jnp.arange(config.lag_buckets))
    share = share / jnp.maximum(jnp.sum(share), 1.0)  # [K]
    metrics = {
        "rho": rho,
        "rho_before": balance_statistic(*before),
        "rho_fraction": rho
        if config.target == "fraction"
        else balance_statistic(*args, "fraction"),
        "rho_fraction_before": balance_statistic(*before, "fraction"),
        "iterations": jnp.max(bounds.iterations),
        "reached": jnp.all(bounds.reached),
        "c_low": jnp.sum(share * bounds.c_low),
        "c_high": jnp.sum(share * bounds.c_high),
    }
    for b in range(config.lag_buckets):
        metrics[f"c_low/lag{b}"] = bounds.c_low[b]
        metrics[f"c_high/lag{b}"] = bounds.c_high[b]
        metrics[f"rho/lag{b}"] = bounds.rho[b]
    return c_low, c_high, metrics


def _one_search_bounds(bounds, ratio, advantages, mask, config: BAPOConfig, behavior_logp):
    """(c_low, c_high) of one search (or a given pair) and the search metrics."""
    if isinstance(bounds, BoundSearchResult):
        search_metrics = {
            "rho_before": bounds.rho_before,
            "rho": bounds.rho,
            "rho_fraction_before": bounds.fraction_before,
            "rho_fraction": bounds.fraction,
            "iterations": bounds.iterations,
            "reached": bounds.reached,
        }
        c_low, c_high = bounds.c_low, bounds.c_high
    else:
        if len(bounds) != 2:
            raise ValueError(
                f"bounds must be a BoundSearchResult or (c_low, c_high), got {bounds!r}"
            )
        c_low, c_high = bounds
        args = (ratio, advantages, mask, config, c_low, c_high, behavior_logp)
        rho = balance_statistic(*args)
        fraction = rho if config.target == "fraction" else balance_statistic(*args, "fraction")
        search_metrics = {"rho": rho, "rho_fraction": fraction}
    return c_low, c_high, search_metrics
