"""GRPO / Dr.GRPO / RLOO advantages and group statistics, by hand."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.algorithms import advantages as adv_lib

# Two groups of G = 4: [1, 0, 0, 0] and [1, 1, 1, 1].
REWARDS = jnp.asarray([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])


def test_grpo_unbiased_std_and_eps():
    # Group 1: mean 0.25; unbiased std = sqrt((0.75^2 + 3 * 0.25^2) / 3) = sqrt(0.25) = 0.5.
    # A = (0.75, -0.25, -0.25, -0.25) / (0.5 + 1e-6). Group 2: constant -> 0 / (0 + 1e-6) = 0.
    got = adv_lib.grpo_advantages(REWARDS, 4)
    expected = np.array([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0]) / (0.5 + 1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # The biased std would be sqrt(0.75/4) = 0.433 and give 1.732 for the first response.
    assert abs(float(got[0]) - 1.5) < 1e-4


def test_dr_grpo_drops_the_std():
    got = adv_lib.grpo_advantages(REWARDS, 4, normalize_std=False)
    np.testing.assert_allclose(got, [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0], rtol=1e-6)


def test_rloo_leaves_one_out():
    # R_i - mean of the other three: 1 - 0 = 1, 0 - 1/3 = -1/3; group 2: 1 - 1 = 0.
    got = adv_lib.rloo_advantages(REWARDS, 4)
    np.testing.assert_allclose(got, [1, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0], rtol=1e-6, atol=1e-7)


def test_compute_advantages_dispatches_on_the_config():
    grpo = adv_lib.compute_advantages(REWARDS, 4, adv_lib.AdvantageConfig())
    chex.assert_trees_all_close(grpo, adv_lib.grpo_advantages(REWARDS, 4))
    dr = adv_lib.compute_advantages(REWARDS, 4, adv_lib.AdvantageConfig(normalize_std=False))
    chex.assert_trees_all_close(dr, adv_lib.grpo_advantages(REWARDS, 4, normalize_std=False))
    rloo = adv_lib.compute_advantages(REWARDS, 4, adv_lib.AdvantageConfig(estimator="rloo"))
    chex.assert_trees_all_close(rloo, adv_lib.rloo_advantages(REWARDS, 4))
    jitted = jax.jit(adv_lib.compute_advantages, static_argnums=(1, 2))
    chex.assert_trees_all_close(jitted(REWARDS, 4, adv_lib.AdvantageConfig()), grpo)


def test_group_statistics():
    # reward mean 5/8; unbiased stds (0.5, 0) -> mean 0.25; one of two groups constant.
    stats = adv_lib.group_statistics(REWARDS, 4)
    np.testing.assert_allclose(
        [stats["reward_mean"], stats["group_std_mean"], stats["zero_std_group_frac"]],
        [0.625, 0.25, 0.5],
        rtol=1e-6,
    )


def test_token_advantages_broadcast_over_the_mask():
    mask = jnp.asarray([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    got = adv_lib.token_advantages(jnp.asarray([2.0, -1.0]), mask)
    chex.assert_trees_all_close(got, jnp.asarray([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))


def test_bad_inputs():
    with pytest.raises(ValueError, match="group_size must be an int >= 2, got 1"):
        adv_lib.grpo_advantages(REWARDS, 1)
    with pytest.raises(ValueError, match=r"rewards.shape\[0\] must be a multiple of group_size=3"):
        adv_lib.rloo_advantages(REWARDS, 3)
    with pytest.raises(ValueError, match="estimator must be one of"):
        adv_lib.AdvantageConfig(estimator="ppo")
    with pytest.raises(ValueError, match=r"eps must be >= 0, got -1\.0"):
        adv_lib.AdvantageConfig(eps=-1.0)
