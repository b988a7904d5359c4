"""The CPU decode kernel: x @ W from W's column panels equals a float64 numpy product, for
row counts below, at and above one 16-row tile and widths that are not a multiple of 16;
results are bit-identical across calls; bad shapes and dtypes are refused by name."""

import shutil
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.kernels import panel_matmul


@pytest.fixture(scope="module", autouse=True)
def kernel():
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler to build the kernel")
    assert sys.platform.startswith("linux")
    assert panel_matmul.available(), "the kernel should build wherever a C++ compiler exists"


def test_pack_lays_out_column_panels_and_unpack_inverts_it():
    w = jnp.arange(3 * 20, dtype=jnp.float32).reshape(3, 20)  # K = 3, N = 20 -> 2 panels
    panels = panel_matmul.pack(w)
    chex.assert_shape(panels, (2, 3, 16))
    np.testing.assert_array_equal(panels[1, 2, :4], w[2, 16:20])  # panels[p, k, j] = W[k, 16p+j]
    np.testing.assert_array_equal(panels[1, :, 4:], 0.0)  # zero past N
    np.testing.assert_array_equal(panel_matmul.unpack(panels, 20), w)


@pytest.mark.parametrize(
    "m, k, n", [(1, 1, 1), (5, 33, 40), (16, 64, 48), (17, 40, 17), (40, 128, 100), (512, 96, 80)]
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


def test_bad_inputs_are_refused_by_name():
    x = jnp.ones((4, 8), jnp.float32)
    panels = panel_matmul.pack(jnp.ones((8, 20), jnp.float32))
    with pytest.raises(ValueError, match="takes fp32, got x bfloat16"):
        panel_matmul.panel_matmul(x.astype(jnp.bfloat16), panels, 20)
    with pytest.raises(ValueError, match=r"panels \(2, 8, 16\) do not hold a \[8, 40\] matrix"):
        panel_matmul.panel_matmul(x, panels, 40)
    with pytest.raises(ValueError, match=r"do not hold a \[9, 20\] matrix"):
        panel_matmul.panel_matmul(jnp.ones((4, 9), jnp.float32), panels, 20)
