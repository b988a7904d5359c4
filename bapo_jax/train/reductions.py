"""How the train step's metrics combine: over the micro-batches of one update and over the E
updates of one rollout batch, each by the reduction it declares once (a loss's in
`registry.LossSpec.metrics`, the step's own in `STEP_METRICS`); and the engine mismatch read
from a batch's first update (`first_update_gap`)."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from bapo_jax.algorithms import losses, registry

# The step's own metrics and their reductions over updates (see `registry.Reduction`; and
# "sampled": the mean over the updates that measured it, NaN on the others).
STEP_METRICS = {
    "grad_norm": "max",
    "grad_norm_clipped": "mean",
    "grad_norm_pos": "sampled",
    "grad_norm_neg": "sampled",
    "grad_share_neg": "sampled",
    "param_norm": "mean",
    "num_tokens": "mean",
    "behavior_gap_sum": "sum",  # over an update's micro-batches; the loop takes the first
    "behavior_gap_max": "max",  # update's (`BEHAVIOUR_GAP`), never a mean over updates
    "behavior_gap_tokens": "sum",
    "learning_rate": "mean",
}


BEHAVIOUR_GAP = ("behavior_gap_sum", "behavior_gap_max", "behavior_gap_tokens")


def first_update_gap(stats: list[dict[str, Any]]) -> dict[str, float]:
    """Removes `BEHAVIOUR_GAP` from every update's metrics and returns the first update's as
    `mismatch/mean_abs`, `max_abs` and `tokens` (what the loop logs when that update's tokens
    were all sampled by the weights it starts from)."""
    gaps = [{k: s.pop(k) for k in BEHAVIOUR_GAP if k in s} for s in stats]
    if not gaps or len(gaps[0]) != len(BEHAVIOUR_GAP) or not gaps[0]["behavior_gap_tokens"]:
        return {}
    first, tokens = gaps[0], float(gaps[0]["behavior_gap_tokens"])
    return {
        "mismatch/mean_abs": float(first["behavior_gap_sum"]) / tokens,
        "mismatch/max_abs": float(first["behavior_gap_max"]),
        "mismatch/tokens": tokens,
    }


def metric_reduction(loss: str, key: str) -> str:
    """How metric `key` of a step with loss `loss` combines (a `registry.Reduction`)."""
    return STEP_METRICS[key] if key in STEP_METRICS else registry.get_loss(loss).reduction(key)


def combine_micro_metrics(
    metrics: dict[str, Array], tokens: Float[Array, " M"], loss: str
) -> dict[str, Array]:
    """[M]-stacked micro-batch metrics -> update-level scalars, each by its declared reduction;
    micro-batches without trained tokens (tokens == 0) are left out."""
    used = tokens > 0
    weights = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
    out = {}
    for key, value in metrics.items():
        how = metric_reduction(loss, key)
        if how == "sum":
            out[key] = jnp.sum(jnp.where(used, value, 0))
        elif how == "mean":
            out[key] = jnp.sum(weights * value)
        elif how == "min":
            out[key] = jnp.min(jnp.where(used, value, jnp.inf))
        elif how == "max":
            out[key] = jnp.max(jnp.where(used, value, -jnp.inf))
        elif how == "all":
            out[key] = jnp.all(jnp.where(used, value, True))
        else:  # "balance": from its summed parts
            parts = (jnp.sum(jnp.where(used, metrics[f"{key}/{p}"], 0)) for p in ("pos", "neg"))
            out[key] = losses.balance(*parts)
    return out


def combine_updates(stats: list[dict[str, Any]], loss: str) -> dict[str, float]:
    """The E updates' metrics of one rollout batch -> one value each, by declared reduction
    ("sum" and "mean" metrics are per-update values already: their mean)."""
    out: dict[str, float] = {}
    for key in stats[0]:
        values = np.asarray([np.asarray(s[key], np.float64) for s in stats])
        how = metric_reduction(loss, key)
        if how == "min":
            out[key] = float(values.min())
        elif how == "max":
            out[key] = float(values.max())
        elif how == "all":
            out[key] = float(values.all())
        elif how == "sampled":  # measured on some updates only (NaN on the others)
            measured = values[~np.isnan(values)]
            out[key] = float(measured.mean()) if len(measured) else float("nan")
        else:
            out[key] = float(values.mean())
    return out
