"""Baseline losses, aggregation modes, KL penalty, entropy bonus, truncated IS weights."""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.algorithms import bapo, losses, registry
from bapo_jax.checks import choices


def _batch(ratios, advs, mask=None):
    logp = jnp.log(jnp.asarray([ratios], jnp.float32))  # behaviour log-probs 0: r = exp(logp)
    blogp = jnp.zeros_like(logp)
    adv = jnp.asarray([advs], jnp.float32)
    mask = jnp.ones_like(logp) if mask is None else jnp.asarray([mask], jnp.float32)
    return logp, blogp, adv, mask


@functools.partial(jax.jit, static_argnums=(0, 1))
def _loss_and_grad(name, config, logp, blogp, adv, mask):
    fn = registry.get_loss(name).fn

    def loss_fn(lp):
        return fn(lp, blogp, adv, mask, config)

    return jax.value_and_grad(loss_fn, has_aux=True)(logp)


# Tokens (A=+1, r=1.5), (A=-1, r=0.5), (A=+1, r=0.9), (A=-1, r=1.1), (A=+1, r=1.25).
RATIOS = [1.5, 0.5, 0.9, 1.1, 1.25]
ADVS = [1.0, -1.0, 1.0, -1.0, 1.0]


def test_ppo_clip_by_hand():
    # Bounds (0.8, 1.2): J = 1.2 - 0.8 + 0.9 - 1.1 + 1.2 = 1.4 -> loss = -1.4 / 5 = -0.28.
    # Gradient A r on unclipped tokens only (3rd: 0.9, 4th: -1.1): dloss = -(A r) / 5.
    # rho (value fraction): P = 1.2 + 0.9 + 1.2 = 3.3, N = 0.8 + 1.1 = 1.9 -> 3.3 / 5.2.
    (loss, metrics), grad = _loss_and_grad(
        "ppo_clip", losses.PPOClipConfig(), *_batch(RATIOS, ADVS)
    )
    chex.assert_trees_all_close(loss, jnp.float32(-0.28), rtol=1e-6)
    chex.assert_trees_all_close(grad, jnp.asarray([[0, 0, -0.9 / 5, 1.1 / 5, 0]]), atol=1e-7)
    np.testing.assert_allclose([metrics["c_low"], metrics["c_high"]], [0.8, 1.2], rtol=1e-6)
    np.testing.assert_allclose(metrics["rho"], 3.3 / 5.2, rtol=1e-6)
    # Clipped: A>0 with r >= 1.2 (1st, 5th) -> 2/5; A<0 with r <= 0.8 (2nd) -> 1/5.
    np.testing.assert_allclose(metrics["clip_high_frac"], 0.4, rtol=1e-6)
    np.testing.assert_allclose(metrics["clip_low_frac"], 0.2, rtol=1e-6)


def test_clip_higher_by_hand():
    # Bounds (0.8, 1.28): the 5th token (r = 1.25) is no longer clipped.
    # J = 1.28 - 0.8 + 0.9 - 1.1 + 1.25 = 1.53 -> loss -0.306; its gradient -1.25 / 5.
    (loss, metrics), grad = _loss_and_grad(
        "clip_higher", losses.ClipHigherConfig(), *_batch(RATIOS, ADVS)
    )
    chex.assert_trees_all_close(loss, jnp.float32(-0.306), rtol=1e-6)
    chex.assert_trees_all_close(
        grad, jnp.asarray([[0, 0, -0.9 / 5, 1.1 / 5, -1.25 / 5]]), atol=1e-7
    )
    np.testing.assert_allclose(metrics["c_high"], 1.28, rtol=1e-6)


def test_dual_clip_in_baselines():
    # (A=-1, r=4): without dual clip J = -4; with dual_clip 3, J = -3 and no gradient.
    batch = _batch([4.0], [-1.0])
    (loss, _), grad = _loss_and_grad("ppo_clip", losses.PPOClipConfig(), *batch)
    np.testing.assert_allclose([loss, grad[0, 0]], [4.0, 4.0], rtol=1e-6)
    config = losses.PPOClipConfig(dual_clip=3.0)
    (loss, metrics), grad = _loss_and_grad("ppo_clip", config, *batch)
    np.testing.assert_allclose([loss, grad[0, 0], metrics["dual_clip_frac"]], [3.0, 0.0, 1.0])


def test_fixed_clip_losses_refuse_bounds():
    with pytest.raises(ValueError, match="bounds is only for adaptive losses"):
        losses.ppo_clip(*_batch(RATIOS, ADVS), losses.PPOClipConfig(), bounds=(0.7, 1.3))


def test_every_registered_loss_has_one_call_shape():
    logp, blogp, adv, mask = _batch(RATIOS, ADVS)
    kwargs = {
        "is_weights": jnp.ones_like(logp),
        "ref_logp": logp - 0.1,
        "num_tokens": 10.0,
        "num_sequences": 2.0,
        "entropy": jnp.full_like(logp, 0.5),
    }
    common = {"loss", "pg_loss", "rho", "pos_token_frac", "ratio_mean", "ratio_min", "ratio_max"}
    common |= {"approx_kl", "kl_ref", "entropy", "is_weight_mean"}
    clipped = {"c_low", "c_high", "clip_high_frac", "clip_low_frac", "dual_clip_frac"}
    for name in registry.loss_names():
        config, spec = registry.make_loss_config(name), registry.get_loss(name)
        loss, metrics = jax.jit(spec.fn, static_argnums=(4,))(
            logp, blogp, adv, mask, config, **kwargs
        )
        chex.assert_shape(loss, ())
        assert common <= set(metrics), (name, common - set(metrics))
        assert set(metrics) <= set(spec.metrics), (name, set(metrics) - set(spec.metrics))
        if name != "kl_cov":  # the one loss without clip bounds
            assert clipped <= set(metrics), (name, clipped - set(metrics))
        # J summed / num_tokens = 10, and pos_token_frac 3/5 for every loss.
        np.testing.assert_allclose(metrics["pos_token_frac"], 0.6, rtol=1e-6)


def test_aggregation_modes_by_hand():
    # Values [[1, 2, 3, pad], [4, pad, pad, pad], [pad x 4]].
    values = jnp.asarray([[1.0, 2, 3, 9], [4, 9, 9, 9], [9, 9, 9, 9]])
    mask = jnp.asarray([[1.0, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])
    # token_mean: (1 + 2 + 3 + 4) / 4 = 2.5; with num_tokens = 8: 10 / 8 = 1.25.
    np.testing.assert_allclose(losses.aggregate(values, mask, "token_mean"), 2.5)
    np.testing.assert_allclose(losses.aggregate(values, mask, "token_mean", 8.0), 1.25)
    # seq_mean_token_mean: (mean(1, 2, 3) + 4) / 2 sequences with tokens = (2 + 4) / 2 = 3.
    np.testing.assert_allclose(losses.aggregate(values, mask, "seq_mean_token_mean"), 3.0)
    # seq_mean_token_sum: (6 + 4) / 2 = 5; with num_sequences = 4: 10 / 4 = 2.5.
    np.testing.assert_allclose(losses.aggregate(values, mask, "seq_mean_token_sum"), 5.0)
    np.testing.assert_allclose(
        losses.aggregate(values, mask, "seq_mean_token_sum", num_sequences=4.0), 2.5
    )
    # Empty mask: 0 in every mode.
    for mode in losses.AGGREGATIONS:
        assert losses.aggregate(values, jnp.zeros_like(mask), mode) == 0.0
    with pytest.raises(ValueError, match="aggregation must be one of"):
        losses.aggregate(values, mask, "seq_sum")


def test_sequence_aggregation_on_packed_rows_by_hand():
    """Packed rows: a sequence is a run of equal segment ids in a row, not the row."""
    # Row 0 holds sequences 1 (tokens 1, 2 trained) and 2 (token 6); row 1 holds sequence 1
    # (token 4) and sequence 2 (nothing trained), then padding (id 0).
    values = jnp.asarray([[9.0, 1, 2, 9, 6], [9, 4, 9, 9, 9]])
    mask = jnp.asarray([[0.0, 1, 1, 0, 1], [0, 1, 0, 0, 0]])
    segments = jnp.asarray([[1, 1, 1, 2, 2], [1, 1, 2, 2, 0]])
    # 3 sequences with a trained token: mean(1, 2) = 1.5, 6, 4 -> (1.5 + 6 + 4) / 3.
    np.testing.assert_allclose(
        losses.aggregate(values, mask, "seq_mean_token_mean", segment_ids=segments), 11.5 / 3
    )
    np.testing.assert_allclose(
        losses.aggregate(values, mask, "seq_mean_token_sum", segment_ids=segments), 13.0 / 3
    )
    assert losses.count_sequences(mask, segments) == 3.0
    # Without segment ids the rows are the sequences: (mean(1, 2, 6) + 4) / 2.
    np.testing.assert_allclose(losses.aggregate(values, mask, "seq_mean_token_mean"), 3.5)
    # token_mean ignores sequences: 13 / 4.
    np.testing.assert_allclose(
        losses.aggregate(values, mask, "token_mean", segment_ids=segments), 3.25
    )


def test_every_metric_of_every_loss_declares_its_reduction():
    logp = jnp.asarray([[0.0, -1.0, -2.0]])
    ones = jnp.ones_like(logp)
    for name in registry.loss_names():
        spec = registry.get_loss(name)
        config = spec.config_cls(kl_coef=0.1)
        _, metrics = spec.fn(
            logp, logp - 0.1, ones, ones, config, ref_logp=logp, entropy=ones, is_weights=ones
        )
        for key in metrics:
            assert spec.reduction(key) in choices(registry.Reduction), (name, key)
    assert registry.get_loss("bapo").reduction("ratio_min") == "min"
    with pytest.raises(KeyError, match="without a declared reduction"):
        registry.get_loss("ppo_clip").reduction("made_up")


def test_loss_uses_the_configured_aggregation():
    # Two sequences: [(A=+1, r=0.9), (A=+1, r=1.0)] and [(A=+1, r=1.1), pad].
    # token_mean: (0.9 + 1.0 + 1.1) / 3 = 1.0; seq_mean_token_mean: (0.95 + 1.1) / 2 = 1.025.
    logp = jnp.log(jnp.asarray([[0.9, 1.0], [1.1, 1.0]]))
    blogp = jnp.zeros_like(logp)
    adv = jnp.ones_like(logp)
    mask = jnp.asarray([[1.0, 1.0], [1.0, 0.0]])
    loss_fn = jax.jit(bapo.policy_loss, static_argnums=(4,))
    for mode, expected in [("token_mean", -1.0), ("seq_mean_token_mean", -1.025)]:
        loss, _ = loss_fn(logp, blogp, adv, mask, bapo.BAPOConfig(aggregation=mode))
        np.testing.assert_allclose(loss, expected, rtol=1e-6)


def test_kl_estimators_and_penalty():
    # x = ref - logp = -0.5: k1 = logp - ref = 0.5;
    # k3 = e^x - x - 1 = 0.606531 + 0.5 - 1 = 0.106531.
    logp = jnp.full((1, 2), -1.0)
    ref = jnp.full((1, 2), -1.5)
    np.testing.assert_allclose(losses.kl_to_reference(logp, ref, "k1"), 0.5, rtol=1e-6)
    np.testing.assert_allclose(
        losses.kl_to_reference(logp, ref, "k3"), math.exp(-0.5) - 0.5, rtol=1e-6
    )
    # Loss with kl_coef 0.1 on tokens whose ratio is 1 and A = 0: pg = 0, loss = 0.1 * KL.
    # d/dlogp: k1 -> 1, k3 -> 1 - e^x = 0.393469; per token / 2 tokens, times 0.1.
    adv = jnp.zeros((1, 2))
    mask = jnp.ones((1, 2))
    for estimator, value, slope in [("k1", 0.5, 1.0), ("k3", math.exp(-0.5) - 0.5, 0.393469)]:
        config = bapo.BAPOConfig(kl_coef=0.1, kl_estimator=estimator)

        def loss_fn(lp, config=config):
            # Behaviour log-probs follow logp so the ratio stays 1 (its gradient is A-weighted = 0).
            return bapo.policy_loss(lp, jax.lax.stop_gradient(lp), adv, mask, config, ref_logp=ref)

        (loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(logp)
        np.testing.assert_allclose(loss, 0.1 * value, rtol=1e-5)
        np.testing.assert_allclose(metrics["kl_ref"], value, rtol=1e-5)
        np.testing.assert_allclose(grad, jnp.full((1, 2), 0.1 * slope / 2), rtol=1e-5)
    with pytest.raises(ValueError, match="needs ref_logp"):
        bapo.policy_loss(logp, logp, adv, mask, bapo.BAPOConfig(kl_coef=0.1))


def test_entropy_bonus():
    # entropy (0.5, 1.0): mean 0.75; loss = pg - 0.01 * 0.75; d loss / d entropy = -0.01 / 2.
    logp, blogp, adv, mask = _batch([1.0, 1.0], [0.0, 0.0])
    entropy = jnp.asarray([[0.5, 1.0]])
    config = bapo.BAPOConfig(entropy_coef=0.01)

    def loss_fn(h):
        return bapo.policy_loss(logp, blogp, adv, mask, config, entropy=h)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(entropy)
    np.testing.assert_allclose([loss, metrics["entropy"]], [-0.0075, 0.75], rtol=1e-6)
    np.testing.assert_allclose(grad, jnp.full((1, 2), -0.005), rtol=1e-6)
    with pytest.raises(ValueError, match="needs entropy"):
        bapo.policy_loss(logp, blogp, adv, mask, config)


def test_truncated_is_weights():
    # old - behaviour = (0.5, -0.5, 2.0, 0.1): e^0.5 = 1.648721, e^-0.5 = 0.606531,
    # e^2 = 7.389 -> capped at 2; the 4th token is padding -> 0.
    old = jnp.full((1, 4), -1.0)
    behavior = jnp.asarray([[-1.5, -0.5, -3.0, -1.1]])
    mask = jnp.asarray([[1.0, 1.0, 1.0, 0.0]])
    weights = losses.truncated_is_weights(old, behavior, 2.0, mask)
    np.testing.assert_allclose(weights, [[math.exp(0.5), math.exp(-0.5), 2.0, 0.0]], rtol=1e-6)
    grad = jax.grad(lambda o: jnp.sum(losses.truncated_is_weights(o, behavior, 2.0)))(old)
    chex.assert_trees_all_close(grad, jnp.zeros_like(old))
    with pytest.raises(ValueError, match="cap must be > 0"):
        losses.truncated_is_weights(old, behavior, 0.0)


@pytest.mark.parametrize(
    "cls,fields,message",
    [
        (losses.PPOClipConfig, {"epsilon": 1.2}, "epsilon must be in (0, 1), got 1.2"),
        (losses.ClipHigherConfig, {"eps_high": 0.0}, "eps_high must be > 0, got 0.0"),
        (losses.ClipHigherConfig, {"eps_low": -0.1}, "eps_low must be in (0, 1), got -0.1"),
        (losses.PPOClipConfig, {"dual_clip": 1.0}, "dual_clip must be > 1.0, got 1.0"),
        (losses.PPOClipConfig, {"entropy_coef": -1.0}, "entropy_coef must be >= 0, got -1.0"),
    ],
)
def test_baseline_config_validation(cls, fields, message):
    with pytest.raises(ValueError) as error:
        cls(**fields)
    assert message in str(error.value)
