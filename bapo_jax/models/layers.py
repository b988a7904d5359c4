"""Pure functions of the Qwen2 decoder: RMSNorm, RoPE, masks, the attention core, one layer.

Everything here takes plain arrays (no NNX state), so the decoder stack can run them under
``jax.lax.scan`` and ``jax.checkpoint`` directly, and a later KV-cache / packed-sequence /
blockwise-attention variant can reuse or replace single pieces.

Shape letters: B batch, T query length, S key length, D hidden, N query heads, K KV heads,
G = N // K query heads per KV head, H head dim, F MLP width, V vocab.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

__all__ = [
    "apply_rope",
    "attention",
    "attention_inputs",
    "attention_output",
    "causal_padding_mask",
    "decoder_layer",
    "mlp_block",
    "positions_from_mask",
    "rms_norm",
    "rope_cos_sin",
]


def rms_norm(
    x: Float[Array, "... D"], weight: Float[Array, " D"], eps: float
) -> Float[Array, "... D"]:
    """HF Qwen2RMSNorm: statistics in fp32, result cast back to x's dtype, then scaled."""
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)  # [..., 1] fp32
    y = (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)  # [..., D]
    return weight.astype(x.dtype) * y


def positions_from_mask(
    attention_mask: Int[Array, "B T"] | Bool[Array, "B T"],
) -> Int[Array, "B T"]:
    """Token positions of a (left-)padded batch, as HF ``generate`` derives them.

    ``cumsum(mask) - 1`` on real tokens; padding gets position 0 (transformers 5 fills 0).
    """
    mask = attention_mask.astype(jnp.int32)
    pos = jnp.cumsum(mask, axis=-1) - 1  # [B, T]
    return jnp.where(mask > 0, pos, 0).astype(jnp.int32)


def rope_inv_freq(head_dim: int, theta: float) -> np.ndarray:
    """HF default RoPE inverse frequencies, 1 / theta^(2i / H), in float32 like transformers.

    The power is taken in float64 and rounded once to float32: torch's float32 pow is (nearly)
    correctly rounded, numpy's float32 power is not (it differed from transformers by an ulp in
    14 of Qwen2.5's 64 frequencies, an angle error of ~1e-4 rad by position 4000)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    power = np.power(np.float64(theta), exponent.astype(np.float64)).astype(np.float32)
    return np.float32(1.0) / power  # [H/2] float32


def rope_cos_sin(
    positions: Int[Array, "B T"], head_dim: int, theta: float, *, table_length: int | None = None
) -> tuple[Float[Array, "B T H2"], Float[Array, "B T H2"]]:
    """cos/sin of the rotation angles, fp32, each [B, T, H/2] (the two halves share them).

    With `table_length` (every position below it), they are gathered from a table computed on
    the host at trace time, so the program holds no cos/sin: XLA fuses those into each layer's
    RoPE and recomputes them per head and per layer (a decode step's q RoPE ran ~40 us). The
    table's angles are the same fp32 products; cos/sin are rounded from float64."""
    inv_freq = rope_inv_freq(head_dim, theta)  # [H/2]
    if table_length is None:
        angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)  # [B, T, H/2]
        return jnp.cos(angles), jnp.sin(angles)
    angles = np.arange(table_length, dtype=np.float32)[:, None] * inv_freq  # [S, H/2] fp32
    cos, sin = (jnp.asarray(f(angles.astype(np.float64)), jnp.float32) for f in (np.cos, np.sin))
    return jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)  # [B, T, H/2]


def apply_rope(
    x: Float[Array, "B T X H"], cos: Float[Array, "B T H2"], sin: Float[Array, "B T H2"]
) -> Float[Array, "B T X H"]:
    """RoPE with HF's rotate_half convention: x*cos + rotate_half(x)*sin on (first, second) half."""
    half = x.shape[-1] // 2
    c = cos[:, :, None, :].astype(x.dtype)  # [B, T, 1, H/2]
    s = sin[:, :, None, :].astype(x.dtype)  # [B, T, 1, H/2]
    x1, x2 = x[..., :half], x[..., half:]  # each [B, T, X, H/2]
    return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)  # [B, T, X, H]


def causal_padding_mask(
    attention_mask: Int[Array, "B S"] | Bool[Array, "B S"] | None, batch: int, length: int
) -> Bool[Array, "B T S"]:
    """Boolean [B, T, S] (T == S) mask: key s visible to query t iff s <= t and s is not padding."""
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))  # [T, S]
    if attention_mask is None:
        return jnp.broadcast_to(causal, (batch, length, length))
    keys = attention_mask.astype(jnp.bool_)  # [B, S]
    return causal[None, :, :] & keys[:, None, :]  # [B, T, S]


def attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    mask: Bool[Array, "B T S"],
) -> Float[Array, "B T N H"]:
    """Softmax attention with grouped KV heads, never repeating K/V.

    The N query heads are split [K, G] so each KV head is contracted with its G query heads in
    one einsum. Scores and softmax are fp32; masked keys get the most negative fp32 value. A
    query with no visible key (a padding token) outputs exactly 0, so it contributes nothing to
    any gradient (and equals the blockwise implementation, `bapo_jax.models.attention`).
    """
    b, t, n, h = q.shape
    kv = k.shape[2]
    g = n // kv
    qg = q.reshape(b, t, kv, g, h)  # [B, T, K, G, H]
    scale = jnp.asarray(h**-0.5, dtype=q.dtype)
    scores = jnp.einsum(
        "btkgh,bskh->bkgts", qg * scale, k, preferred_element_type=jnp.float32
    )  # [B, K, G, T, S] fp32
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)  # [B, K, G, T, S]
    out = jnp.einsum("bkgts,bskh->btkgh", probs, v)  # [B, T, K, G, H]
    seen = jnp.any(mask, axis=-1)[:, :, None, None, None]  # [B, T, 1, 1, 1]
    return jnp.where(seen, out, 0).reshape(b, t, n, h)


def attention_inputs(
    p: Mapping[str, Array],
    x: Float[Array, "B T D"],
    cos: Float[Array, "B T H2"],
    sin: Float[Array, "B T H2"],
    eps: float,
) -> tuple[Float[Array, "B T N H"], Float[Array, "B T K H"], Float[Array, "B T K H"]]:
    """Pre-norm, q/k/v projections with bias, RoPE on q and k."""
    h = rms_norm(x, p["input_layernorm"], eps)  # [B, T, D]
    q = jnp.einsum("btd,dnh->btnh", h, p["q_proj"]) + p["q_bias"]  # [B, T, N, H]
    k = jnp.einsum("btd,dkh->btkh", h, p["k_proj"]) + p["k_bias"]  # [B, T, K, H]
    v = jnp.einsum("btd,dkh->btkh", h, p["v_proj"]) + p["v_bias"]  # [B, T, K, H]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def attention_output(
    p: Mapping[str, Array], x: Float[Array, "B T D"], a: Float[Array, "B T N H"]
) -> Float[Array, "B T D"]:
    """Residual add of the output projection of the attention result."""
    return x + jnp.einsum("btnh,nhd->btd", a, p["o_proj"])  # [B, T, D]


def mlp_block(
    p: Mapping[str, Array], x: Float[Array, "B T D"], eps: float
) -> Float[Array, "B T D"]:
    """x + down(silu(gate(h)) * up(h)), h = RMSNorm(x)."""
    h = rms_norm(x, p["post_attention_layernorm"], eps)  # [B, T, D]
    gate = jnp.einsum("btd,df->btf", h, p["gate_proj"])  # [B, T, F]
    up = jnp.einsum("btd,df->btf", h, p["up_proj"])  # [B, T, F]
    return x + jnp.einsum("btf,fd->btd", jax.nn.silu(gate) * up, p["down_proj"])  # [B, T, D]


def decoder_layer(
    p: Mapping[str, Array],
    x: Float[Array, "B T D"],
    cos: Float[Array, "B T H2"],
    sin: Float[Array, "B T H2"],
    attend: Callable[[Array, Array, Array], Array],
    *,
    eps: float,
) -> Float[Array, "B T D"]:
    """One Qwen2 decoder layer on per-layer params ``p`` (already in the compute dtype).

    x -> x + o(attend(rope(q), rope(k), v)) -> x + down(silu(gate) * up), each branch pre-normed.
    ``attend(q [B,T,N,H], k [B,T,K,H], v [B,T,K,H]) -> [B,T,N,H]`` is the attention core with its
    mask already bound (`bapo_jax.models.attention.attend`, or `attention` with a dense mask).
    The KV-cache decoder (`bapo_jax.models.decode`) composes the same three pieces.
    """
    q, k, v = attention_inputs(p, x, cos, sin, eps)
    x = attention_output(p, x, attend(q, k, v))  # [B, T, D]
    return mlp_block(p, x, eps)
