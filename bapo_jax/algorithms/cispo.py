"""CISPO (MiniMax-M1, 2025): clip the importance weight, not the update; every token keeps a
gradient.

    r_t = pi_theta(y_t) / pi_old(y_t),    r^_t = clip(r_t, 1 - eps_low, 1 + eps_high)
    J_t = sg(r^_t) A_t log pi_theta(y_t)                      (a REINFORCE term, weighted)
    loss = -agg(J)                                             (aggregation token_mean)

so grad J_t = sg(r^_t) A_t grad log pi_theta(y_t) for every token, including the low-probability
ones that PPO's clip would silence after the first update. The paper sets no lower bound
(``eps_low`` None: r^ = min(r, 1 + eps_high)) and tunes only eps_high without publishing it;
the default here is 0.28, clip-higher's upper range (DAPO), a choice to tune. Metrics: the
shared ones with the weight's bounds, ``weight_clip_frac`` (tokens whose weight was capped, any
advantage sign) and rho as the positive share of sum |A| r^.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from bapo_jax.algorithms import losses
from bapo_jax.algorithms.registry import register_loss
from bapo_jax.checks import check_field, is_finite_number

__all__ = ["CISPOConfig", "cispo"]


@dataclasses.dataclass(frozen=True)
class CISPOConfig(losses.LossTerms):
    """eps_high: the weight's upper range (r^ <= 1 + eps_high); eps_low: its lower one (None:
    no lower bound, the paper's setting)."""

    eps_high: float = 0.28
    eps_low: float | None = None

    def __post_init__(self):
        super().__post_init__()
        check_field(
            is_finite_number(self.eps_high) and self.eps_high > 0, "eps_high", "> 0", self.eps_high
        )
        if self.eps_low is not None:
            check_field(
                is_finite_number(self.eps_low) and 0 < self.eps_low < 1,
                "eps_low",
                "in (0, 1) or None",
                self.eps_low,
            )


CISPO_METRICS = {**losses.FIXED_CLIP_METRICS, "weight_clip_frac": "mean"}


@register_loss(
    "cispo",
    CISPOConfig,
    metrics=CISPO_METRICS,
    progress=(("rho", "rho", ".3g"), ("weight_clip_frac", "capped", ".2%")),
    last=losses.POLICY_LAST,
)
def cispo(
    logp: Float[Array, "B T"],
    behavior_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    config: CISPOConfig,
    *,
    is_weights: Float[Array, "B T"] | None = None,
    ref_logp: Float[Array, "B T"] | None = None,
    bounds: None = None,
    num_tokens: float | Array | None = None,
    num_sequences: float | Array | None = None,
    entropy: Float[Array, "B T"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """CISPO's weighted REINFORCE objective (module doc)."""
    terms = dict(
        is_weights=is_weights, ref_logp=ref_logp, entropy=entropy, num_tokens=num_tokens,
        num_sequences=num_sequences, segment_ids=segment_ids,
    )  # fmt: skip
    losses.check_fixed_loss_inputs(logp, behavior_logp, advantages, mask, config, bounds, terms)
    sg = jax.lax.stop_gradient
    ratio = sg(losses.safe_ratio(logp, behavior_logp, mask))  # [B, T]
    c_high = jnp.float32(1.0 + config.eps_high)
    c_low = jnp.float32(0.0 if config.eps_low is None else 1.0 - config.eps_low)
    weight = jnp.clip(ratio, c_low, c_high)  # [B, T], no gradient
    objective = weight * advantages * logp  # [B, T]
    loss, metrics = losses.finish_policy_loss(objective, logp, mask, config, **terms)
    metrics.update(losses.clip_metrics(ratio, advantages, mask, c_low, c_high, None))
    valid = mask > 0
    count = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)
    metrics["weight_clip_frac"] = jnp.sum((valid & (ratio > c_high)).astype(jnp.float32)) / count
    metrics.update(
        losses.carried_balance(jnp.abs(advantages) * weight, advantages, mask, num_tokens)
    )
    return loss, metrics
