"""Incremental decoding with a KV cache: prefill a left-padded prompt batch, then one token at
a time. Used by the embedded sampler (`bapo_jax.rollout.embedded`).

Cache layout: k, v [L, B, S, K, H] in the compute dtype, S = cache length (prompt + new tokens),
slot s of row b holds the key/value of the token written at step s. Prompts are left-padded to
a common length P, so every row writes slot P + i at decode step i and one `dynamic_update_slice`
serves the whole batch. `key_valid` [B, S] marks the slots holding real tokens (padding slots
stay False forever); a query sees valid slots up to and including its own.
Positions follow the HF convention of the forward pass (`cumsum(mask) - 1`), so the cached
computation equals `model(...)` on the full sequence.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from bapo_jax.models import layers as L
from bapo_jax.models.qwen2 import Qwen2ForCausalLM


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k, v: [L, B, S, K, H]; key_valid: [B, S]; length: slots written so far (scalar)."""

    k: Float[Array, "L B S K H"]
    v: Float[Array, "L B S K H"]
    key_valid: Bool[Array, "B S"]
    length: Int[Array, ""]


def _cached_layer(p, x, cos, sin, mask, k_cache, v_cache, index, *, eps):
    """`layers.decoder_layer` with K/V written into and read from the cache at `index`."""
    q, k, v = L.attention_inputs(p, x, cos, sin, eps)  # [B, T, N, H], [B, T, K, H] x 2
    k_cache = jax.lax.dynamic_update_slice_in_dim(k_cache, k.astype(k_cache.dtype), index, 1)
    v_cache = jax.lax.dynamic_update_slice_in_dim(v_cache, v.astype(v_cache.dtype), index, 1)
    x = L.attention_output(p, x, L.attention(q, k_cache, v_cache, mask))  # [B, T, D]
    return L.mlp_block(p, x, eps), k_cache, v_cache


def _run_cached(model: Qwen2ForCausalLM, ids, positions, cache: KVCache, query_valid):
    """Runs `ids` [B, T] at slots [cache.length, cache.length + T); returns hidden + cache."""
    c, o = model.config, model.options
    t = ids.shape[1]
    index = cache.length
    key_valid = jax.lax.dynamic_update_slice_in_dim(cache.key_valid, query_valid, index, 1)
    slots = jnp.arange(cache.k.shape[2])  # [S]
    causal = slots[None, :] <= (index + jnp.arange(t))[:, None]  # [T, S]
    mask = causal[None] & key_valid[:, None, :]  # [B, T, S]
    x = jnp.take(model.embed_tokens[...], ids, axis=0).astype(o.compute_dtype)  # [B, T, D]
    cos, sin = L.rope_cos_sin(positions, c.head_dim, c.rope_theta)  # [B, T, H/2]

    def body(x, layer):
        p, k_cache, v_cache = layer
        x, k_cache, v_cache = _cached_layer(
            p, x, cos, sin, mask, k_cache, v_cache, index, eps=c.rms_norm_eps
        )
        return x, (k_cache, v_cache)

    params = model.layers.stacked(o.compute_dtype)
    x, (k, v) = jax.lax.scan(body, x, (params, cache.k, cache.v))
    hidden = L.rms_norm(x, model.norm[...], c.rms_norm_eps)  # [B, T, D]
    return hidden, KVCache(k, v, key_valid, index + t)


def _logits(model: Qwen2ForCausalLM, hidden: Float[Array, "B D"]) -> Float[Array, "B V"]:
    w = model.unembedding().astype(hidden.dtype)  # [V, D]
    return jnp.einsum("bd,vd->bv", hidden, w, preferred_element_type=jnp.float32)


def init_cache(model: Qwen2ForCausalLM, batch: int, length: int) -> KVCache:
    c = model.config
    shape = (c.num_hidden_layers, batch, length, c.num_key_value_heads, c.head_dim)
    zeros = jnp.zeros(shape, model.options.compute_dtype)
    return KVCache(zeros, zeros, jnp.zeros((batch, length), jnp.bool_), jnp.zeros((), jnp.int32))


def prefill(
    model: Qwen2ForCausalLM,
    input_ids: Int[Array, "B P"],
    attention_mask: Int[Array, "B P"],
    cache_length: int,
) -> tuple[Float[Array, "B V"], Int[Array, " B"], KVCache]:
    """Fills a fresh cache with the left-padded prompts.

    Returns the fp32 logits of the next token [B, V], the next position of each row [B] and the
    cache (length P).
    """
    chex.assert_rank([input_ids, attention_mask], 2)
    chex.assert_equal_shape([input_ids, attention_mask])
    b, p = input_ids.shape
    if cache_length < p:
        raise ValueError(f"cache_length={cache_length} must be >= the prompt length {p}")
    positions = L.positions_from_mask(attention_mask)  # [B, P]
    cache = init_cache(model, b, cache_length)
    hidden, cache = _run_cached(model, input_ids, positions, cache, attention_mask > 0)
    next_position = jnp.sum(attention_mask, axis=-1).astype(jnp.int32)  # [B]
    return _logits(model, hidden[:, -1]), next_position, cache


def decode_step(
    model: Qwen2ForCausalLM,
    tokens: Int[Array, " B"],
    positions: Int[Array, " B"],
    cache: KVCache,
) -> tuple[Float[Array, "B V"], KVCache]:
    """Feeds one token per row at slot `cache.length`; returns next-token logits [B, V]."""
    chex.assert_rank([tokens, positions], 1)
    valid = jnp.ones((tokens.shape[0], 1), jnp.bool_)
    hidden, cache = _run_cached(model, tokens[:, None], positions[:, None], cache, valid)
    return _logits(model, hidden[:, 0]), cache
