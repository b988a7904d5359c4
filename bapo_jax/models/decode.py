"""Sampling with a KV cache: the decode weight layout, prefill and one decode step, both of
them `forward.forward` with a cache. Used by the embedded sampler (`bapo_jax.rollout.embedded`).

Weights. `decode_weights` lays the model out for T = 1 steps once per policy: one dict per
layer (the decode loop never slices the stacked [L, ...] arrays, which XLA would copy every
step), q/k/v fused into one [D, (N + 2K) H] matrix and gate/up into one [D, 2F] matrix, the
output head transposed to [D, V] (x @ W with W [in, out] is the faster layout for XLA's CPU dot
at a handful of rows). A decode step reads every weight once for a handful of rows, so it is
bound by how fast the dots stream weights.

How each matrix is stored and multiplied is a `DecodeOps`, chosen by the caller: this module's
`ColumnBlocks` (XLA's dots; each matrix cut into column blocks, x @ W = concat_j(x @ W_j), so
XLA runs the independent block dots on separate cores where one [16, 512] x [512, E] dot keeps
mostly one core busy), or CPU kernels the rollout side injects (`bapo_jax.rollout.cpu_kernels`).
An ops object also supplies the decode step's attention against the cache. Fusing and cutting
compute exactly the same dot products as the separate matrices.

Prompts are left-padded to a common length P, so every row writes slot P + i at decode step i
and one `dynamic_update_slice` per layer serves the whole batch (`forward`'s cache layout).
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Protocol

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from bapo_jax.models import layers as L
from bapo_jax.models.config import Qwen2Config
from bapo_jax.models.forward import KVCache, cached_attention, forward, init_cache
from bapo_jax.models.qwen2 import Qwen2ForCausalLM

__all__ = [
    "ColumnBlocks",
    "DecodeOps",
    "DecodeWeights",
    "FusedProjections",
    "decode_step",
    "decode_weights",
    "prefill",
]


class DecodeOps(Protocol):
    """How the decode layout stores its matrices and runs a step's matmuls and attention.

    prepare(w [I, O]) -> the stored form of W (any pytree).
    linear(x [..., I], stored, out_dtype=None, *, norm=None, eps=0.0, residual=None) [..., O]:
      residual + rms_norm(x; norm, eps) @ W, the dot accumulated in fp32, returned in
      `out_dtype` (default x's dtype); the norm (`layers.rms_norm`) and the residual only if
      given.
    attention: the decode step's attention (`forward.CachedAttention`).
    Implementations are frozen dataclasses (hashable: they are static in jitted programs).
    """

    def prepare(self, w: Float[Array, "I O"]) -> Any: ...

    def linear(self, x, stored, out_dtype=None, *, norm=None, eps=0.0, residual=None): ...

    def attention(self, q, keys, values, valid): ...


def _column_blocks(w: Float[Array, "... I O"], blocks: int) -> tuple[Array, ...]:
    bounds = np.linspace(0, w.shape[-1], blocks + 1).round().astype(int)
    return tuple(w[..., lo:hi] for lo, hi in itertools.pairwise(bounds))


@dataclasses.dataclass(frozen=True)
class ColumnBlocks:
    """XLA's dots on each matrix cut into `blocks` column blocks (one independent dot each)."""

    blocks: int = 1

    def __post_init__(self):
        if not isinstance(self.blocks, int) or self.blocks < 1:
            raise ValueError(f"ColumnBlocks.blocks must be an int >= 1, got {self.blocks!r}")

    def prepare(self, w: Float[Array, "I O"]) -> tuple[Array, ...]:
        return _column_blocks(w, self.blocks)

    def linear(
        self,
        x: Float[Array, "... I"],
        stored: tuple[Array, ...],
        out_dtype=None,
        *,
        norm: Float[Array, " I"] | None = None,
        eps: float = 0.0,
        residual: Float[Array, "... O"] | None = None,
    ) -> Float[Array, "... O"]:
        if norm is not None:
            x = L.rms_norm(x, norm, eps)
        out = [
            jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32) for w in stored
        ]
        out = jnp.concatenate(out, axis=-1).astype(out_dtype or x.dtype)
        return out if residual is None else residual + out

    def attention(self, q, keys, values, valid):
        return cached_attention(q, keys, values, valid)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeWeights:
    """A model's parameters in the compute dtype, laid out for decoding.

    layers: per layer {"input_layernorm" [D], "qkv" [D, (N+2K)H], "qkv_bias" [(N+2K)H],
      "o_proj" [NH, D], "post_attention_layernorm" [D], "gate_up" [D, 2F], "down_proj" [F, D]},
      the four matrices in the stored form of `ops`.
    unembed: the output head transposed to [D, V], stored by `ops` too.
    """

    layers: tuple[dict[str, Any], ...]
    embed: Float[Array, "V D"]
    norm: Float[Array, " D"]
    unembed: Any
    config: Qwen2Config = dataclasses.field(metadata=dict(static=True))
    ops: DecodeOps = dataclasses.field(metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class FusedProjections:
    """`layers.Projections` on the decode layout: fused q/k/v and gate/up, each matrix
    multiplied by `ops.linear` with the RMSNorm before it and the residual add after it
    (inside one call of an injected kernel)."""

    ops: DecodeOps
    config: Qwen2Config

    def qkv(self, p, x: Float[Array, "B T D"], eps: float):
        b, t, _ = x.shape
        n, k, h = (
            self.config.num_attention_heads,
            self.config.num_key_value_heads,
            self.config.head_dim,
        )
        qkv = self.ops.linear(x, p["qkv"], norm=p["input_layernorm"], eps=eps)  # [B, T, (N+2K)H]
        qkv = qkv + p["qkv_bias"]
        q = qkv[..., : n * h].reshape(b, t, n, h)  # [B, T, N, H]
        kk = qkv[..., n * h : (n + k) * h].reshape(b, t, k, h)  # [B, T, K, H]
        v = qkv[..., (n + k) * h :].reshape(b, t, k, h)  # [B, T, K, H]
        return q, kk, v

    def output(self, p, x: Float[Array, "B T D"], a: Float[Array, "B T N H"]):
        b, t, n, h = a.shape
        return self.ops.linear(a.reshape(b, t, n * h), p["o_proj"], residual=x)  # [B, T, D]

    def mlp(self, p, x: Float[Array, "B T D"], eps: float):
        f = self.config.intermediate_size
        gate_up = self.ops.linear(x, p["gate_up"], norm=p["post_attention_layernorm"], eps=eps)
        act = jax.nn.silu(gate_up[..., :f]) * gate_up[..., f:]  # [B, T, F]
        return self.ops.linear(act, p["down_proj"], residual=x)  # [B, T, D]


def decode_weights(model: Qwen2ForCausalLM, ops: DecodeOps | None = None) -> DecodeWeights:
    """Unstacks the layers, fuses q/k/v and gate/up and stores every matrix by `ops` (default
    `ColumnBlocks()`; works on mesh-sharded params)."""
    ops = ColumnBlocks() if ops is None else ops
    c, dtype = model.config, model.options.compute_dtype
    d, n, k, h = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    stacked = model.layers.merged(dtype)  # LoRA adapters merged in (the base without them)
    qkv = jnp.concatenate(
        [
            stacked["q_proj"].reshape(-1, d, n * h),
            stacked["k_proj"].reshape(-1, d, k * h),
            stacked["v_proj"].reshape(-1, d, k * h),
        ],
        axis=-1,
    )  # [L, D, (N+2K)H]
    qkv_bias = jnp.concatenate(
        [
            stacked["q_bias"].reshape(-1, n * h),
            stacked["k_bias"].reshape(-1, k * h),
            stacked["v_bias"].reshape(-1, k * h),
        ],
        axis=-1,
    )  # [L, (N+2K)H]
    gate_up = jnp.concatenate([stacked["gate_proj"], stacked["up_proj"]], axis=-1)  # [L, D, 2F]
    o_proj = stacked["o_proj"].reshape(-1, n * h, d)  # [L, NH, D]
    layers = tuple(
        {
            "input_layernorm": stacked["input_layernorm"][i],
            "qkv": ops.prepare(qkv[i]),
            "qkv_bias": qkv_bias[i],
            "o_proj": ops.prepare(o_proj[i]),
            "post_attention_layernorm": stacked["post_attention_layernorm"][i],
            "gate_up": ops.prepare(gate_up[i]),
            "down_proj": ops.prepare(stacked["down_proj"][i]),
        }
        for i in range(c.num_hidden_layers)
    )
    return DecodeWeights(
        layers=layers,
        embed=model.embed_tokens.get_value().astype(dtype),
        norm=model.norm.get_value().astype(dtype),
        unembed=ops.prepare(model.unembedding().astype(dtype).T),  # [D, V]
        config=c,
        ops=ops,
    )


def _run(weights: DecodeWeights, tokens, segment_ids, positions, cache: KVCache):
    """`forward` on the decode layout; returns the last token's fp32 logits [B, V] and the
    cache (the final norm inside the output head's linear)."""
    c = weights.config
    x, cache = forward(
        weights.layers,
        weights.embed,
        tokens,
        segment_ids,
        positions,
        config=c,
        cache=cache,
        projections=FusedProjections(weights.ops, c),
        attention=weights.ops.attention,
    )
    norm = dict(norm=weights.norm, eps=c.rms_norm_eps)
    return weights.ops.linear(x[:, -1], weights.unembed, jnp.float32, **norm), cache


def prefill(
    weights: DecodeWeights,
    input_ids: Int[Array, "B P"],
    attention_mask: Int[Array, "B P"],
    cache_length: int,
) -> tuple[Float[Array, "B V"], Int[Array, " B"], KVCache]:
    """Runs the left-padded prompts and writes their keys/values into a fresh cache.

    The prompt attends over its own P keys (causal, padding masked), not over the whole cache.
    Returns the fp32 logits of the next token [B, V], the next position of each row [B] and the
    cache (length P).
    """
    chex.assert_rank([input_ids, attention_mask], 2)
    chex.assert_equal_shape([input_ids, attention_mask])
    b, p = input_ids.shape
    if cache_length < p:
        raise ValueError(f"cache_length={cache_length} must be >= the prompt length {p}")
    segments = (attention_mask > 0).astype(jnp.int32)  # [B, P]: one segment per row
    cache = init_cache(weights.config, b, cache_length, weights.embed.dtype)
    logits, cache = _run(weights, input_ids, segments, L.positions(segments), cache)
    next_position = jnp.sum(attention_mask, axis=-1).astype(jnp.int32)  # [B]
    return logits, next_position, cache


def decode_step(
    weights: DecodeWeights,
    tokens: Int[Array, " B"],
    positions: Int[Array, " B"],
    cache: KVCache,
) -> tuple[Float[Array, "B V"], KVCache]:
    """Feeds one token per row at slot `cache.length`; returns next-token logits [B, V].

    A row's position is at most its slot, so below the cache's slot count."""
    chex.assert_rank([tokens, positions], 1)
    segments = jnp.ones((tokens.shape[0], 1), jnp.int32)  # [B, 1]
    return _run(weights, tokens[:, None], segments, positions[:, None], cache)
