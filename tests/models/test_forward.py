"""The one forward: the cached path (decode layout, unrolled layers) equals the uncached one
(stacked layers, scanned) on the same tokens, and a layout that does not fit the path is
refused by name."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.models import decode, init_model
from bapo_jax.models import layers as L
from bapo_jax.models.config import Qwen2Config
from bapo_jax.models.forward import forward, init_cache


@pytest.fixture(scope="module")
def model():
    return init_model(Qwen2Config.preset("tiny"), seed=1)


def test_cached_prefill_equals_the_uncached_residual_stream(model):
    """A left-padded batch through both paths: the residual streams agree on real tokens."""
    c = model.config
    ids = jnp.asarray([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]], jnp.int32)
    segments = jnp.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], jnp.int32)
    positions = L.positions(segments)
    stacked = model.layers.stacked(jnp.float32)
    embed = model.embed_tokens.get_value()
    run = jax.jit(functools.partial(forward, config=c))  # compiled: faster than op by op
    uncached, none = run(stacked, embed, ids, segments, positions)
    assert none is None
    weights = decode.decode_weights(model)
    cache = init_cache(c, 2, 8, jnp.float32)
    cached, cache = jax.jit(forward, static_argnames=("config", "projections"))(
        weights.layers,
        weights.embed,
        ids,
        segments,
        positions,
        config=c,
        cache=cache,
        projections=decode.FusedProjections(weights.ops, c),
    )
    real = np.asarray(segments) > 0
    np.testing.assert_allclose(np.asarray(cached)[real], np.asarray(uncached)[real], atol=1e-5)
    assert int(cache.length) == 6
    np.testing.assert_array_equal(cache.key_valid[:, :6], real)
    assert not np.asarray(cache.key_valid[:, 6:]).any()


def test_a_layout_that_does_not_fit_the_path_is_refused(model):
    c = model.config
    ids = jnp.ones((1, 3), jnp.int32)
    weights = decode.decode_weights(model)
    with pytest.raises(ValueError, match="got tuple with cache=None"):
        forward(weights.layers, weights.embed, ids, ids, ids, config=c)
    stacked = model.layers.stacked(jnp.float32)
    cache = init_cache(c, 1, 4, jnp.float32)
    with pytest.raises(ValueError, match="got dict with cache=a KVCache"):
        forward(stacked, weights.embed, ids, ids, ids, config=c, cache=cache)


def test_a_compiled_forward_names_its_blocks(model):
    """The decoder's blocks are named scopes: a profile of the compiled program reads them."""
    from flax import nnx

    graphdef, state = nnx.split(model)
    ids = jnp.ones((1, 8), jnp.int32)
    hlo = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, ids).compile().as_text()
    for scope in ("attention/qkv", "attention/core", "attention/output", "/mlp"):
        assert scope in hlo, scope
