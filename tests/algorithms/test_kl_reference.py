"""The KL penalty to a reference policy, against a hand-computed case and a numpy transcription.

For every registered loss, aggregation and estimator: loss(kl_coef=beta) = loss(kl_coef=0) +
beta * agg(KL_t) and d loss / d logp gains beta * agg-weight * dKL_t/dlogp, with

    k1 = log pi - log pi_ref                       dk1/dlogp = 1
    k3 = pi_ref/pi - log(pi_ref/pi) - 1            dk3/dlogp = 1 - pi_ref/pi
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.algorithms import losses, registry

# Two sequences, three positions; the last token of row 2 is padding.
LOGP = np.asarray([[-1.0, -2.0, -0.5], [-0.3, -1.2, -0.7]], np.float32)
REF = np.asarray([[-1.5, -1.0, -0.5], [-0.3, -2.2, -4.0]], np.float32)
MASK = np.asarray([[1, 1, 1], [1, 1, 0]], np.float32)
BEHAVIOR = np.asarray([[-1.1, -1.9, -0.6], [-0.2, -1.3, -0.7]], np.float32)
ADV = np.asarray([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]], np.float32)


def numpy_kl_terms(logp, ref, estimator):
    """Per-token KL(pi || pi_ref) estimate and its derivative in log pi (float64)."""
    logp, ref = np.asarray(logp, np.float64), np.asarray(ref, np.float64)
    if estimator == "k1":
        return logp - ref, np.ones_like(logp)
    ratio = np.exp(ref - logp)  # pi_ref / pi
    return ratio - np.log(ratio) - 1.0, 1.0 - ratio


def numpy_agg_weights(mask, aggregation):
    """w with agg(v) = sum(w * v) for the config's aggregation (every row has a token)."""
    mask = np.asarray(mask, np.float64)
    if aggregation == "token_mean":
        return mask / mask.sum()
    rows = mask.shape[0]
    if aggregation == "seq_mean_token_mean":
        return mask / mask.sum(axis=1, keepdims=True) / rows
    return mask / rows  # seq_mean_token_sum


def numpy_kl(logp, ref, mask, estimator, aggregation):
    value, slope = numpy_kl_terms(logp, ref, estimator)
    w = numpy_agg_weights(mask, aggregation)
    return float(np.sum(w * value)), w * slope


def test_hand_computed_case():
    # Valid tokens: x = ref - logp = (-0.5, 1.0, 0.0 | 0.0, -1.0).
    # k1 = logp - ref = (0.5, -1, 0 | 0, 1):           token_mean 0.5 / 5 = 0.1
    #   seq_mean_token_mean ((-0.5/3) + (1/2)) / 2 = 1/6;  seq_mean_token_sum (-0.5 + 1) / 2.
    # k3 = e^x - x - 1 = (e^-0.5 - 0.5, e - 2, 0 | 0, e^-1): token_mean their sum / 5.
    k3_sum = (math.exp(-0.5) - 0.5) + (math.e - 2.0) + math.exp(-1.0)
    hand = {
        ("k1", "token_mean"): 0.1,
        ("k1", "seq_mean_token_mean"): 1.0 / 6.0,
        ("k1", "seq_mean_token_sum"): 0.25,
        ("k3", "token_mean"): k3_sum / 5.0,
        ("k3", "seq_mean_token_sum"): k3_sum / 2.0,
    }
    for (estimator, aggregation), want in hand.items():
        got, _ = numpy_kl(LOGP, REF, MASK, estimator, aggregation)
        assert got == pytest.approx(want, rel=1e-12), (estimator, aggregation)
        per_token = losses.kl_to_reference(jnp.asarray(LOGP), jnp.asarray(REF), estimator)
        chex.assert_shape(per_token, LOGP.shape)
        jax_value = losses.aggregate(per_token, jnp.asarray(MASK), aggregation)
        np.testing.assert_allclose(jax_value, want, rtol=1e-6)


@functools.partial(jax.jit, static_argnums=(0, 1))
def _loss_and_grad(name, config, logp, ref):
    fn = registry.get_loss(name).fn

    def loss_fn(lp):
        return fn(lp, jnp.asarray(BEHAVIOR), jnp.asarray(ADV), jnp.asarray(MASK), config,
                  ref_logp=ref)  # fmt: skip

    return jax.value_and_grad(loss_fn, has_aux=True)(logp)


LOSSES = ("bapo", "ppo_clip", "clip_higher")
AGGREGATIONS = losses.AGGREGATIONS


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_penalty_adds_beta_times_the_numpy_kl(name, aggregation, estimator):
    beta = 0.25
    make = functools.partial(registry.make_loss_config, name, aggregation=aggregation)
    base = make(kl_estimator=estimator)
    with_kl = make(kl_coef=beta, kl_estimator=estimator)
    logp, ref = jnp.asarray(LOGP), jnp.asarray(REF)
    (loss0, m0), grad0 = _loss_and_grad(name, base, logp, ref)
    (loss1, m1), grad1 = _loss_and_grad(name, with_kl, logp, ref)
    chex.assert_tree_all_finite((loss0, loss1, grad0, grad1))
    kl, dkl = numpy_kl(LOGP, REF, MASK, estimator, aggregation)
    np.testing.assert_allclose(m1["kl_ref"], kl, rtol=1e-5)
    np.testing.assert_allclose(m0["kl_ref"], kl, rtol=1e-5)  # reported even at kl_coef 0
    np.testing.assert_allclose(loss1, loss0 + beta * kl, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m1["pg_loss"], m0["pg_loss"], rtol=1e-6)
    np.testing.assert_allclose(grad1 - grad0, beta * dkl, rtol=1e-4, atol=1e-6)
    assert np.all(np.asarray(grad1 - grad0)[MASK == 0] == 0.0)  # padding never gets gradient


@pytest.mark.parametrize("name", LOSSES)
def test_reference_equal_to_policy(name):
    """pi_ref = pi: KL 0 for both estimators; k3's gradient is 0 too (identical update), k1's
    is beta * agg-weight (its expectation under pi is 0, not its sample value)."""
    beta = 0.5
    logp = jnp.asarray(LOGP)
    (loss0, _), grad0 = _loss_and_grad(name, registry.make_loss_config(name), logp, logp)
    for estimator in ("k1", "k3"):
        config = registry.make_loss_config(name, kl_coef=beta, kl_estimator=estimator)
        (loss, metrics), grad = _loss_and_grad(name, config, logp, logp)
        assert float(metrics["kl_ref"]) == 0.0
        np.testing.assert_allclose(loss, loss0, rtol=1e-7)
        if estimator == "k3":
            chex.assert_trees_all_equal(grad, grad0)
        else:
            weights = numpy_agg_weights(MASK, "token_mean")
            np.testing.assert_allclose(grad - grad0, beta * weights, rtol=1e-5, atol=1e-7)


def test_kl_coef_without_reference_is_refused():
    for name in LOSSES:
        config = registry.make_loss_config(name, kl_coef=0.1)
        with pytest.raises(ValueError, match=r"kl_coef=0.1 > 0 needs ref_logp"):
            registry.get_loss(name).fn(
                jnp.asarray(LOGP), jnp.asarray(BEHAVIOR), jnp.asarray(ADV), jnp.asarray(MASK),
                config,
            )  # fmt: skip
