"""Policy-optimisation algorithms: BAPO, clipped-PPO baselines, advantages.

Importing the package registers every loss (`losses.get_loss("bapo" | "ppo_clip" |
"clip_higher")`).
"""

from bapo_jax.algorithms import advantages, bapo, bapo_search, losses

__all__ = ["advantages", "bapo", "bapo_search", "losses"]
