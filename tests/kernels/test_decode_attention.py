"""The CPU decode-attention kernel equals a float64 numpy transcription of masked softmax
attention with grouped KV heads (and XLA's version, `forward.cached_attention`), for cache
lengths that are and are not a multiple of 16, masked slots and one or several query heads per
KV head; results are bit-identical across calls; bad shapes and dtypes are refused by name."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.kernels import decode_attention
from bapo_jax.models.forward import cached_attention


def _inputs(b, kv, g, h, s, seed):
    rng = np.random.default_rng(seed)
    q = (rng.standard_normal((b, kv, g, h)) * 2.0).astype(np.float32)
    keys = rng.standard_normal((b, kv, h, s)).astype(np.float32)
    values = rng.standard_normal((b, kv, s, h)).astype(np.float32)
    valid = rng.random((b, s)) < 0.6
    valid[:, -1] = True  # the slot being written is always valid
    valid[0, :] = False
    valid[0, 0] = True  # a row with one valid slot: all weight on it
    return q, keys, values, valid


def _float64_attention(q, keys, values, valid):
    scores = np.einsum("bkgh,bkhs->bkgs", q.astype(np.float64), keys.astype(np.float64))
    scores = np.where(valid[:, None, None, :], scores, -np.inf)
    p = np.exp(scores - scores.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    return np.einsum("bkgs,bksh->bkgh", p, values.astype(np.float64))


@pytest.mark.parametrize("b, kv, g, h, s", [(16, 2, 4, 64, 96), (3, 4, 1, 16, 37), (2, 1, 2, 8, 5)])
def test_attention_equals_float64_numpy(b, kv, g, h, s):
    q, keys, values, valid = _inputs(b, kv, g, h, s, seed=b * 100 + s)
    run = jax.jit(decode_attention.decode_attention)
    out = run(q, keys, values, valid)
    chex.assert_shape(out, (b, kv, g, h))
    expected = _float64_attention(q, keys, values, valid)
    # fp32 sums of h and s terms and an exp within ~2e-7: a few e-6 of the value scale
    np.testing.assert_allclose(np.asarray(out, np.float64), expected, rtol=0, atol=1e-5)
    np.testing.assert_allclose(out[0], np.broadcast_to(values[0, :, None, 0], (kv, g, h)), atol=0)
    np.testing.assert_array_equal(run(q, keys, values, valid), out)  # same bits
    # XLA's formulation of the same step
    xla = cached_attention(jnp.asarray(q), keys, values, valid)
    np.testing.assert_allclose(out, xla, rtol=0, atol=1e-5)


def test_bad_inputs_are_refused_by_name():
    q, keys, values, valid = _inputs(2, 2, 2, 8, 5, seed=0)
    with pytest.raises(ValueError, match="takes fp32, got values bfloat16"):
        decode_attention.decode_attention(q, keys, jnp.asarray(values, jnp.bfloat16), valid)
    with pytest.raises(ValueError, match="valid must be bool, got int32"):
        decode_attention.decode_attention(q, keys, values, valid.astype(np.int32))
    with pytest.raises(ValueError, match=r"values has shape \(2, 2, 8, 5\), want \(2, 2, 5, 8\)"):
        decode_attention.decode_attention(q, keys, values.transpose(0, 1, 3, 2), valid)
    with pytest.raises(ValueError, match=r"want q \[B, K, G, H\]"):
        decode_attention.decode_attention(q[0], keys, values, valid)
