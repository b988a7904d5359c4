"""The CPU decode kernel: x @ W from W's column panels equals a float64 numpy product, for
row counts below, at and above one 16-row tile, widths that are not a multiple of 16 and
enough panels to be shared between threads; so does the fused residual + rms_norm(x) @ W;
results are bit-identical across calls; bad shapes and dtypes are refused by name."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.kernels import panel_matmul
from bapo_jax.models import layers as L


def test_pack_lays_out_column_panels_and_unpack_inverts_it():
    w = jnp.arange(3 * 20, dtype=jnp.float32).reshape(3, 20)  # K = 3, N = 20 -> 2 panels
    panels = panel_matmul.pack(w)
    chex.assert_shape(panels, (2, 3, 16))
    np.testing.assert_array_equal(panels[1, 2, :4], w[2, 16:20])  # panels[p, k, j] = W[k, 16p+j]
    np.testing.assert_array_equal(panels[1, :, 4:], 0.0)  # zero past N
    np.testing.assert_array_equal(panel_matmul.unpack(panels, 20), w)


@pytest.mark.parametrize(
    "m, k, n",
    [
        (1, 1, 1),
        (5, 33, 40),
        (16, 64, 48),
        (17, 40, 17),
        (40, 128, 100),
        (512, 96, 80),
        (16, 64, 1000),
    ],
)
def test_product_equals_float64_numpy(m, k, n):
    rng = np.random.default_rng(m * 1000 + n)
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    run = jax.jit(lambda x, p: panel_matmul.panel_matmul(x, p, n))
    y = run(x, panel_matmul.pack(jnp.asarray(w)))
    chex.assert_shape(y, (m, n))
    expected = x.astype(np.float64) @ w.astype(np.float64)
    # one fp32 sum of k products per element: error <= k * eps * sum |x_i w_i|
    bound = k * np.finfo(np.float32).eps * (np.abs(x) @ np.abs(w)) + 1e-30
    assert np.all(np.abs(np.asarray(y, np.float64) - expected) <= bound)
    np.testing.assert_array_equal(run(x, panel_matmul.pack(jnp.asarray(w))), y)  # same bits


@pytest.mark.parametrize("m, k, n", [(1, 40, 24), (16, 512, 100), (19, 37, 33)])
def test_fused_norm_and_residual_equal_float64_numpy(m, k, n):
    """y = residual + (scale * x / sqrt(mean(x^2) + eps)) @ W, the norm being HF's Qwen2RMSNorm
    (`layers.rms_norm`); k = 37 and 40 leave a tail after the 16-lane sum of squares."""
    rng = np.random.default_rng(k * 100 + m)
    x = (rng.standard_normal((m, k)) * 3.0).astype(np.float32)
    w = rng.standard_normal((k, n)).astype(np.float32)
    scale = rng.uniform(0.5, 1.5, k).astype(np.float32)
    residual = rng.standard_normal((m, n)).astype(np.float32)
    eps = 1e-6
    run = jax.jit(
        lambda x, p, g, r: panel_matmul.panel_matmul(x, p, n, scale=g, eps=eps, residual=r)
    )
    y = np.asarray(run(x, panel_matmul.pack(jnp.asarray(w)), scale, residual), np.float64)
    x64 = x.astype(np.float64)
    normed = scale * x64 / np.sqrt(np.mean(x64**2, axis=-1, keepdims=True) + eps)  # [M, K]
    expected = residual + normed @ w
    # the normed row carries a few roundings, the sum k, the residual add one more
    eps32 = np.finfo(np.float32).eps
    bound = (k + 8) * eps32 * (np.abs(normed) @ np.abs(w)) + eps32 * np.abs(expected) + 1e-30
    assert np.all(np.abs(y - expected) <= bound)
    # without the fusion: rms_norm in XLA, then the product, then the add
    separate = residual + panel_matmul.panel_matmul(
        L.rms_norm(jnp.asarray(x), jnp.asarray(scale), eps), panel_matmul.pack(jnp.asarray(w)), n
    )
    np.testing.assert_allclose(y, separate, rtol=1e-5, atol=1e-5 * float(np.abs(expected).max()))


def test_bad_inputs_are_refused_by_name():
    x = jnp.ones((4, 8), jnp.float32)
    panels = panel_matmul.pack(jnp.ones((8, 20), jnp.float32))
    with pytest.raises(ValueError, match="takes fp32, got x bfloat16"):
        panel_matmul.panel_matmul(x.astype(jnp.bfloat16), panels, 20)
    with pytest.raises(ValueError, match=r"panels \(2, 8, 16\) do not hold a \[8, 40\] matrix"):
        panel_matmul.panel_matmul(x, panels, 40)
    with pytest.raises(ValueError, match=r"do not hold a \[9, 20\] matrix"):
        panel_matmul.panel_matmul(jnp.ones((4, 9), jnp.float32), panels, 20)
    with pytest.raises(ValueError, match=r"scale has shape \(9,\), want \(8,\)"):
        panel_matmul.panel_matmul(x, panels, 20, scale=jnp.ones(9, jnp.float32))
    with pytest.raises(ValueError, match=r"residual has shape \(4, 16\), want \(4, 20\)"):
        panel_matmul.panel_matmul(x, panels, 20, residual=jnp.ones((4, 16), jnp.float32))
    with pytest.raises(ValueError, match="takes fp32, got residual bfloat16"):
        panel_matmul.panel_matmul(x, panels, 20, residual=jnp.ones((4, 20), jnp.bfloat16))
