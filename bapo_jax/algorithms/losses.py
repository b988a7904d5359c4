"""The terms every clipped policy-gradient loss shares, and the fixed-clip baselines.

The registry the losses enter is `registry.py`; BAPO (adaptive bounds) is `bapo.py`.

Every registered loss has one call shape and returns `(loss, metrics)`::

    loss_fn(logp, behavior_logp, advantages, mask, config, *, is_weights=None, ref_logp=None,
            bounds=None, num_tokens=None, num_sequences=None, entropy=None, segment_ids=None)

with [B, T] float32 inputs (mask 0/1; T may be the scored positions only, see `train.step`).
Per token, with r = exp(logp - behavior_logp) and raw ratio bounds (c_low, c_high)::

    J_t = min(r A, clip(r, c_low, c_high) A)          = A min(r, c_high)        for A > 0
                                                       = A max(r, c_low)         for A < 0
    dual clip (A < 0, optional, Ye et al. 2019):  A min(max(r, c_low), dual_clip)

    ppo_clip:    c_low = 1 - eps,      c_high = 1 + eps            (Schulman et al. 2017)
    clip_higher: c_low = 1 - eps_low,  c_high = 1 + eps_high       (DAPO: 0.2 / 0.28)
    bapo:        (c_low, c_high) from the adaptive search (bapo.py)

    loss = -agg(w_is * J) + kl_coef * agg(KL(pi_theta || pi_ref)) - entropy_coef * agg(H)

`agg` is token_mean (sum over the mask / num_tokens, the global response-token count under
gradient accumulation), seq_mean_token_mean or seq_mean_token_sum (sums over sequences /
num_sequences). A sequence is a row, or with `segment_ids` (packed rows) a run of equal ids in
a row. w_is are the truncated importance weights min(pi_old / pi_behaviour, is_cap) of the
`ratio_base = "recomputed"` mode (verl's rollout correction), given by the caller.

Every metric a loss returns has one declared reduction (`registry.Reduction`): how it combines
over the micro-batches of an update and over the updates of a rollout batch.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from bapo_jax.algorithms.registry import register_loss
from bapo_jax.checks import check_choice, check_field, choices, is_finite_number

Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]
KLEstimator = Literal["k1", "k3"]
ISMode = Literal["truncate", "token_mask", "sequence_mask"]
Statistic = Literal["value", "gradient"]
AGGREGATIONS = choices(Aggregation)


def check_dual_clip(dual_clip: float | None, floor: float = 1.0) -> None:
    """dual_clip is None or a finite number > max(1, floor) (it caps A < 0 ratios from above)."""
    if dual_clip is not None:
        bound = max(1.0, floor)
        check_field(
            is_finite_number(dual_clip) and dual_clip > bound, "dual_clip", f"> {bound}", dual_clip
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class LossTerms:
    """Terms every policy loss shares (keyword-only, after each loss's own fields).

    aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum.
    kl_coef, kl_estimator: penalty beta * KL(pi_theta || pi_ref), estimator k1 = log(pi/pi_ref)
      or k3 = pi_ref/pi - log(pi_ref/pi) - 1 (Schulman 2020); needs ref_logp when kl_coef > 0.
    entropy_coef: entropy bonus; needs the per-token entropy when > 0.
    is_cap: cap C of the truncated importance weights min(pi_old / pi_behaviour, C).
    is_mode, is_band: the rollout correction of `ratio_base = "recomputed"`, with w_t = pi_old /
      pi_behaviour (`importance_weights`): "truncate" min(w_t, is_cap); "token_mask" w_t, or 0
      for a token whose w_t leaves is_band = (low, high) (IcePop / masked IS); "sequence_mask"
      the sequence's geometric mean g_i = exp(mean_t log w_t) on its tokens, or 0 for all of
      them when g_i leaves the band (verl's geometric rollout correction). Default band (0.5, 2).
    """

    aggregation: Aggregation = "token_mean"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    entropy_coef: float = 0.0
    is_cap: float = 2.0
    is_mode: ISMode = "truncate"
    is_band: tuple[float, float] = (0.5, 2.0)

    def __post_init__(self):
        check_choice("aggregation", self.aggregation, Aggregation)
        check_field(
            is_finite_number(self.kl_coef) and self.kl_coef >= 0, "kl_coef", ">= 0", self.kl_coef
        )
        check_choice("kl_estimator", self.kl_estimator, KLEstimator)
        check_field(
            is_finite_number(self.entropy_coef) and self.entropy_coef >= 0,
            "entropy_coef",
            ">= 0",
            self.entropy_coef,
        )
        check_field(is_finite_number(self.is_cap) and self.is_cap > 0, "is_cap", "> 0", self.is_cap)
        check_choice("is_mode", self.is_mode, ISMode)
        band = tuple(self.is_band)
        check_field(
            len(band) == 2 and all(is_finite_number(b) for b in band) and 0 < band[0] < 1 < band[1],
            "is_band",
            "(low, high) with 0 < low < 1 < high",
            self.is_band,
        )
        object.__setattr__(self, "is_band", (float(band[0]), float(band[1])))

    @property
    def uses_lags(self) -> bool:
        """Whether the loss takes each token's lag (`lags=`, `TrainBatch.lags`): the trainer
        computes them only then (staleness-aware BAPO overrides this)."""
        return False


@dataclasses.dataclass(frozen=True)
class PPOClipConfig(LossTerms):
    """Symmetric PPO clipping: c_low = 1 - epsilon, c_high = 1 + epsilon."""

    epsilon: float = 0.2
    dual_clip: float | None = None

    def __post_init__(self):
        super().__post_init__()
        check_field(
            is_finite_number(self.epsilon) and 0 < self.epsilon < 1,
            "epsilon",
            "in (0, 1)",
            self.epsilon,
        )
        check_dual_clip(self.dual_clip)


@dataclasses.dataclass(frozen=True)
class ClipHigherConfig(LossTerms):
    """Decoupled clipping (DAPO's clip-higher): c_low = 1 - eps_low, c_high = 1 + eps_high."""

    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None

    def __post_init__(self):
        super().__post_init__()
        check_field(
            is_finite_number(self.eps_low) and 0 < self.eps_low < 1,
            "eps_low",
            "in (0, 1)",
            self.eps_low,
        )
        check_field(
            is_finite_number(self.eps_high) and self.eps_high > 0, "eps_high", "> 0", self.eps_high
        )
        check_dual_clip(self.dual_clip)


# The metrics `finish_policy_loss` and `clip_metrics` give every clipped loss, with their
# reductions (`registry.Reduction`); each loss adds its own.
POLICY_METRICS = {
    "loss": "sum",
    "pg_loss": "sum",
    "kl_ref": "sum",
    "entropy": "mean",
    "is_weight_mean": "mean",
    "is_masked_frac": "mean",
    "c_low": "mean",
    "c_high": "mean",
    "clip_high_frac": "mean",
    "clip_low_frac": "mean",
    "dual_clip_frac": "mean",
    "pos_token_frac": "mean",
    "ratio_mean": "mean",
    "ratio_min": "min",
    "ratio_max": "max",
    "approx_kl": "mean",
}
# A fixed-clip loss's rho: the value share of the positive tokens at its bounds, from its parts.
FIXED_CLIP_METRICS = {**POLICY_METRICS, "rho": "balance", "rho/pos": "sum", "rho/neg": "sum"}
# What every policy loss shows on the progress bar, and the bounds of an iteration's last update.
POLICY_PROGRESS = (("rho", "rho", ".3g"), ("c_low", "c_low", ".3g"), ("c_high", "c_high", ".3g"))
POLICY_LAST = ("c_low", "c_high")


# ---------------------------------------------------------------------------------------------
# Shared pieces.


def check_loss_inputs(
    logp, behavior_logp, advantages, mask, config: LossTerms, *, is_weights, ref_logp, entropy
) -> None:
    """Boundary checks before any work: [B, T] float arrays of one shape (the optional ones
    when given), and the inputs the config's KL penalty / entropy bonus need."""
    if config.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={config.kl_coef} > 0 needs ref_logp, got ref_logp=None")
    if config.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={config.entropy_coef} > 0 needs entropy, got None")
    arrays = [logp, behavior_logp, advantages, mask]
    arrays += [x for x in (is_weights, ref_logp, entropy) if x is not None]
    chex.assert_rank(arrays, 2)
    chex.assert_equal_shape(arrays)
    chex.assert_type(arrays, float)


def check_fixed_loss_inputs(
    logp, behavior_logp, advantages, mask, config: LossTerms, bounds, terms: dict
) -> None:
    """`check_loss_inputs` for a loss without BAPO's searched bounds (it refuses ``bounds``);
    ``terms``: the loss call's keyword arguments."""
    if bounds is not None:
        raise ValueError(f"bounds is only for adaptive losses (bapo); got bounds={bounds!r}")
    check_loss_inputs(
        logp, behavior_logp, advantages, mask, config,
        is_weights=terms["is_weights"], ref_logp=terms["ref_logp"], entropy=terms["entropy"],
    )  # fmt: skip


def safe_ratio(
    logp: Float[Array, "B T"], behavior_logp: Float[Array, "B T"], mask: Float[Array, "B T"]
) -> Float[Array, "B T"]:
    """r = exp(logp - behavior_logp) on response tokens, exactly 1 on padding (no NaN/inf)."""
    return jnp.exp(jnp.where(mask > 0, logp - behavior_logp, 0.0))


def clipped_surrogate(
    ratio: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    c_low: float | Array,
    c_high: float | Array,
    dual_clip: float | None = None,
) -> Float[Array, "B T"]:
    """J_t = A min(r, c_high) for A > 0, A min(max(r, c_low), dual_clip) for A < 0, 0 for A = 0.

    Written with strict comparisons so the gradient exists exactly where the bound search
    says it does: A > 0 tokens with r < c_high, A < 0 tokens with c_low < r (< dual_clip).
    """
    c_low = jax.lax.stop_gradient(jnp.asarray(c_low, jnp.float32))
    c_high = jax.lax.stop_gradient(jnp.asarray(c_high, jnp.float32))
    ratio_pos = jnp.where(ratio < c_high, ratio, c_high)  # [B, T]
    ratio_neg = jnp.where(ratio > c_low, ratio, c_low)  # [B, T]
    if dual_clip is not None:
        ratio_neg = jnp.where(ratio_neg > dual_clip, jnp.float32(dual_clip), ratio_neg)
    return advantages * jnp.where(advantages > 0, ratio_pos, ratio_neg)


def sequence_sums(
    values: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, " S"], Float[Array, " S"]]:
    """Per-sequence sum_t m v and sum_t m: one sequence per row ([B] each), or with
    `segment_ids` one per run of equal ids within a row ([B * T] slots, unused ones 0)."""
    masked = jnp.where(mask > 0, values * mask, 0.0)  # [B, T]
    if segment_ids is None:
        return jnp.sum(masked, axis=-1), jnp.sum(mask, axis=-1)
    ids = _sequence_index(segment_ids)
    kwargs = {"num_segments": ids.size, "indices_are_sorted": True}
    sums = jax.ops.segment_sum(masked.reshape(-1), ids.reshape(-1), **kwargs)  # [B * T]
    lengths = jax.ops.segment_sum(mask.reshape(-1), ids.reshape(-1), **kwargs)  # [B * T]
    return sums, lengths


def _sequence_index(segment_ids: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """Each token's sequence slot in [0, B T): a run of equal ids in a row is one sequence."""
    b, t = segment_ids.shape
    starts = jnp.pad(
        segment_ids[:, 1:] != segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=True
    )
    return jnp.cumsum(starts, axis=1) - 1 + t * jnp.arange(b)[:, None]  # [B, T], sorted


def sequence_means(
    values: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    segment_ids: Int[Array, "B T"] | None = None,
) -> Float[Array, "B T"]:
    """Each token's sequence mean sum_{t in s} m v / sum_{t in s} m (0 for an empty one),
    sequences as in `sequence_sums`."""
    sums, lengths = sequence_sums(values, mask, segment_ids)
    means = sums / jnp.maximum(lengths, 1.0)  # [B] or [B * T]
    if segment_ids is None:
        return jnp.broadcast_to(means[:, None], mask.shape)
    return means[_sequence_index(segment_ids)]


def count_sequences(
    mask: Float[Array, "B T"], segment_ids: Int[Array, "B T"] | None = None
) -> Float[Array, ""]:
    """Sequences (rows, or segments of packed rows) with at least one token on the mask."""
    _, lengths = sequence_sums(mask, mask, segment_ids)
    return jnp.sum((lengths > 0).astype(jnp.float32))


def aggregate(
    values: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    mode: str,
    num_tokens: float | Array | None = None,
    num_sequences: float | Array | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
) -> Float[Array, ""]:
    """Reduce per-token values over the mask.

    token_mean:          sum_{b,t} m v / num_tokens          (default: sum of the mask)
    seq_mean_token_mean: sum_s [sum_{t in s} m v / sum_{t in s} m] / num_sequences
    seq_mean_token_sum:  sum_s [sum_{t in s} m v] / num_sequences  (default: sequences with a
                         token on the mask)
    s runs over sequences: rows, or with `segment_ids` the segments of packed rows.
    Denominators are floored at 1, so an empty mask gives 0.
    """
    if mode == "token_mean":
        masked = jnp.where(mask > 0, values * mask, 0.0)  # [B, T]
        count = jnp.sum(mask) if num_tokens is None else jnp.asarray(num_tokens, jnp.float32)
        return jnp.sum(masked) / jnp.maximum(count, 1.0)
    check_choice("aggregation", mode, Aggregation)
    per_sequence, lengths = sequence_sums(values, mask, segment_ids)  # [S] each
    if mode == "seq_mean_token_mean":
        per_sequence = per_sequence / jnp.maximum(lengths, 1.0)
    if num_sequences is None:
        count = jnp.sum((lengths > 0).astype(jnp.float32))
    else:
        count = jnp.asarray(num_sequences, jnp.float32)
    return jnp.sum(per_sequence) / jnp.maximum(count, 1.0)


def contribution_sums(
    ratio: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    weight: Float[Array, "B T"],
    c_low: float | Array,
    c_high: float | Array,
    statistic: Statistic = "value",
) -> tuple[Float[Array, ""], Float[Array, ""]]:
    """(P, N): what the positive and the negative advantage tokens carry at fixed bounds, each
    token weighted by `weight` (> 0 where it counts), by one direct pass::

        P = sum_{A_t > 0} w_t v+(r_t)      N = sum_{A_t < 0} w_t v-(r_t)
        "value":    v+ = min(r, c_high)          v- = max(r, c_low)    (the clipped values)
        "gradient": v+ = r [r < c_high]          v- = r [r > c_low]    (tokens with gradient)

    rho = P / (P + N) is BAPO's balance statistic; BAPO's search tabulates the same sums on its
    grids (`bapo_search.grid_sums`), the fixed-clip losses report "value" at their bounds.
    """
    check_choice("statistic", statistic, Statistic)
    c_low = jnp.asarray(c_low, jnp.float32)
    c_high = jnp.asarray(c_high, jnp.float32)
    counts = weight > 0
    if statistic == "value":
        v_pos = jnp.where(ratio < c_high, ratio, c_high)  # [B, T]
        v_neg = jnp.where(ratio > c_low, ratio, c_low)  # [B, T]
    else:  # "gradient"
        v_pos = jnp.where(ratio < c_high, ratio, 0.0)  # [B, T]
        v_neg = jnp.where(ratio > c_low, ratio, 0.0)  # [B, T]
    pos_terms = jnp.where(counts & (advantages > 0), weight * v_pos, 0.0)  # [B, T]
    neg_terms = jnp.where(counts & (advantages < 0), weight * v_neg, 0.0)  # [B, T]
    return jnp.sum(pos_terms), jnp.sum(neg_terms)


def balance(pos: Float[Array, ""], neg: Float[Array, ""]) -> Float[Array, ""]:
    """rho = P / (P + N), 1 when both are 0."""
    total = pos + neg
    return jnp.where(total > 0, pos / jnp.where(total > 0, total, 1.0), 1.0)


def carried_balance(
    carried: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    num_tokens: float | Array | None,
) -> dict[str, Array]:
    """rho of a loss without clip bounds (`cispo`, `kl_cov`): P / (P + N) of what each token
    carries (``carried`` >= 0, e.g. |A| times its weight), its parts over the update's token
    count (they add over micro-batches), no gradient."""
    carried = jax.lax.stop_gradient(jnp.where(mask > 0, carried * mask, 0.0))  # [B, T]
    pos = jnp.sum(jnp.where(advantages > 0, carried, 0.0))
    neg = jnp.sum(jnp.where(advantages < 0, carried, 0.0))
    total = jnp.sum(mask) if num_tokens is None else num_tokens
    total = jnp.maximum(jnp.asarray(total, jnp.float32), 1.0)
    return {"rho/pos": pos / total, "rho/neg": neg / total, "rho": balance(pos, neg)}


def masked_mean(values: Float[Array, "B T"], mask: Float[Array, "B T"]) -> Float[Array, ""]:
    return aggregate(values, mask, "token_mean")


def kl_to_reference(
    logp: Float[Array, "B T"], ref_logp: Float[Array, "B T"], estimator: str
) -> Float[Array, "B T"]:
    """Per-token estimate of KL(pi_theta || pi_ref): k1 = logp - ref_logp, k3 = e^x - x - 1 with
    x = ref_logp - logp (non-negative, lower variance)."""
    check_choice("kl_estimator", estimator, KLEstimator)
    if estimator == "k1":
        return logp - ref_logp
    log_ref_ratio = ref_logp - logp  # "k3"
    return jnp.exp(log_ref_ratio) - log_ref_ratio - 1.0


def truncated_is_weights(
    old_logp: Float[Array, "B T"],
    behavior_logp: Float[Array, "B T"],
    cap: float,
    mask: Float[Array, "B T"] | None = None,
) -> Float[Array, "B T"]:
    """min(pi_old / pi_behaviour, cap), no gradient; 0 on padding when a mask is given.

    For `ratio_base = "recomputed"`: the loss ratio uses the trainer's recomputed old log-probs
    and these weights carry the engine/trainer mismatch (cap = the config's is_cap).
    """
    check_field(is_finite_number(cap) and cap > 0, "cap", "> 0", cap)
    log_w = jax.lax.stop_gradient(old_logp - behavior_logp)
    if mask is not None:
        log_w = jnp.where(mask > 0, log_w, -jnp.inf)
    return jnp.minimum(jnp.exp(log_w), jnp.float32(cap))


def importance_weights(
    old_logp: Float[Array, "B T"],
    behavior_logp: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    config: LossTerms,
    segment_ids: Int[Array, "B T"] | None = None,
) -> Float[Array, "B T"]:
    """The rollout correction's per-token weights (`LossTerms` is_mode / is_band / is_cap), no
    gradient, 0 on padding; a masked token or sequence gets 0."""
    if config.is_mode == "truncate":
        return truncated_is_weights(old_logp, behavior_logp, config.is_cap, mask)
    low, high = config.is_band
    log_w = jax.lax.stop_gradient(jnp.where(mask > 0, old_logp - behavior_logp, 0.0))  # [B, T]
    if config.is_mode == "sequence_mask":
        log_w = sequence_means(log_w, mask, segment_ids)  # log g_i on each of its tokens
    w = jnp.exp(log_w)
    kept = (mask > 0) & (w >= low) & (w <= high)
    return jnp.where(kept, w, 0.0)


def clip_metrics(
    ratio: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    c_low: Array,
    c_high: Array,
    dual_clip: float | None,
) -> dict[str, Array]:
    """Shares of response tokens clipped (no gradient), positive share, ratio and KL stats."""
    ratio = jax.lax.stop_gradient(ratio)
    valid = mask > 0
    n_valid = jnp.sum(valid.astype(jnp.float32))
    count = jnp.maximum(n_valid, 1.0)
    pos, neg = advantages > 0, advantages < 0

    def share(flags):
        return jnp.sum((flags & valid).astype(jnp.float32)) / count

    dual = jnp.float32(0.0) if dual_clip is None else share(neg & (ratio > dual_clip))
    log_ratio = jnp.log(ratio)
    return {
        "c_low": jnp.asarray(c_low, jnp.float32),
        "c_high": jnp.asarray(c_high, jnp.float32),
        "clip_high_frac": share(pos & (ratio >= c_high)),
        "clip_low_frac": share(neg & (ratio <= c_low)),
        "dual_clip_frac": dual,
        "pos_token_frac": share(pos),
        "ratio_mean": masked_mean(ratio, mask),
        "ratio_min": jnp.where(n_valid > 0, jnp.min(jnp.where(valid, ratio, jnp.inf)), 0.0),
        "ratio_max": jnp.where(n_valid > 0, jnp.max(jnp.where(valid, ratio, -jnp.inf)), 0.0),
        # k3 estimate of KL(pi_behaviour || pi_theta) from behaviour samples: r - 1 - log r.
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask),
    }


def finish_policy_loss(
    objective: Float[Array, "B T"],
    logp: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    config: LossTerms,
    *,
    is_weights: Float[Array, "B T"] | None,
    ref_logp: Float[Array, "B T"] | None,
    entropy: Float[Array, "B T"] | None,
    num_tokens: float | Array | None,
    num_sequences: float | Array | None,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """loss = -agg(w_is J) + kl_coef agg(KL) - entropy_coef agg(H), with their metrics.

    Call `check_loss_inputs` first (it rejects a kl_coef / entropy_coef without its input).
    """

    def agg(values):
        return aggregate(
            values, mask, config.aggregation, num_tokens, num_sequences, segment_ids=segment_ids
        )

    metrics: dict[str, Array] = {}
    if is_weights is not None:
        is_weights = jax.lax.stop_gradient(is_weights)
        objective = objective * is_weights
        metrics["is_weight_mean"] = masked_mean(is_weights, mask)
        metrics["is_masked_frac"] = masked_mean((is_weights <= 0).astype(jnp.float32), mask)
    pg_loss = -agg(objective)
    loss = pg_loss
    metrics["pg_loss"] = pg_loss
    if ref_logp is not None:
        kl = agg(kl_to_reference(logp, jax.lax.stop_gradient(ref_logp), config.kl_estimator))
        metrics["kl_ref"] = kl
        if config.kl_coef > 0:
            loss = loss + config.kl_coef * kl
    if entropy is not None:
        metrics["entropy"] = masked_mean(jax.lax.stop_gradient(entropy), mask)
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * agg(entropy)
    metrics["loss"] = loss
    return loss, metrics


def fixed_clip_loss(
    logp, behavior_logp, advantages, mask, c_low, c_high, config, *, bounds, **terms
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """A clipped loss with constant bounds; rho is the value share P / (P + N) at them
    (`contribution_sums`, statistic "value", w = |A|)."""
    check_fixed_loss_inputs(logp, behavior_logp, advantages, mask, config, bounds, terms)
    ratio = safe_ratio(logp, behavior_logp, mask)
    return clipped_ratio_loss(ratio, logp, advantages, mask, c_low, c_high, config, **terms)


def clipped_ratio_loss(
    ratio, logp, advantages, mask, c_low, c_high, config, **terms
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """The clipped surrogate of a given ratio (a token's, or its sequence's: `gspo`) at
    constant bounds, its terms and metrics; rho is the value share P / (P + N) at the bounds
    (`contribution_sums`, statistic "value", w = |A|)."""
    objective = clipped_surrogate(ratio, advantages, c_low, c_high, config.dual_clip)
    loss, metrics = finish_policy_loss(objective, logp, mask, config, **terms)
    metrics.update(clip_metrics(ratio, advantages, mask, c_low, c_high, config.dual_clip))
    sg = jax.lax.stop_gradient
    counts = (mask > 0) & (advantages != 0)
    weight = sg(jnp.where(counts, jnp.abs(advantages) * mask, 0.0))  # [B, T]: |A| on the mask
    pos_sum, neg_sum = contribution_sums(sg(ratio), sg(advantages), weight, c_low, c_high)
    # P and N over the update's token count add over micro-batches; rho = P / (P + N).
    count = jnp.sum(mask) if terms["num_tokens"] is None else terms["num_tokens"]
    count = jnp.maximum(jnp.asarray(count, jnp.float32), 1.0)
    metrics["rho/pos"], metrics["rho/neg"] = pos_sum / count, neg_sum / count
    metrics["rho"] = balance(pos_sum, neg_sum)
    return loss, metrics


@register_loss(
    "ppo_clip",
    PPOClipConfig,
    metrics=FIXED_CLIP_METRICS,
    progress=POLICY_PROGRESS,
    last=POLICY_LAST,
)
def ppo_clip(
    logp: Float[Array, "B T"],
    behavior_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    config: PPOClipConfig,
    *,
    is_weights: Float[Array, "B T"] | None = None,
    ref_logp: Float[Array, "B T"] | None = None,
    bounds: None = None,
    num_tokens: float | Array | None = None,
    num_sequences: float | Array | None = None,
    entropy: Float[Array, "B T"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """PPO-clip: J_t = min(r A, clip(r, 1 - eps, 1 + eps) A), aggregated; see module doc."""
    return fixed_clip_loss(
        logp,
        behavior_logp,
        advantages,
        mask,
        1.0 - config.epsilon,
        1.0 + config.epsilon,
        config,
        bounds=bounds,
        is_weights=is_weights,
        ref_logp=ref_logp,
        entropy=entropy,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        segment_ids=segment_ids,
    )


@register_loss(
    "clip_higher",
    ClipHigherConfig,
    metrics=FIXED_CLIP_METRICS,
    progress=POLICY_PROGRESS,
    last=POLICY_LAST,
)
def clip_higher(
    logp: Float[Array, "B T"],
    behavior_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    config: ClipHigherConfig,
    *,
    is_weights: Float[Array, "B T"] | None = None,
    ref_logp: Float[Array, "B T"] | None = None,
    bounds: None = None,
    num_tokens: float | Array | None = None,
    num_sequences: float | Array | None = None,
    entropy: Float[Array, "B T"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Clip-higher (DAPO): J_t = min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)."""
    return fixed_clip_loss(
        logp,
        behavior_logp,
        advantages,
        mask,
        1.0 - config.eps_low,
        1.0 + config.eps_high,
        config,
        bounds=bounds,
        is_weights=is_weights,
        ref_logp=ref_logp,
        entropy=entropy,
        num_tokens=num_tokens,
        num_sequences=num_sequences,
        segment_ids=segment_ids,
    )
