"""BAPO under jit, grad and vmap; no retrace; determinism; both search scopes."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.algorithms import bapo, bapo_search

B, T = 4, 16
# With rho0 = 0.5 the batches of seeds 0..5 make 0, 51, 0, 13, 4 and 51 moves.
CONFIG = bapo.BAPOConfig(rho0=0.5)


def make_batch(seed, batch=B):
    rng = np.random.default_rng(seed)
    behavior_logp = rng.uniform(-3.0, -0.1, (batch, T)).astype(np.float32)
    logp = (behavior_logp + rng.normal(0.0, 0.5, (batch, T))).astype(np.float32)
    advantages = np.repeat(rng.choice([-1.0, -0.5, 0.5, 1.0], (batch, 1)), T, axis=1)
    mask = (np.arange(T)[None, :] < rng.integers(T // 2, T + 1, (batch, 1))).astype(np.float32)
    return tuple(jnp.asarray(x, jnp.float32) for x in (logp, behavior_logp, advantages, mask))


def loss_and_grad(logp, behavior_logp, advantages, mask, config=CONFIG, **kwargs):
    def loss_fn(lp):
        return bapo.policy_loss(lp, behavior_logp, advantages, mask, config, **kwargs)

    return jax.value_and_grad(loss_fn, has_aux=True)(logp)


jit_loss_and_grad = jax.jit(loss_and_grad, static_argnames="config")


search = jax.jit(bapo_search.search_bounds, static_argnums=(3,))
grid_sums = jax.jit(bapo_search.grid_sums, static_argnums=(3,))


def test_jit_matches_eager_and_grad_is_finite():
    batch = make_batch(3)
    (loss, metrics), grad = loss_and_grad(*batch)
    (jit_loss, jit_metrics), jit_grad = jit_loss_and_grad(*batch)
    chex.assert_trees_all_close(loss, jit_loss, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(grad, jit_grad, rtol=1e-6, atol=1e-9)
    assert int(metrics["iterations"]) == int(jit_metrics["iterations"]) > 0
    chex.assert_tree_all_finite((loss, grad))
    chex.assert_shape(grad, (B, T))
    # Padding gets no gradient.
    assert np.all(np.asarray(grad)[np.asarray(batch[3]) == 0] == 0)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_vmap_over_batches_matches_a_loop():
    batches = [make_batch(seed) for seed in range(3)]
    stacked = [jnp.stack(parts) for parts in zip(*batches, strict=True)]  # [K, B, T] each
    (losses, metrics), grads = jax.jit(jax.vmap(loss_and_grad))(*stacked)
    for k, batch in enumerate(batches):
        (loss, own_metrics), grad = jit_loss_and_grad(*batch)
        chex.assert_trees_all_close(losses[k], loss, rtol=1e-6, atol=1e-7)
        chex.assert_trees_all_close(grads[k], grad, rtol=1e-6, atol=1e-9)
        assert metrics["c_high"][k] == own_metrics["c_high"]
        assert metrics["iterations"][k] == own_metrics["iterations"]

    ratio = jnp.exp(stacked[0] - stacked[1])
    searched = jax.vmap(lambda r, a, m: bapo_search.search_bounds(r, a, m, CONFIG))(
        ratio, stacked[2], stacked[3]
    )
    chex.assert_shape(searched.c_low, (3,))
    for k in range(3):
        own = bapo_search.search_bounds(ratio[k], stacked[2][k], stacked[3][k], CONFIG)
        chex.assert_trees_all_equal(jax.tree.map(lambda x, k=k: x[k], searched), own)


def test_no_retrace_across_batches_of_one_shape():
    chex.clear_trace_counter()

    @jax.jit
    @chex.assert_max_traces(n=1)
    def step(logp, behavior_logp, advantages, mask):
        return loss_and_grad(logp, behavior_logp, advantages, mask)

    iterations = set()
    for seed in range(6):
        (_, metrics), _ = step(*make_batch(seed))
        iterations.add(int(metrics["iterations"]))
    assert len(iterations) > 1  # different batches made different numbers of moves


def test_deterministic():
    batch = make_batch(7)
    first = jit_loss_and_grad(*batch)
    second = jax.jit(loss_and_grad)(*batch)  # a fresh compilation
    chex.assert_trees_all_equal(first, second)


def test_update_scope_with_micro_batches_equals_the_whole_update():
    # The trainer's update-wide scope under gradient accumulation: add the grid sums of all
    # micro-batches, search once, pass the bounds and the global token count to each.
    # Seed 2, rho0 = 0.4: the whole update makes 3 moves; alone, the first micro-batch would
    # make 51 and the second none.
    config = bapo.BAPOConfig(rho0=0.4)
    logp, behavior_logp, advantages, mask = make_batch(2, batch=8)
    ratio = jnp.exp(logp - behavior_logp)
    whole = search(ratio, advantages, mask, config)
    parts = [slice(0, 4), slice(4, 8)]  # one shape: one compilation
    sums = [grid_sums(ratio[p], advantages[p], mask[p], config) for p in parts]
    combined = jax.jit(bapo_search.search_from_sums, static_argnums=1)(sums[0] + sums[1], config)
    chex.assert_trees_all_close(combined, whole, rtol=1e-6)
    assert int(whole.iterations) == 3

    (loss, _), grad = jit_loss_and_grad(logp, behavior_logp, advantages, mask, config=config)
    num_tokens = jnp.sum(mask)
    accumulated_loss, grads = 0.0, []
    for p in parts:
        (part_loss, metrics), part_grad = loss_and_grad(
            logp[p],
            behavior_logp[p],
            advantages[p],
            mask[p],
            bounds=combined,
            num_tokens=num_tokens,
        )
        accumulated_loss += part_loss
        grads.append(part_grad)
        assert metrics["c_high"] == whole.c_high and metrics["c_low"] == whole.c_low
    chex.assert_trees_all_close(accumulated_loss, loss, rtol=1e-6, atol=1e-7)
    chex.assert_trees_all_close(jnp.concatenate(grads), grad, rtol=1e-6, atol=1e-9)

    # Micro-batch scope (authors' code): each micro-batch searches on its own tokens.
    own = [search(ratio[p], advantages[p], mask[p], config) for p in parts]
    assert [int(result.iterations) for result in own] == [51, 0]
    for p, result in zip(parts, own, strict=True):
        (_, metrics), _ = jit_loss_and_grad(
            logp[p], behavior_logp[p], advantages[p], mask[p], config=config, num_tokens=num_tokens
        )
        assert metrics["c_high"] == result.c_high and metrics["iterations"] == result.iterations
