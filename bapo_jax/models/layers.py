"""Pure functions of the Qwen2 decoder: RMSNorm, RoPE, masks, the attention core, one layer.

Everything here takes plain arrays (no NNX state), so the decoder stack can run them under
``jax.lax.scan`` and ``jax.checkpoint`` directly. ``decoder_layer`` is the one layer of every
forward (`bapo_jax.models.forward`): its matmuls come from a `Projections` (this module's
`SEPARATE` for the stacked training layout; `decode.FusedProjections` for the decode layout)
and its attention core from the caller (self-attention, or attention against a KV cache).

Shape letters: B batch, T query length, S key length, D hidden, N query heads, K KV heads,
G = N // K query heads per KV head, H head dim, F MLP width, V vocab.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int

__all__ = [
    "MAX_CAUSAL_BLOCKS",
    "SEPARATE",
    "Projections",
    "SeparateProjections",
    "apply_rope",
    "attention",
    "attention_inputs",
    "attention_output",
    "causal_mask",
    "decoder_layer",
    "mlp_block",
    "positions",
    "rms_norm",
    "rope_cos_sin",
    "swiglu",
]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def rms_norm(
    x: Float[Array, "... D"], weight: Float[Array, " D"], eps: float
) -> Float[Array, "... D"]:
    """HF Qwen2RMSNorm: statistics in fp32, result cast back to x's dtype, then scaled.

    Custom VJP: the backward keeps x, the weight and the [..., 1] fp32 rsqrt only (autodiff
    kept normalised copies of x as well, each copied into the scan's stacked residuals) and
    applies autodiff's formula in fp32: with r = rsqrt(mean(x^2) + eps), dy = d_out * weight,
    dx = r dy - x r^3 mean(dy x), d_weight = sum(d_out * x r)."""
    return _rms_norm_fwd(x, weight, eps)[0]


def _rms_norm_fwd(x, weight, eps):
    x32 = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)  # [..., 1] fp32
    return weight.astype(x.dtype) * (x32 * r).astype(x.dtype), (x, weight, r)


def _rms_norm_bwd(eps, res, d_out):
    del eps
    x, weight, r = res
    x32 = x.astype(jnp.float32)
    y = (x32 * r).astype(x.dtype)  # the normalised x, as in the forward
    lead = tuple(range(x.ndim - 1))
    d_weight = jnp.sum((d_out * y).astype(jnp.float32), axis=lead).astype(weight.dtype)
    dy = (d_out * weight.astype(x.dtype)).astype(jnp.float32)
    dx = r * dy - x32 * (r * r * r) * jnp.mean(dy * x32, axis=-1, keepdims=True)
    return dx.astype(x.dtype), d_weight


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def positions(segment_ids: Int[Array, "B T"]) -> Int[Array, "B T"]:
    """Each token's position inside its segment, restarting at 0 per segment; padding gets 0.

    Segment ids: 1, 2, ... per packed sequence, 0 for padding; a padded batch passes its 0/1
    attention mask (one segment per row), for which this is HF ``generate``'s derivation,
    ``cumsum(mask) - 1`` on real tokens and 0 on padding (transformers 5 fills 0).
    """
    b, t = segment_ids.shape
    index = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))  # [B, T]
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)  # [B, T]
    start = jax.lax.cummax(jnp.where(segment_ids != prev, index, 0), axis=1)  # [B, T]
    return jnp.where(segment_ids != 0, index - start, 0).astype(jnp.int32)


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


def causal_mask(segment_ids: Int[Array, "B T"]) -> Bool[Array, "B T S"]:
    """Dense [B, T, S] (T == S) mask: key s visible to query t iff segment[s] == segment[t] != 0
    and s <= t (segment ids as in `positions`; packed segments are contiguous runs, so causal
    in row order is causal within each segment)."""
    t = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))  # [T, S]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, T, S]
    real = (segment_ids != 0)[:, :, None]  # [B, T, 1]
    return causal[None] & same & real


MAX_CAUSAL_BLOCKS = 4  # `attention`'s causal skipping unrolls at most this many query blocks


def attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    mask: Bool[Array, "B T S"],
    *,
    causal_block: int | None = None,
) -> Float[Array, "B T N H"]:
    """Softmax attention with grouped KV heads, never repeating K/V.

    The N query heads are split [K, G] and laid out head-major, [B, K, G*T, H], so each KV head
    is contracted with all G*T of its query rows in one GEMM per (batch, KV head), for the
    scores and for the output alike (and for their gradients). Scores and softmax are fp32;
    masked keys get the most negative fp32 value. A query with no visible key (a padding token)
    outputs exactly 0, so it contributes nothing to any gradient (and equals the blockwise
    implementation, `bapo_jax.models.attention`).

    ``causal_block`` (for a causal ``mask``: no key after its query is visible): self-attention
    of 2 to `MAX_CAUSAL_BLOCKS` blocks (T == S) takes its queries in blocks of ``causal_block``,
    each against its causal key prefix (keys up to the block's last query). The keys after a
    block are masked for every query in it, so skipping them leaves each softmax and output the
    same up to fp32 summation order, and the scores above the diagonal blocks are never formed
    (T = 256 in blocks of 128 forms 3/4 of the [T, S] scores; FlashAttention skips the same
    tiles). Each block is unrolled into the program, hence the bound: longer rows are the
    domain of the ``blockwise`` implementation, whose loops skip the same tiles. ``None``, one
    block or more than `MAX_CAUSAL_BLOCKS`: the whole [T, S] at once, any mask.

    Layout: with the [B, T, K, G] query axes contracted as they come ("btkgh,bskh->bkgts"),
    XLA:CPU transposes the [B, K, G, T, S] probabilities (and their cotangent) around every
    batched GEMM; the explicit head-major transpose of q, k, v, out ([B, T, ., H], ~1/4 of
    the score size for T = S = 256, G = 4) is cheaper (measured: docs/model.md).
    """
    if causal_block is not None and (not isinstance(causal_block, int) or causal_block < 1):
        raise ValueError(
            f"attention: causal_block must be an int >= 1 or None, got {causal_block!r}"
        )
    b, t, n, h = q.shape
    s, kv = k.shape[1], k.shape[2]
    g = n // kv
    scale = jnp.asarray(h**-0.5, dtype=q.dtype)
    qh = (q * scale).reshape(b, t, kv, g, h).transpose(0, 2, 3, 1, 4)  # [B, K, G, T, H]
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, H] each
    blocks = 1 if causal_block is None or t != s else -(-t // causal_block)
    if not 1 < blocks <= MAX_CAUSAL_BLOCKS:
        out = _grouped_attention(qh.reshape(b, kv, g * t, h), kh, vh, mask)  # [B, K, G*T, H]
        out = out.reshape(b, kv, g, t, h)  # [B, K, G, T, H]
    else:
        outs = []
        for lo in range(0, t, causal_block):
            hi = min(lo + causal_block, t)  # queries [lo, hi) see keys [0, hi) at most
            q_blk = qh[:, :, :, lo:hi].reshape(b, kv, g * (hi - lo), h)  # [B, K, G*Q, H]
            o_blk = _grouped_attention(q_blk, kh[:, :, :hi], vh[:, :, :hi], mask[:, lo:hi, :hi])
            outs.append(o_blk.reshape(b, kv, g, hi - lo, h))  # [B, K, G, Q, H]
        out = jnp.concatenate(outs, axis=3)  # [B, K, G, T, H]
    seen = jnp.any(mask, axis=-1)[:, None, None, :, None]  # [B, 1, 1, T, 1]
    out = jnp.where(seen, out, 0)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)  # [B, T, N, H]


@jax.custom_vjp
def _grouped_attention(
    qh: Float[Array, "B K GT H"],
    kh: Float[Array, "B K S H"],
    vh: Float[Array, "B K S H"],
    mask: Bool[Array, "B T S"],
) -> Float[Array, "B K GT H"]:
    """softmax(mask(q k^T)) v per (batch, KV head) on head-major rows ([G*T] = G heads x T).

    Custom VJP: the backward keeps q, k, v and the fp32 probabilities only (autodiff kept the
    exponentials and the probabilities, two [B, K, G*T, S] fp32 tensors per layer) and applies
    softmax's own rule, ds = p (dp - sum(dp p)); masked keys have p = 0, so ds = 0 there."""
    return _grouped_attention_fwd(qh, kh, vh, mask)[0]


def _grouped_attention_fwd(qh, kh, vh, mask):
    b, kv, gt, _ = qh.shape
    t = mask.shape[1]
    scores = jnp.einsum("bkth,bksh->bkts", qh, kh, preferred_element_type=jnp.float32)
    scores = scores.reshape(b, kv, gt // t, t, -1)  # [B, K, G, T, S] fp32
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).reshape(b, kv, gt, -1)  # [B, K, G*T, S] fp32
    out = jnp.einsum("bkts,bksh->bkth", probs.astype(vh.dtype), vh)  # [B, K, G*T, H]
    return out, (qh, kh, vh, probs)


def _grouped_attention_bwd(res, d_out):
    qh, kh, vh, probs = res
    d_v = jnp.einsum("bkts,bkth->bksh", probs.astype(vh.dtype), d_out)  # [B, K, S, H]
    d_p = jnp.einsum("bkth,bksh->bkts", d_out, vh, preferred_element_type=jnp.float32)
    d_s = (probs * (d_p - jnp.sum(d_p * probs, axis=-1, keepdims=True))).astype(qh.dtype)
    d_q = jnp.einsum("bkts,bksh->bkth", d_s, kh)  # [B, K, G*T, H]
    d_k = jnp.einsum("bkts,bkth->bksh", d_s, qh)  # [B, K, S, H]
    return d_q, d_k, d_v, None


_grouped_attention.defvjp(_grouped_attention_fwd, _grouped_attention_bwd)


def _tokens(x: Float[Array, "B T ..."]) -> Float[Array, "BT ..."]:
    """[B, T, ...] -> [B*T, ...] (a free reshape). The projections contract one token axis
    rather than (B, T): XLA:CPU lowers the backward's weight gradient over two contracting axes
    with a transposing copy of the [B*T, F] cotangent fused into its producer (strided, cache-
    hostile writes; docs/model.md), over one axis as a plain GEMM."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def attention_inputs(
    p: Mapping[str, Array], x: Float[Array, "B T D"], eps: float
) -> tuple[Float[Array, "B T N H"], Float[Array, "B T K H"], Float[Array, "B T K H"]]:
    """Pre-norm, q/k/v projections with bias (before RoPE)."""
    b, t, _ = x.shape
    h = _tokens(rms_norm(x, p["input_layernorm"], eps))  # [B*T, D]
    q = jnp.einsum("td,dnh->tnh", h, p["q_proj"]) + p["q_bias"]  # [B*T, N, H]
    k = jnp.einsum("td,dkh->tkh", h, p["k_proj"]) + p["k_bias"]  # [B*T, K, H]
    v = jnp.einsum("td,dkh->tkh", h, p["v_proj"]) + p["v_bias"]  # [B*T, K, H]
    q, k, v = (y.reshape(b, t, *y.shape[1:]) for y in (q, k, v))
    return q, k, v


def attention_output(
    p: Mapping[str, Array], x: Float[Array, "B T D"], a: Float[Array, "B T N H"]
) -> Float[Array, "B T D"]:
    """Residual add of the output projection of the attention result."""
    o = jnp.einsum("tnh,nhd->td", _tokens(a), p["o_proj"])  # [B*T, D]
    return x + o.reshape(x.shape)  # [B, T, D]


def mlp_block(
    p: Mapping[str, Array], x: Float[Array, "B T D"], eps: float
) -> Float[Array, "B T D"]:
    """x + down(silu(gate(h)) * up(h)), h = RMSNorm(x)."""
    h = _tokens(rms_norm(x, p["post_attention_layernorm"], eps))  # [B*T, D]
    down = swiglu(h, p["gate_proj"], p["up_proj"], p["down_proj"])  # [B*T, D]
    return x + down.reshape(x.shape)  # [B, T, D]


@jax.custom_vjp
def swiglu(
    h: Float[Array, "T D"], w_gate: Float[Array, "D F"], w_up: Float[Array, "D F"], w_down
) -> Float[Array, "T D"]:
    """down(silu(h w_gate) * (h w_up)) on token rows ([B*T, D]; ``w_down`` is [F, D]).

    The custom VJP keeps only h, gate and up ([T, F] each) for the backward and recomputes the
    elementwise rest there; autodiff kept six [T, F] tensors (sigmoid, silu, products), each
    copied into the scan's stacked residuals and read back (~1/3 of the layer's residual bytes).
    Same formulas as autodiff: silu'(g) = s + g s (1 - s), s = sigmoid(g)."""
    return _swiglu_fwd(h, w_gate, w_up, w_down)[0]


def _swiglu_fwd(h, w_gate, w_up, w_down):
    gate = jnp.einsum("td,df->tf", h, w_gate)  # [T, F]
    up = jnp.einsum("td,df->tf", h, w_up)  # [T, F]
    out = jnp.einsum("tf,fd->td", jax.nn.silu(gate) * up, w_down)  # [T, D]
    return out, (h, w_gate, w_up, w_down, gate, up)


def _swiglu_bwd(res, d_out):
    h, w_gate, w_up, w_down, gate, up = res
    sig = jax.nn.sigmoid(gate)  # [T, F]
    silu = gate * sig
    d_w_down = jnp.einsum("tf,td->fd", silu * up, d_out)  # [F, D]
    d_act = jnp.einsum("td,fd->tf", d_out, w_down)  # [T, F]
    d_up = d_act * silu
    d_gate = d_act * up * (sig + gate * (sig * (1 - sig)))
    d_h = jnp.einsum("tf,df->td", d_gate, w_gate) + jnp.einsum("tf,df->td", d_up, w_up)
    d_w_gate = jnp.einsum("td,tf->df", h, d_gate)  # [D, F]
    d_w_up = jnp.einsum("td,tf->df", h, d_up)  # [D, F]
    return d_h, d_w_gate, d_w_up, d_w_down


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


class Projections(Protocol):
    """The matmuls of a decoder layer on one parameter layout."""

    def qkv(self, p, x: Float[Array, "B T D"], eps: float) -> tuple[Array, Array, Array]:
        """q [B,T,N,H], k [B,T,K,H], v [B,T,K,H]: pre-norm, projections with bias (no RoPE)."""
        ...

    def output(self, p, x: Float[Array, "B T D"], a: Float[Array, "B T N H"]) -> Array:
        """x + o(a) [B,T,D]."""
        ...

    def mlp(self, p, x: Float[Array, "B T D"], eps: float) -> Array:
        """x + down(silu(gate(h)) * up(h)) [B,T,D], h = RMSNorm(x)."""
        ...


@dataclasses.dataclass(frozen=True)
class SeparateProjections:
    """`Projections` of the stacked training layout: q/k/v [D, N|K, H], o [N, H, D],
    gate/up [D, F], down [F, D] (the functions above, with their custom VJPs)."""

    qkv = staticmethod(attention_inputs)
    output = staticmethod(attention_output)
    mlp = staticmethod(mlp_block)


SEPARATE = SeparateProjections()


def decoder_layer(
    p: Mapping[str, Array],
    x: Float[Array, "B T D"],
    cos: Float[Array, "B T H2"],
    sin: Float[Array, "B T H2"],
    attend: Callable[[Array, Array, Array], tuple[Array, Any]],
    *,
    eps: float,
    projections: Projections = SEPARATE,
) -> tuple[Float[Array, "B T D"], Any]:
    """One Qwen2 decoder layer on per-layer params ``p`` (already in the compute dtype).

    x -> x + o(attend(rope(q), rope(k), v)) -> x + down(silu(gate) * up), each branch pre-normed.
    ``attend(q [B,T,N,H], k [B,T,K,H], v [B,T,K,H]) -> (out [B,T,N,H], aux)`` is the attention
    core with its mask bound; ``aux`` (the layer's updated KV cache, or None) is returned
    beside the new residual stream. The blocks are named scopes (``attention/{qkv, core,
    output}``, ``mlp``), so a profile names them without a benchmark of its own.
    """
    with jax.named_scope("attention"):
        with jax.named_scope("qkv"):
            q, k, v = projections.qkv(p, x, eps)
        with jax.named_scope("core"):
            out, aux = attend(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        with jax.named_scope("output"):
            x = projections.output(p, x, out)  # [B, T, D]
    with jax.named_scope("mlp"):
        return projections.mlp(p, x, eps), aux
