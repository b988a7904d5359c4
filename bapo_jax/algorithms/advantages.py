"""Group-relative advantages: GRPO (and its Dr.GRPO no-std variant) and RLOO.

Rewards come as a flat [B] vector of B = P * G responses, the G responses of each prompt
contiguous (group g = rows g*G .. g*G + G - 1). With R_{g,i} the reward of response i::

    GRPO    (Shao et al. 2024):  A = (R - mean_g) / (std_g + eps),  std unbiased (ddof 1), eps 1e-6
    Dr.GRPO (Liu et al. 2025):   A = R - mean_g                     (normalize_std=False)
    RLOO    (Ahmadian et al. 2024): A = R - mean_{j != i} R_{g,j} = G / (G - 1) (R - mean_g)

A sequence's advantage is broadcast to its response tokens by `token_advantages`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import chex
import jax.numpy as jnp
from jaxtyping import Array, Float

from bapo_jax.checks import check_choice, check_field, is_finite_number

Estimator = Literal["grpo", "rloo"]


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """estimator: "grpo" or "rloo"; normalize_std: GRPO's division by the group std (False =
    Dr.GRPO); eps: added to the std (GRPO's 1e-6)."""

    estimator: Estimator = "grpo"
    normalize_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        check_choice("estimator", self.estimator, Estimator)
        check_field(
            isinstance(self.normalize_std, bool), "normalize_std", "a bool", self.normalize_std
        )
        ok = is_finite_number(self.eps) and self.eps >= 0
        check_field(ok, "eps", ">= 0", self.eps)


def _groups(rewards: Float[Array, " B"], group_size: int) -> Float[Array, "P G"]:
    check_field(
        isinstance(group_size, int) and group_size >= 2, "group_size", "an int >= 2", group_size
    )
    chex.assert_rank(rewards, 1)
    check_field(
        rewards.shape[0] % group_size == 0,
        "rewards.shape[0]",
        f"a multiple of group_size={group_size}",
        rewards.shape[0],
    )
    return jnp.asarray(rewards, jnp.float32).reshape(-1, group_size)  # [P, G]


def grpo_advantages(
    rewards: Float[Array, " B"], group_size: int, *, normalize_std: bool = True, eps: float = 1e-6
) -> Float[Array, " B"]:
    """(R - mean_g) / (std_g + eps) with the unbiased group std; R - mean_g without the std."""
    grouped = _groups(rewards, group_size)  # [P, G]
    centred = grouped - jnp.mean(grouped, axis=-1, keepdims=True)  # [P, G]
    if normalize_std:
        centred = centred / (jnp.std(grouped, axis=-1, ddof=1, keepdims=True) + eps)
    return centred.reshape(-1)


def rloo_advantages(rewards: Float[Array, " B"], group_size: int) -> Float[Array, " B"]:
    """R_i minus the mean of the other G - 1 rewards of its group."""
    grouped = _groups(rewards, group_size)  # [P, G]
    others_mean = (jnp.sum(grouped, axis=-1, keepdims=True) - grouped) / (group_size - 1)
    return (grouped - others_mean).reshape(-1)


def compute_advantages(
    rewards: Float[Array, " B"], group_size: int, config: AdvantageConfig
) -> Float[Array, " B"]:
    """Per-sequence advantages of the configured estimator."""
    if config.estimator == "grpo":
        return grpo_advantages(
            rewards, group_size, normalize_std=config.normalize_std, eps=config.eps
        )
    return rloo_advantages(rewards, group_size)


def token_advantages(
    advantages: Float[Array, " B"], mask: Float[Array, "B T"]
) -> Float[Array, "B T"]:
    """Broadcast each sequence's advantage to its response tokens (0 on padding)."""
    chex.assert_rank([advantages, mask], [1, 2])
    chex.assert_equal_shape_prefix([advantages, mask], 1)
    return advantages[:, None] * mask


def group_statistics(rewards: Float[Array, " B"], group_size: int) -> dict[str, Array]:
    """reward_mean, group_std_mean (unbiased), zero_std_group_frac (groups whose rewards are
    all equal: GRPO gives them zero advantage, so they carry no signal)."""
    grouped = _groups(rewards, group_size)  # [P, G]
    constant = jnp.max(grouped, axis=-1) == jnp.min(grouped, axis=-1)  # [P]
    return {
        "reward_mean": jnp.mean(grouped),
        "group_std_mean": jnp.mean(jnp.std(grouped, axis=-1, ddof=1)),
        "zero_std_group_frac": jnp.mean(constant.astype(jnp.float32)),
    }
