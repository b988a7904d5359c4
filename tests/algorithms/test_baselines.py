"""GSPO, CISPO and KL-Cov: hand-computed loss and gradient on small cases, a float64 numpy
transcription of each paper's objective on random batches (loss and gradient within 1e-5
relative), packed rows equal to padded ones, and their configs' refusals."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.algorithms import registry
from bapo_jax.algorithms.cispo import CISPOConfig, cispo
from bapo_jax.algorithms.gspo import GSPOConfig, gspo
from bapo_jax.algorithms.kl_cov import KLCovConfig, kl_cov


def _loss_and_grad(fn, config, logp, behavior, adv, mask, **kw):
    def loss(lp):
        return fn(lp, jnp.asarray(behavior), jnp.asarray(adv), jnp.asarray(mask), config, **kw)[0]

    value, grad = jax.value_and_grad(loss)(jnp.asarray(logp, jnp.float32))
    return float(value), np.asarray(grad, np.float64)


def test_gspo_by_hand():
    """Row 0: mean log-ratio 0.1, s = e^0.1 < 1.2, A = +1: J = s, gradient s / 3 a token.
    Row 1: mean -0.4, s = e^-0.4 < 0.8, A = -1: clipped, J = -0.8, no gradient."""
    logp = np.array([[-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0]], np.float32)
    delta = np.array([[0.3, -0.1, 0.1], [-0.5, -0.3, 0.0]], np.float32)
    mask = np.array([[1, 1, 1], [1, 1, 0]], np.float32)
    adv = np.array([[1, 1, 1], [-1, -1, 0]], np.float32)
    config = GSPOConfig(eps_low=0.2, eps_high=0.2)
    value, grad = _loss_and_grad(gspo, config, logp, logp - delta, adv, mask)
    s0 = np.exp(0.1)
    assert value == pytest.approx(-(s0 - 0.8) / 2, rel=1e-6)
    np.testing.assert_allclose(grad[0], [-s0 / 6] * 3, rtol=1e-6)
    np.testing.assert_allclose(grad[1], 0.0, atol=1e-9)


def test_cispo_by_hand():
    """Weights min(r, 1.28): 1.28, 0.5, 1.1; J = w A log pi; token mean over 3."""
    logp = np.array([[-1.0, -2.0, -0.5]], np.float32)
    ratio = np.array([[1.5, 0.5, 1.1]], np.float32)
    adv = np.array([[1.0, -1.0, 1.0]], np.float32)
    mask = np.ones_like(logp)
    value, grad = _loss_and_grad(cispo, CISPOConfig(), logp, logp - np.log(ratio), adv, mask)
    w = np.array([1.28, 0.5, 1.1])
    assert value == pytest.approx(-(w * adv[0] * logp[0]).sum() / 3, rel=1e-6)
    np.testing.assert_allclose(grad[0], -(w * adv[0]) / 3, rtol=1e-6)
    # a lower bound, when set, lifts the 0.5 weight to 0.8
    _, grad = _loss_and_grad(cispo, CISPOConfig(eps_low=0.2), logp, logp - np.log(ratio), adv, mask)
    np.testing.assert_allclose(grad[0], -np.array([1.28, -0.8, 1.1]) / 3, rtol=1e-6)


def _batch(rng, b=6, t=12):
    logp = rng.uniform(-4, -0.05, (b, t))
    behavior = logp - rng.normal(0, 0.3, (b, t))
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float64)
    adv = np.repeat(rng.normal(0, 1, (b, 1)), t, axis=1) * mask
    return logp, behavior, adv, mask


def _gspo_numpy(logp, behavior, adv, mask, eps_low, eps_high):
    """The paper's objective per sequence and its gradient, float64."""
    n = mask.sum(1)
    s = np.exp(((logp - behavior) * mask).sum(1) / n)  # [B]
    a = adv[:, 0]
    clipped = np.where(a > 0, np.minimum(s, 1 + eps_high), np.maximum(s, 1 - eps_low))
    live = np.where(a > 0, s < 1 + eps_high, s > 1 - eps_low) & (a != 0)
    loss = -np.mean(a * clipped)
    grad = -(np.where(live, a * s / n, 0.0) / len(n))[:, None] * mask
    return loss, grad


def _cispo_numpy(logp, behavior, adv, mask, eps_high):
    w = np.minimum(np.exp(logp - behavior), 1 + eps_high)
    loss = -(w * adv * logp * mask).sum() / mask.sum()
    return loss, -(w * adv * mask) / mask.sum()


def test_kl_cov_by_hand():
    """4 tokens, k 0.25: one penalised. log pi = -1, -2, -0.5, -3 (mean -1.625), A = 1, -1, 1,
    -1 (mean 0): Cov = 0.625, 0.375, 1.125, 1.375 -> the last; log r = 0.2 there: J = r A -
    |0.2|, its gradient r A - 1 (sign +); the others r A."""
    logp = np.array([[-1.0, -2.0, -0.5, -3.0]], np.float32)
    log_r = np.array([[0.1, -0.1, 0.0, 0.2]], np.float32)
    adv = np.array([[1.0, -1.0, 1.0, -1.0]], np.float32)
    mask = np.ones_like(logp)
    config = KLCovConfig(k_ratio=0.25)
    value, grad = _loss_and_grad(kl_cov, config, logp, logp - log_r, adv, mask)
    r = np.exp(log_r[0].astype(np.float64))
    j = r * adv[0] - np.array([0, 0, 0, 0.2])
    assert value == pytest.approx(-j.sum() / 4, rel=1e-6)
    np.testing.assert_allclose(grad[0], -(r * adv[0] - np.array([0, 0, 0, 1.0])) / 4, rtol=1e-6)
    _, metrics = kl_cov(*(jnp.asarray(x) for x in (logp, logp - log_r, adv, mask)), config)
    assert float(metrics["cov_selected_frac"]) == 0.25


def _kl_cov_numpy(logp, behavior, adv, mask, k_ratio, beta):
    valid = mask > 0
    n = valid.sum()
    cov = (logp - logp[valid].mean()) * (adv - adv[valid].mean())
    order = np.argsort(-np.where(valid, cov, -np.inf).reshape(-1), kind="stable")
    chosen = np.zeros(logp.size, bool)
    chosen[order[: max(1, int(np.floor(k_ratio * n)))]] = True
    chosen = chosen.reshape(logp.shape) & valid
    r = np.exp(logp - behavior)
    d = logp - behavior
    j = r * adv - beta * np.where(chosen, np.abs(d), 0.0)
    loss = -(j * mask).sum() / n
    grad = -(r * adv - beta * np.where(chosen, np.sign(d), 0.0)) * mask / n
    return loss, grad


@pytest.mark.parametrize("seed", range(5))
def test_against_numpy_on_random_batches(seed):
    rng = np.random.default_rng(seed)
    logp, behavior, adv, mask = _batch(rng)
    f32 = [x.astype(np.float32) for x in (logp, behavior, adv, mask)]
    for eps in (0.2, 3e-4):  # a wide range (most live) and GSPO's own (most clipped)
        value, grad = _loss_and_grad(gspo, GSPOConfig(eps_low=eps, eps_high=eps), *f32)
        want, want_grad = _gspo_numpy(logp, behavior, adv, mask, eps, eps)
        assert value == pytest.approx(want, rel=1e-5, abs=1e-7)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    value, grad = _loss_and_grad(cispo, CISPOConfig(eps_high=0.28), *f32)
    want, want_grad = _cispo_numpy(logp, behavior, adv, mask, 0.28)
    assert value == pytest.approx(want, rel=1e-5)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    for k_ratio in (2e-3, 0.1):  # the paper's (one token here) and a tenth of them
        value, grad = _loss_and_grad(kl_cov, KLCovConfig(k_ratio=k_ratio, beta=0.5), *f32)
        # the numpy side in float64 from the float32 inputs: the same covariance ranking
        want, want_grad = _kl_cov_numpy(*(x.astype(np.float64) for x in f32), k_ratio, 0.5)
        assert value == pytest.approx(want, rel=1e-5)
        np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


def test_gspo_packed_rows_equal_padded_ones():
    rng = np.random.default_rng(7)
    logp, behavior, adv, mask = (x.astype(np.float32) for x in _batch(rng, b=2, t=6))
    mask[:] = 1.0
    config = GSPOConfig(eps_low=0.2, eps_high=0.2)
    padded, g_padded = _loss_and_grad(gspo, config, logp, behavior, adv, mask)
    packed = [x.reshape(1, 12) for x in (logp, behavior, adv, mask)]
    segments = jnp.asarray(np.repeat([[1, 2]], 6, axis=1))
    value, grad = _loss_and_grad(gspo, config, *packed, segment_ids=segments, num_sequences=2.0)
    assert value == pytest.approx(padded, rel=1e-6)
    np.testing.assert_allclose(grad.reshape(2, 6), g_padded, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize(
    ("name", "fields", "message"),
    [
        ("gspo", {"eps_low": 1.5}, "eps_low"),
        ("gspo", {"eps_high": -1.0}, "eps_high"),
        ("cispo", {"eps_high": 0.0}, "eps_high"),
        ("cispo", {"eps_low": 1.0}, "eps_low"),
        ("kl_cov", {"k_ratio": 0.0}, "k_ratio"),
        ("kl_cov", {"beta": -1.0}, "beta"),
    ],
)
def test_configs_refuse_bad_ranges_naming_the_field(name, fields, message):
    with pytest.raises(ValueError, match=message):
        registry.make_loss_config(name, **fields)
