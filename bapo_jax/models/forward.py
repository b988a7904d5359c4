"""The decoder's one forward pass, with an optional KV cache.

``forward(layers, embed, tokens, segment_ids, positions, cache=...)`` embeds the tokens, runs
`layers.decoder_layer` over every layer and returns the residual stream after the last layer
(before the final norm) and the updated cache. Training and the log-prob passes
(`Qwen2ForCausalLM.hidden_states`) and the embedded sampler (`decode.prefill`,
`decode.decode_step`) all run it; what they pass differs:

* No cache (training, log-probs): the parameters stacked on a leading "layers" axis in the
  separate q/k/v, gate/up layout (`layers.SEPARATE`), run by ``jax.lax.scan`` so compile time
  does not grow with depth, under the model's remat policy and attention implementation; the
  residual stream is constrained by logical axes (a no-op without a mesh).
* A cache (sampling): one dict per layer in the decode layout (`decode.DecodeWeights`: fused
  matrices multiplied by the linear the caller injects). The layers are unrolled, so each
  layer's cache is a separate buffer updated in place (scanning a stacked cache would copy it
  every step, and slicing stacked weights copies them). Tokens go to slots
  ``[cache.length, cache.length + T)``. T > 1 is a prefill and needs an empty cache: the
  tokens attend over their own keys (causal within segments), not over the cache's slots.
  T = 1 is a decode step: the token's query attends over every valid slot, its own included.

Positions are those of the HF forward (`layers.positions`), so the cached computation equals
the uncached one on the whole sequence (tested to float rounding).

Cache layout: per layer keys k [B, K, H, S] and values v [B, K, S, H], S = cache slots, so both
attention dots of a decode step contract over the rows of their cache operand (q [G, H] @
k [H, S], probs [G, S] @ v [S, H]); contracting [B, K, S, H] keys over their minor dim made
XLA's CPU score dot several times slower (docs/rollout.md). ``key_valid`` [B, S] marks slots
that hold real tokens; every valid slot is at or before a decode step's query, so it alone is
the mask.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from bapo_jax.models import attention as A
from bapo_jax.models import layers as L
from bapo_jax.models.config import ModelOptions, Qwen2Config
from bapo_jax.sharding.rules import constrain

__all__ = [
    "RESIDUAL_AXES",
    "CachedAttention",
    "KVCache",
    "cached_attention",
    "forward",
    "grow_cache",
    "init_cache",
]

# Logical axes of the residual stream [B, T, D] (activations, not parameters).
RESIDUAL_AXES = ("batch", "length", "act_embed")

# (q [B, K, G, H] scaled by 1/sqrt(H), keys [B, K, H, S], values [B, K, S, H], valid [B, S])
#   -> [B, K, G, H]: one query per row against the cache.
CachedAttention = Callable[[Array, Array, Array, Array], Array]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """k: per layer [B, K, H, S]; v: per layer [B, K, S, H]; key_valid: [B, S]; length: slots
    written so far (scalar)."""

    k: tuple[Float[Array, "B K H S"], ...]
    v: tuple[Float[Array, "B K S H"], ...]
    key_valid: Bool[Array, "B S"]
    length: Int[Array, ""]

    @property
    def slots(self) -> int:
        return self.key_valid.shape[1]


def init_cache(config: Qwen2Config, batch: int, slots: int, dtype) -> KVCache:
    """An empty cache of `slots` slots per row."""
    kv, h, layers = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    k = tuple(jnp.zeros((batch, kv, h, slots), dtype) for _ in range(layers))  # [B, K, H, S]
    v = tuple(jnp.zeros((batch, kv, slots, h), dtype) for _ in range(layers))  # [B, K, S, H]
    return KVCache(k, v, jnp.zeros((batch, slots), jnp.bool_), jnp.zeros((), jnp.int32))


def grow_cache(cache: KVCache, slots: int) -> KVCache:
    """The same cache with S padded to `slots` (new slots invalid)."""
    extra = slots - cache.slots
    if extra < 0:
        raise ValueError(f"grow_cache slots={slots} is fewer than the cache's {cache.slots}")
    pad_k = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, extra)))
    pad_v = lambda x: jnp.pad(x, ((0, 0), (0, 0), (0, extra), (0, 0)))
    return KVCache(
        tuple(map(pad_k, cache.k)),
        tuple(map(pad_v, cache.v)),
        jnp.pad(cache.key_valid, ((0, 0), (0, extra))),
        cache.length,
    )


def cached_attention(
    q: Float[Array, "B K G H"],
    keys: Float[Array, "B K H S"],
    values: Float[Array, "B K S H"],
    valid: Bool[Array, "B S"],
) -> Float[Array, "B K G H"]:
    """XLA's decode-step attention, grouped KV heads never repeated (q pre-scaled):

    s[b,k,g,t] = q[b,k,g] . K[b,k,t]   (fp32, most negative fp32 where slot t is invalid)
    out[b,k,g] = sum_t softmax_t(s)[b,k,g,t] V[b,k,t]
    """
    scores = jnp.einsum(
        "bkgh,bkhs->bkgs", q, keys, preferred_element_type=jnp.float32
    )  # [B, K, G, S] fp32
    scores = jnp.where(valid[:, None, None, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)  # [B, K, G, S]
    return jnp.einsum("bkgs,bksh->bkgh", probs, values)  # [B, K, G, H]


def _remat(fn, policy: str):
    if policy == "none":
        return fn
    if policy == "full":
        return jax.checkpoint(fn)
    return jax.checkpoint(fn, policy=getattr(jax.checkpoint_policies, policy))


def _scan_layers(
    stacked: Mapping[str, Array],
    x: Float[Array, "B T D"],
    cos: Array,
    sin: Array,
    segment_ids: Int[Array, "B T"],
    config: Qwen2Config,
    options: ModelOptions,
    projections: L.Projections,
) -> Float[Array, "B T D"]:
    """``decoder_layer`` scanned over the leading "layers" axis of the stacked parameters."""
    core = A.self_attention(
        segment_ids,
        options.attention,
        block_q=options.attention_block_q,
        block_kv=options.attention_block_kv,
    )
    attend = lambda q, k, v: (core(q, k, v), None)

    def body(carry, p):
        x, _ = L.decoder_layer(
            p, carry, cos, sin, attend, eps=config.rms_norm_eps, projections=projections
        )
        # Keep the residual stream split by batch under a mesh (logical names only here).
        return constrain(x, RESIDUAL_AXES), None

    x, _ = jax.lax.scan(_remat(body, options.remat), x, stacked, unroll=options.scan_unroll)
    return x


def _cache_attend(
    k_cache: Array,
    v_cache: Array,
    index: Int[Array, ""],
    key_valid: Bool[Array, "B S"],
    prefill: A.AttentionCore | None,
    attention: CachedAttention,
):
    """The attention core of one cached layer: writes the tokens' keys/values at slots
    [index, index + T), then attends: with ``prefill`` (T > 1) over the tokens' own keys, else
    (T = 1) over the cache. Returns ``(q, k, v) -> (out [B, T, N, H], (keys, values))``."""

    def attend(q, k, v):
        # keys [B, T, K, H] -> [B, K, H, T], values -> [B, K, T, H]
        keys = jax.lax.dynamic_update_slice_in_dim(k_cache, k.transpose(0, 2, 3, 1), index, 3)
        values = jax.lax.dynamic_update_slice_in_dim(v_cache, v.transpose(0, 2, 1, 3), index, 2)
        if prefill is not None:
            return prefill(q, k, v), (keys, values)
        b, _, n, h = q.shape
        kv = k.shape[2]
        qg = q.reshape(b, kv, n // kv, h) * jnp.asarray(h**-0.5, q.dtype)  # [B, K, G, H]
        out = attention(qg, keys, values, key_valid)  # [B, K, G, H]
        return out.reshape(b, 1, n, h), (keys, values)

    return attend


def forward(
    layers: Mapping[str, Array] | Sequence[Mapping[str, Array]],
    embed: Float[Array, "V D"],
    tokens: Int[Array, "B T"],
    segment_ids: Int[Array, "B T"],
    positions: Int[Array, "B T"],
    *,
    config: Qwen2Config,
    options: ModelOptions | None = None,
    cache: KVCache | None = None,
    projections: L.Projections = L.SEPARATE,
    attention: CachedAttention = cached_attention,
) -> tuple[Float[Array, "B T D"], KVCache | None]:
    """The residual stream after the last layer [B, T, D] (final norm not applied) and the cache.

    layers: without a cache, the stacked parameters ([L, ...] each, compute dtype); with one,
      a sequence of per-layer dicts in the layout ``projections`` reads.
    embed: the [V, D] embedding (rows cast to ``options.compute_dtype`` after the lookup when
      there is no cache; with one, already in the compute dtype).
    segment_ids: 1, 2, ... per sequence, 0 for padding (a padded batch passes its 0/1 mask).
    positions: each token's position (`layers.positions(segment_ids)` for fresh sequences).
    options: remat, scan unroll and attention implementation of the uncached pass.
    cache: see the module doc; ``attention`` is its decode-step attention (CPU kernels can be
      injected by the caller; default XLA's `cached_attention`).
    """
    if isinstance(layers, Mapping) != (cache is None):
        raise ValueError(
            "forward takes stacked layers (a dict of [L, ...] arrays) without a cache and a "
            f"sequence of per-layer dicts with one; got {type(layers).__name__} with "
            f"cache={'None' if cache is None else 'a KVCache'}"
        )
    x = jnp.take(embed, tokens, axis=0)  # [B, T, D]
    c = config
    if cache is None:
        options = options or ModelOptions()
        x = constrain(x.astype(options.compute_dtype), RESIDUAL_AXES)
        cos, sin = L.rope_cos_sin(positions, c.head_dim, c.rope_theta)  # [B, T, H/2] each
        x = _scan_layers(layers, x, cos, sin, segment_ids, c, options, projections)
        return x, None
    t = tokens.shape[1]
    # a prefill's tokens attend over their own keys: the dense mask, built once for all layers
    prefill = A.self_attention(segment_ids, "plain") if t > 1 else None
    key_valid = jax.lax.dynamic_update_slice_in_dim(
        cache.key_valid, segment_ids != 0, cache.length, 1
    )  # [B, S]
    # every position is below the slot count: cos/sin from a table (`rope_cos_sin`)
    cos, sin = L.rope_cos_sin(positions, c.head_dim, c.rope_theta, table_length=cache.slots)
    ks, vs = [], []
    for p, k_cache, v_cache in zip(layers, cache.k, cache.v, strict=True):
        attend = _cache_attend(k_cache, v_cache, cache.length, key_valid, prefill, attention)
        x, (k_cache, v_cache) = L.decoder_layer(
            p, x, cos, sin, attend, eps=c.rms_norm_eps, projections=projections
        )
        ks.append(k_cache)
        vs.append(v_cache)
    return x, KVCache(tuple(ks), tuple(vs), key_valid, cache.length + t)
