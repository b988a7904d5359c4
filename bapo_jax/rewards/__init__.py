"""Verifiable rewards: math answer checking in time-bounded worker processes, and shaping."""

from bapo_jax.rewards.boxed import extract_last_boxed, has_boxed_answer
from bapo_jax.rewards.math import (
    configure_reward_pool,
    format_reward,
    math_reward,
    math_reward_batch,
    reward_pool,
    reward_stats,
    shutdown_reward_pool,
)
from bapo_jax.rewards.pool import PoolStats, RewardPool
from bapo_jax.rewards.shaping import overlong_penalty

__all__ = [
    "PoolStats",
    "RewardPool",
    "configure_reward_pool",
    "extract_last_boxed",
    "format_reward",
    "has_boxed_answer",
    "math_reward",
    "math_reward_batch",
    "overlong_penalty",
    "reward_pool",
    "reward_stats",
    "shutdown_reward_pool",
]
