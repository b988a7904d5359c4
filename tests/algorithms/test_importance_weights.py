"""The rollout correction's weights (`losses.importance_weights`): truncation as before, token
and sequence masks by hand and against numpy (packed rows included), the masked share in the
loss metrics, and the refusals (a band without 1 inside; a mask without a recomputed pi_old)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.algorithms import losses
from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.algorithms.losses import PPOClipConfig
from bapo_jax.train.config import AlgorithmConfig


def _weights(log_w, mask, **fields):
    log_w, mask = np.asarray(log_w, np.float32), np.asarray(mask, np.float32)
    out = losses.importance_weights(
        jnp.asarray(log_w), jnp.zeros(log_w.shape), jnp.asarray(mask), PPOClipConfig(**fields)
    )
    return np.asarray(out)


def test_masks_by_hand():
    """w = 0.4, 1.0, 2.5 | 1.2, 0.9 (pad): token mask (0.5, 2) keeps 1.0 and 1.2, 0.9;
    sequence mask: g_0 = (0.4 x 1 x 2.5)^(1/3) = 1 kept (each token g_0 = 1), g_1 =
    (1.2 x 0.9)^(1/2) = 1.039 kept; with band (0.5, 1.02) sequence 1 is masked."""
    log_w = np.log([[0.4, 1.0, 2.5], [1.2, 0.9, 7.0]])
    mask = [[1, 1, 1], [1, 1, 0]]
    np.testing.assert_allclose(
        _weights(log_w, mask, is_mode="token_mask"), [[0, 1, 0], [1.2, 0.9, 0]], rtol=1e-6
    )
    g1 = np.sqrt(1.2 * 0.9)
    np.testing.assert_allclose(
        _weights(log_w, mask, is_mode="sequence_mask"), [[1, 1, 1], [g1, g1, 0]], rtol=1e-6
    )
    np.testing.assert_allclose(
        _weights(log_w, mask, is_mode="sequence_mask", is_band=(0.5, 1.02)),
        [[1, 1, 1], [0, 0, 0]],
        rtol=1e-6,
    )
    # truncation is unchanged: min(w, cap), 0 on padding
    np.testing.assert_allclose(
        _weights(log_w, mask, is_cap=2.0), [[0.4, 1, 2], [1.2, 0.9, 0]], rtol=1e-6
    )


@pytest.mark.parametrize("seed", range(3))
def test_against_numpy_with_packed_rows(seed):
    rng = np.random.default_rng(seed)
    log_w = rng.normal(0, 0.6, (3, 10)).astype(np.float32)
    segment_ids = np.array([[1] * 4 + [2] * 6, [1] * 10, [1] * 7 + [0] * 3])
    mask = (segment_ids > 0).astype(np.float32)
    low, high = 0.6, 1.7
    config = PPOClipConfig(is_mode="sequence_mask", is_band=(low, high))
    got = np.asarray(
        losses.importance_weights(
            jnp.asarray(log_w), jnp.zeros((3, 10)), jnp.asarray(mask), config,
            jnp.asarray(segment_ids),
        )
    )  # fmt: skip
    want = np.zeros((3, 10))
    for b in range(3):
        for seg in set(segment_ids[b]) - {0}:
            idx = segment_ids[b] == seg
            g = np.exp(np.mean(log_w[b, idx].astype(np.float64)))
            want[b, idx] = g if low <= g <= high else 0.0
    np.testing.assert_allclose(got, want, rtol=1e-5)
    token = _weights(log_w, mask, is_mode="token_mask", is_band=(low, high))
    w = np.exp(log_w.astype(np.float64))
    np.testing.assert_allclose(
        token, np.where((w >= low) & (w <= high) & (mask > 0), w, 0), rtol=1e-5
    )


def test_the_masked_share_is_a_loss_metric():
    logp = jnp.full((1, 4), -1.0)
    is_weights = jnp.asarray([[0.0, 1.1, 0.0, 0.9]])
    _, metrics = losses.ppo_clip(
        logp, logp, jnp.ones((1, 4)), jnp.ones((1, 4)), PPOClipConfig(), is_weights=is_weights
    )
    assert float(metrics["is_masked_frac"]) == 0.5


def test_refusals_name_the_field():
    with pytest.raises(ValueError, match=r"is_band must be \(low, high\) with 0 < low < 1 < high"):
        PPOClipConfig(is_band=(1.1, 2.0))
    with pytest.raises(ValueError, match="is_mode must be one of"):
        PPOClipConfig(is_mode="clip")
    with pytest.raises(
        ValueError, match=r'bapo\.is_mode must be used with ratio_base="recomputed"'
    ):
        AlgorithmConfig(bapo=BAPOConfig(is_mode="token_mask"))
    ok = AlgorithmConfig(bapo=BAPOConfig(is_mode="sequence_mask"), ratio_base="recomputed")
    assert ok.loss_config.is_band == (0.5, 2.0)
