"""Verifiable rewards: math answer checking in time-bounded worker processes, reward
plug-ins run in the same workers (docs/rewards.md), and shaping."""

from bapo_jax.rewards.boxed import extract_last_boxed, has_boxed_answer
from bapo_jax.rewards.config import RewardConfigError, RewardSection
from bapo_jax.rewards.function import RewardFunction, reward_pool_for
from bapo_jax.rewards.math import (
    configure_reward_pool,
    format_reward,
    math_reward,
    math_reward_batch,
    reward_pool,
    reward_stats,
    shutdown_reward_pool,
)
from bapo_jax.rewards.plugins import PluginError, exact_match, load_plugin
from bapo_jax.rewards.pool import PoolStats, RewardPool
from bapo_jax.rewards.shaping import overlong_penalty

__all__ = [
    "PluginError",
    "PoolStats",
    "RewardConfigError",
    "RewardFunction",
    "RewardPool",
    "RewardSection",
    "configure_reward_pool",
    "exact_match",
    "extract_last_boxed",
    "format_reward",
    "has_boxed_answer",
    "load_plugin",
    "math_reward",
    "math_reward_batch",
    "overlong_penalty",
    "reward_pool",
    "reward_pool_for",
    "reward_stats",
    "shutdown_reward_pool",
]
