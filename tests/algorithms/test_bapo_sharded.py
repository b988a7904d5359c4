"""BAPO on an 8-device CPU mesh: the batch sharded over "data" gives the single-device result.

Under jit with sharded inputs the bucket sums are global (XLA all-reduces the segment sums),
so every device uses the same bounds: the update-wide scope without any explicit collective.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from bapo_jax.algorithms import bapo, bapo_search

B, T = 16, 32
# On the seed-0 batch these make 14 and 44 moves (neither 0 nor all 51).
CONFIGS = [
    bapo.BAPOConfig(rho0=0.42),
    bapo.BAPOConfig(
        rho0=0.5, order="lower_first", statistic="gradient", weight_by_behavior_prob=True
    ),
]


def make_batch(seed):
    rng = np.random.default_rng(seed)
    behavior_logp = rng.uniform(-3.0, -0.1, (B, T)).astype(np.float32)
    logp = (behavior_logp + rng.normal(0.0, 0.5, (B, T))).astype(np.float32)
    advantages = np.repeat(rng.choice([-1.0, -0.5, 0.5, 1.0], (B, 1)), T, axis=1)
    mask = (np.arange(T)[None, :] < rng.integers(4, T + 1, (B, 1))).astype(np.float32)
    return tuple(np.asarray(x, np.float32) for x in (logp, behavior_logp, advantages, mask))


def loss_and_grad(logp, behavior_logp, advantages, mask, config):
    def loss_fn(lp):
        return bapo.policy_loss(lp, behavior_logp, advantages, mask, config)

    return jax.value_and_grad(loss_fn, has_aux=True)(logp)


def test_sharded_batch_matches_single_device():
    assert len(jax.devices()) == 8, "tests/conftest.py provides 8 CPU devices"
    mesh = Mesh(np.array(jax.devices()), ("data",))
    sharded = NamedSharding(mesh, P("data"))
    single = jax.devices()[0]
    batch = make_batch(0)
    for config in CONFIGS:
        step = jax.jit(loss_and_grad, static_argnums=(4,))
        (loss_1, metrics_1), grad_1 = step(*[jax.device_put(x, single) for x in batch], config)
        on_mesh = [jax.device_put(x, sharded) for x in batch]
        assert len(on_mesh[0].sharding.device_set) == 8
        (loss_8, metrics_8), grad_8 = step(*on_mesh, config)
        assert len(grad_8.sharding.device_set) == 8
        (loss_1, metrics_1, grad_1, loss_8, metrics_8, grad_8) = jax.device_get(
            (loss_1, metrics_1, grad_1, loss_8, metrics_8, grad_8)
        )

        assert 0 < int(metrics_1["iterations"]) < 51  # the search actually moved
        for key in ("c_low", "c_high", "iterations", "reached"):
            assert metrics_8[key] == metrics_1[key], key
        chex.assert_trees_all_close(metrics_8["rho"], metrics_1["rho"], rtol=1e-6)
        chex.assert_trees_all_close(loss_8, loss_1, rtol=1e-6, atol=1e-7)
        chex.assert_trees_all_close(grad_8, grad_1, rtol=1e-6, atol=1e-9)

        # The search alone, on sharded ratios.
        search = jax.jit(bapo_search.search_bounds, static_argnums=(3,))
        ratio = jnp.exp(on_mesh[0] - on_mesh[1])
        result_8 = search(ratio, on_mesh[2], on_mesh[3], config, on_mesh[1])
        result_8 = jax.device_get(result_8)
        assert result_8.c_high == metrics_1["c_high"] and result_8.c_low == metrics_1["c_low"]
        assert result_8.iterations == metrics_1["iterations"]
