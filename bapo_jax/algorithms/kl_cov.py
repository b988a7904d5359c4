"""KL-Cov (Cui et al. 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv 2505.22617): keep the policy's entropy from collapsing by penalising
the few tokens whose log-probability and advantage covary most.

Over the valid tokens of one loss call (a micro-batch, as the authors' verl code computes it),
with means over those tokens and no gradient through them:

    Cov_t = (log pi_theta(y_t) - mean log pi_theta) (A_t - mean A)
    I     = the max(1, floor(k_ratio N)) valid tokens of highest Cov_t, of the N valid ones
            (ties: the earlier token first)
    J_t   = r_t A_t - beta |log pi_theta(y_t) - log pi_old(y_t)| [t in I],  r_t = pi_theta / pi_old
    loss  = -agg(J)                                        (aggregation token_mean)

No ratio clipping (the penalty on the high-covariance tokens replaces it). Defaults are the
paper's Qwen2.5-7B setting: k_ratio 2e-3, beta 1 (it uses 2e-4 at 32B). Metrics: the shared
ratio and KL statistics, ``cov_selected_frac`` (the share of tokens penalised), ``cov_mean``
and rho as the positive share of sum |A| r.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from bapo_jax.algorithms import losses
from bapo_jax.algorithms.registry import register_loss
from bapo_jax.checks import check_field, is_finite_number

__all__ = ["KLCovConfig", "covariance_selection", "kl_cov"]


@dataclasses.dataclass(frozen=True)
class KLCovConfig(losses.LossTerms):
    """k_ratio: share of a loss call's valid tokens penalised (k); beta: the penalty's weight."""

    k_ratio: float = 2e-3
    beta: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        check_field(
            is_finite_number(self.k_ratio) and 0 < self.k_ratio <= 1,
            "k_ratio",
            "in (0, 1]",
            self.k_ratio,
        )
        check_field(is_finite_number(self.beta) and self.beta >= 0, "beta", ">= 0", self.beta)


_UNCLIPPED = ("c_low", "c_high", "clip_high_frac", "clip_low_frac", "dual_clip_frac")
KL_COV_METRICS = {
    **{k: v for k, v in losses.FIXED_CLIP_METRICS.items() if k not in _UNCLIPPED},
    "cov_selected_frac": "mean",
    "cov_mean": "mean",
}


def covariance_selection(
    logp: Float[Array, "B T"], advantages: Float[Array, "B T"], mask: Float[Array, "B T"], k_ratio
) -> tuple[Array, Float[Array, "B T"]]:
    """(I as a [B, T] bool mask, Cov_t) of the module doc; no gradient."""
    logp, advantages = jax.lax.stop_gradient(logp), jax.lax.stop_gradient(advantages)
    valid = mask > 0
    cov = (logp - losses.masked_mean(logp, mask)) * (
        advantages - losses.masked_mean(advantages, mask)
    )
    ranked = jnp.where(valid, cov, -jnp.inf).reshape(-1)  # [B T]
    order = jnp.argsort(-ranked, stable=True)  # highest first, ties in token order
    rank = jnp.zeros_like(order).at[order].set(jnp.arange(order.size))  # [B T]
    n_valid = jnp.sum(valid.astype(jnp.int32))
    count = jnp.maximum(1, jnp.floor(k_ratio * n_valid).astype(jnp.int32))
    return (rank.reshape(mask.shape) < count) & valid, cov


@register_loss(
    "kl_cov",
    KLCovConfig,
    metrics=KL_COV_METRICS,
    progress=(("rho", "rho", ".3g"), ("cov_selected_frac", "cov sel", ".2%")),
)
def kl_cov(
    logp: Float[Array, "B T"],
    behavior_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    config: KLCovConfig,
    *,
    is_weights: Float[Array, "B T"] | None = None,
    ref_logp: Float[Array, "B T"] | None = None,
    bounds: None = None,
    num_tokens: float | Array | None = None,
    num_sequences: float | Array | None = None,
    entropy: Float[Array, "B T"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """KL-Cov's objective (module doc)."""
    terms = dict(
        is_weights=is_weights, ref_logp=ref_logp, entropy=entropy, num_tokens=num_tokens,
        num_sequences=num_sequences, segment_ids=segment_ids,
    )  # fmt: skip
    losses.check_fixed_loss_inputs(logp, behavior_logp, advantages, mask, config, bounds, terms)
    ratio = losses.safe_ratio(logp, behavior_logp, mask)  # [B, T]
    selected, cov = covariance_selection(logp, advantages, mask, config.k_ratio)
    penalty = jnp.abs(jnp.where(mask > 0, logp - behavior_logp, 0.0))  # [B, T]
    objective = ratio * advantages - config.beta * jnp.where(selected, penalty, 0.0)
    loss, metrics = losses.finish_policy_loss(objective, logp, mask, config, **terms)
    shared = losses.clip_metrics(ratio, advantages, mask, 0.0, jnp.inf, None)
    metrics.update({k: v for k, v in shared.items() if k not in _UNCLIPPED})
    metrics["cov_selected_frac"] = losses.masked_mean(selected.astype(jnp.float32), mask)
    metrics["cov_mean"] = losses.masked_mean(cov, mask)
    metrics.update(
        losses.carried_balance(jnp.abs(advantages) * ratio, advantages, mask, num_tokens)
    )
    return loss, metrics
