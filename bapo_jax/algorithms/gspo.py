"""GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization"): one importance ratio per
sequence, clipped per sequence.

    s_i = exp( (1 / |y_i|) sum_t log( pi_theta(y_i,t) / pi_old(y_i,t) ) )    (length-normalised)
    J_i = min( s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i )
    loss = -(1 / G) sum_i J_i                                  (aggregation seq_mean_token_mean)

Every token of sequence i carries s_i (GSPO-token with one advantage per sequence: the same
value and gradient, d s_i / d log pi_t = s_i / |y_i|), so the shared terms apply unchanged:
packed rows (a sequence is a segment), truncated IS weights, KL and entropy terms, the metrics,
and rho at the bounds (`losses.clipped_ratio_loss`). pi_old is the ratio base of the step
(the engine's behaviour log-probs, or the recomputed ones). Defaults are the paper's
experimental setting: clipping ranges 3e-4 and 4e-4 (a length-normalised sequence ratio moves
far less than a token's), a sequence-level mean.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from bapo_jax.algorithms import losses
from bapo_jax.algorithms.registry import register_loss
from bapo_jax.checks import check_field, is_finite_number

__all__ = ["GSPOConfig", "gspo", "sequence_ratio"]


@dataclasses.dataclass(frozen=True)
class GSPOConfig(losses.LossTerms):
    """eps_low / eps_high: the sequence ratio's clipping range [1 - eps_low, 1 + eps_high]."""

    eps_low: float = 3e-4
    eps_high: float = 4e-4
    dual_clip: float | None = None
    aggregation: losses.Aggregation = "seq_mean_token_mean"

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
        losses.check_dual_clip(self.dual_clip)


def sequence_ratio(
    logp: Float[Array, "B T"],
    base_logp: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    segment_ids: Int[Array, "B T"] | None = None,
) -> Float[Array, "B T"]:
    """s_i of each token's sequence (module doc); 1 on padding."""
    log_ratio = losses.sequence_means(logp - base_logp, mask, segment_ids)  # [B, T]
    return jnp.exp(jnp.where(mask > 0, log_ratio, 0.0))


@register_loss(
    "gspo",
    GSPOConfig,
    metrics=losses.FIXED_CLIP_METRICS,
    progress=losses.POLICY_PROGRESS,
    last=losses.POLICY_LAST,
)
def gspo(
    logp: Float[Array, "B T"],
    behavior_logp: Float[Array, "B T"],
    advantages: Float[Array, "B T"],
    mask: Float[Array, "B T"],
    config: GSPOConfig,
    *,
    is_weights: Float[Array, "B T"] | None = None,
    ref_logp: Float[Array, "B T"] | None = None,
    bounds: None = None,
    num_tokens: float | Array | None = None,
    num_sequences: float | Array | None = None,
    entropy: Float[Array, "B T"] | None = None,
    segment_ids: Int[Array, "B T"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """GSPO's clipped sequence-ratio objective (module doc); the metrics' ratios are s_i."""
    terms = dict(
        is_weights=is_weights, ref_logp=ref_logp, entropy=entropy, num_tokens=num_tokens,
        num_sequences=num_sequences, segment_ids=segment_ids,
    )  # fmt: skip
    losses.check_fixed_loss_inputs(logp, behavior_logp, advantages, mask, config, bounds, terms)
    ratio = sequence_ratio(logp, behavior_logp, mask, segment_ids)
    c_low, c_high = 1.0 - config.eps_low, 1.0 + config.eps_high
    return losses.clipped_ratio_loss(ratio, logp, advantages, mask, c_low, c_high, config, **terms)
