"""BAPO's precondition, measured on a batch's data before any update moves the ratios.

BAPO widens its bounds only while the positive tokens' share of the objective is below rho0.
At r = 1 (every ratio at the start of an update on fresh data, no bound active) both of its
statistics (value and gradient) reduce to the advantage mass of each sign, over the trained
tokens t of one update:

    rho = P / (P + N),   P = sum_{t: A_t > 0} w_t |A_t|,   N = sum_{t: A_t < 0} w_t |A_t|

with w_t = 1 (the authors' code) or w_t = pi_rollout(y_t) = exp(behaviour log-prob) (the
paper's Eq. 8 weighting): `balance/rho_r1*` and `balance/rho_r1_pi*`. With GRPO advantages
(zero sum over each group's responses) every token of a response carries its response's
advantage, so within a group P - N = sum_i A_i L_i: a whole-group mini-batch has rho < 1/2
only where the wrong responses are longer than the right ones (`balance/length_ratio`,
within groups; `balance/length_pos` / `_neg`, the batch's mean lengths by sign); a
mini-batch of rows from many groups (`algorithm.minibatch="rows"`) has a sum of advantages
that is zero only on average (`balance/advantage_sum_max`), and rho moves with it by chance.
Groups whose G rewards are equal have A = 0 and carry no signal (`balance/zero_variance_groups`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from bapo_jax.train.assemble import RowArrays


def response_advantages(rows: RowArrays) -> np.ndarray:
    """Each row's (response's) advantage [N]: its tokens all carry it; 0 for an empty one."""
    lengths = np.maximum(rows.response_lengths, 1)
    return rows.advantages.sum(axis=1, dtype=np.float64) / lengths


def signed_masses(rows: RowArrays, pi_weighted: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Per row, the trained tokens' advantage mass of each sign at r = 1, (P_i, N_i) [N] each:
    sum of w |A| over the tokens with A > 0 (A < 0), w = 1 or pi_rollout."""
    trained = rows.loss_mask > 0  # [N, T]
    weight = np.where(trained, 1.0, 0.0)
    if pi_weighted:
        weight = weight * np.exp(np.where(trained, rows.behavior_logp, 0.0))
    mass = weight * np.abs(rows.advantages)  # [N, T]
    pos = np.where(rows.advantages > 0, mass, 0.0).sum(axis=1)
    neg = np.where(rows.advantages < 0, mass, 0.0).sum(axis=1)
    return pos, neg


def _rho(pos: float, neg: float) -> float:
    return pos / (pos + neg) if pos + neg > 0 else float("nan")


def length_ratio(rows: RowArrays, group_size: int) -> float:
    """Mean over the active groups with both signs of (mean length of the responses with A < 0)
    / (mean length of those with A > 0); NaN when no group has both."""
    adv = response_advantages(rows).reshape(-1, group_size)  # [groups, G]
    lengths = rows.response_lengths.reshape(-1, group_size).astype(np.float64)
    active = rows.active.reshape(-1, group_size).all(axis=1)
    ratios = [
        lengths[g][adv[g] < 0].mean() / max(lengths[g][adv[g] > 0].mean(), 1.0)
        for g in range(adv.shape[0])
        if active[g] and (adv[g] < 0).any() and (adv[g] > 0).any()
    ]
    return float(np.mean(ratios)) if ratios else float("nan")


def zero_variance_share(rows: RowArrays, group_size: int) -> float:
    """Share of the active groups whose G rewards are all equal (advantage 0 everywhere)."""
    rewards = rows.rewards.reshape(-1, group_size)
    active = rows.active.reshape(-1, group_size).all(axis=1)
    if not active.any():
        return 0.0
    flat = (rewards.max(axis=1) == rewards.min(axis=1))[active]
    return float(flat.mean())


def _mean_or_nan(x: np.ndarray) -> float:
    return float(x.mean()) if x.size else float("nan")


PAPER_RHO0 = 0.4


def rho0_of(algorithm) -> float:
    """The threshold `_below` counts against: the active loss's rho0 (BAPO's), else the
    paper's 0.4 (a baseline's runs measure the precondition BAPO would face)."""
    return float(getattr(algorithm.loss_config, "rho0", PAPER_RHO0))


def precondition_metrics(
    rows: RowArrays, updates: Sequence[np.ndarray], group_size: int, rho0: float
) -> dict[str, float]:
    """The batch's precondition measures; `updates` holds each update's row indices (its
    mini-batch). Per update: rho at r = 1 (both weightings) and |sum of the trained responses'
    advantages|; reported as the mean, the min and the share of updates with rho < rho0."""
    adv = response_advantages(rows)
    trained = (rows.loss_mask > 0).any(axis=1)
    rho, rho_pi = (
        np.array([_rho(float(pos[i].sum()), float(neg[i].sum())) for i in updates])
        for pos, neg in (signed_masses(rows), signed_masses(rows, pi_weighted=True))
    )
    sums = [abs(float(adv[i][trained[i]].sum())) for i in updates]
    active = rows.active & trained
    lengths = rows.response_lengths.astype(np.float64)
    out = {
        "balance/length_pos": _mean_or_nan(lengths[active & (adv > 0)]),
        "balance/length_neg": _mean_or_nan(lengths[active & (adv < 0)]),
        "balance/length_ratio": length_ratio(rows, group_size),
        "balance/zero_variance_groups": zero_variance_share(rows, group_size),
        "balance/advantage_sum_max": max(sums, default=0.0),
    }
    for name, values in (("rho_r1", rho), ("rho_r1_pi", rho_pi)):
        known = values[np.isfinite(values)]
        out[f"balance/{name}"] = float(known.mean()) if known.size else float("nan")
        out[f"balance/{name}_min"] = float(known.min()) if known.size else float("nan")
        out[f"balance/{name}_below"] = float((known < rho0).mean()) if known.size else 0.0
        # the authors' recipe's target, P / N >= 1, whatever the run's rho0
        out[f"balance/{name}_below_half"] = float((known < 0.5).mean()) if known.size else 0.0
    return out
