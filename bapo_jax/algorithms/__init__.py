"""Policy-optimisation algorithms: BAPO, clipped-PPO baselines, advantages.

Importing the package registers every loss (`registry.get_loss("bapo" | "ppo_clip" |
"clip_higher" | "gspo" | "cispo" | "kl_cov")`). Imports run one way: bapo -> bapo_search (the
bound search) -> losses (shared terms, fixed-clip baselines) -> registry; gspo (sequence
ratios), cispo (clipped IS weights) and kl_cov (covariance-selected KL penalty) -> losses;
advantages stands alone; all take their input checks from `bapo_jax.checks`.
"""

from bapo_jax.algorithms import (
    advantages,
    bapo,
    bapo_search,
    cispo,
    gspo,
    kl_cov,
    losses,
    registry,
)

__all__ = [
    "advantages",
    "bapo",
    "bapo_search",
    "cispo",
    "gspo",
    "kl_cov",
    "losses",
    "registry",
]
