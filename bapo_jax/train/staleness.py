"""How old the trained tokens are, and what a run does with those past a version gap.

The lag of a response token is the policy version being trained (the iteration i) minus the
version that sampled it (the engine reports one per token): 0 on-policy, up to k with
staleness k, more for a partial rollout's early tokens or a replayed group.

Gap control (`offpolicy.max_version_gap` = G, `offpolicy.gap_policy`, AReaL's
`max_head_offpolicyness` / verl's rollout staleness policies):

    mask   a trained token of lag > G leaves the loss (its response's other tokens stay);
    drop   a response holding any such token leaves the loss whole;
    wait   the loop never lets generation run more than G versions ahead of the trainer (batch
           j is submitted once version j - G is published: the effective staleness is
           min(k, G)), and the tokens that are older still (a partial rollout's early tokens, a
           replayed group) are masked.

Masked tokens stay in the batch (its shape, the group's advantages) with a zero loss mask.

Metrics (per iteration):

    staleness/lag0_share .. lag2_share, lag3plus_share   the distribution of lags over the
                                           tokens that would be trained, before the gap policy;
    staleness/mean_pos, mean_neg           their mean lag by advantage sign (partial rollouts:
                                           do the negative, longer responses run staler?);
    gap/masked_tokens, gap/masked_share, gap/dropped_responses   what the policy removed;
    masked/overlong_share                  response tokens out of the loss because their response
                                           hit the cap (`algorithm.overlong_filter`); the IS
                                           band's masking is the loss's `is_masked_frac`;
    with pi_old recomputed (`ratio_base="recomputed"`), over the tokens trained:
    is_ratio/min, p01, p50, p99, max       of w = pi_old / pi_behaviour;
    mismatch/lag<b>/mean_abs               |log pi_behaviour - log pi_old| per lag bucket (lag 0:
                                           the engine against the trainer on the same weights;
                                           older: plus the policy's change since).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bapo_jax.train.assemble import RowArrays

__all__ = [
    "LAG_BUCKETS",
    "apply_gap",
    "lag_metrics",
    "ratio_metrics",
    "submit_depth",
    "token_lags",
]

LAG_BUCKETS = ("lag0", "lag1", "lag2", "lag3plus")


def _bucket(lag: np.ndarray) -> np.ndarray:
    return np.minimum(lag, len(LAG_BUCKETS) - 1)


def token_lags(rows: RowArrays, version: int) -> np.ndarray:
    """Each response token's lag, `version` minus the version that sampled it ([N, T] int32,
    0 off the responses): a staleness-aware loss's `TrainBatch.lags`."""
    return np.where(rows.versions >= 0, version - rows.versions, 0).astype(np.int32)


def submit_depth(staleness: int, max_gap: int | None, policy: str) -> int:
    """How many batches ahead of the trainer the loop submits: k, or min(k, G) under wait."""
    if policy == "wait" and max_gap is not None:
        return min(staleness, max_gap)
    return staleness


def apply_gap(
    rows: RowArrays, version: int, max_gap: int | None, policy: str
) -> tuple[RowArrays, dict[str, float]]:
    """`rows` with the tokens (mask, wait) or responses (drop) past the gap out of the loss,
    and what was removed; `rows` unchanged and no metric when `max_gap` is None."""
    if max_gap is None:
        return rows, {}
    trained = rows.loss_mask > 0  # [N, T]
    old = trained & (rows.versions >= 0) & (version - rows.versions > max_gap)
    if not old.any():
        out = {"gap/masked_tokens": 0.0, "gap/masked_share": 0.0}
        return rows, out | ({"gap/dropped_responses": 0.0} if policy == "drop" else {})
    loss = rows.loss_mask.copy()
    if policy == "drop":
        dropped = old.any(axis=1)  # [N]
        removed = trained & dropped[:, None]
    else:
        dropped, removed = None, old
    loss[removed] = 0.0
    out = {
        "gap/masked_tokens": float(removed.sum()),
        "gap/masked_share": float(removed.sum() / trained.sum()),
    }
    if dropped is not None:
        out["gap/dropped_responses"] = float(dropped.sum())
    return dataclasses.replace(rows, loss_mask=loss), out


def lag_metrics(rows: RowArrays, version: int) -> dict[str, float]:
    """The lag distribution of the tokens `rows` trains and the overlong share (module doc)."""
    trained = (rows.loss_mask > 0) & (rows.versions >= 0)  # [N, T]
    response = rows.versions >= 0  # [N, T]: the sampled tokens
    raw = np.maximum(version - rows.versions, 0)  # [N, T]
    lag = _bucket(raw)
    total = max(1, int(trained.sum()))
    out = {
        f"staleness/{name}_share": float((trained & (lag == b)).sum() / total)
        for b, name in enumerate(LAG_BUCKETS)
    }
    cut = response & rows.active[:, None] & rows.overlong[:, None] & ~trained
    out["masked/overlong_share"] = float(cut.sum() / max(1, int(response.sum())))
    for sign, side in (("pos", rows.advantages > 0), ("neg", rows.advantages < 0)):
        if (here := trained & side).any():  # mean lag of the tokens of each advantage sign
            out[f"staleness/mean_{sign}"] = float(raw[here].mean())
    return out


def ratio_metrics(rows: RowArrays, version: int, old_logp: np.ndarray) -> dict[str, float]:
    """Over the tokens `rows` trains, with `old_logp` ([N, T], pi_old): the quantiles of
    w = pi_old / pi_behaviour and |log pi_behaviour - log pi_old| by lag (module doc)."""
    trained = (rows.loss_mask > 0) & (rows.versions >= 0)  # [N, T]
    if not trained.any():
        return {}
    log_w = (old_logp - rows.behavior_logp)[trained].astype(np.float64)
    w = np.exp(log_w)
    out = {
        f"is_ratio/{name}": float(np.quantile(w, q))
        for name, q in (("min", 0.0), ("p01", 0.01), ("p50", 0.5), ("p99", 0.99), ("max", 1.0))
    }
    lag = _bucket(np.maximum(version - rows.versions, 0))[trained]
    gap = np.abs(log_w)
    for b, name in enumerate(LAG_BUCKETS):
        if (here := lag == b).any():
            out[f"mismatch/{name}/mean_abs"] = float(gap[here].mean())
    return out
