"""Self-attention implementations over segment ids: plain, blockwise (custom VJP), cuDNN.

All three compute, per query t and KV head k with its G query heads,

    out[t] = sum_s softmax_s(q[t] . k[s] / sqrt(H) + mask(t, s)) v[s],

where key s is visible to query t iff ``segment[s] == segment[t] != 0`` and ``s <= t``. Segment 0
is padding (left/right padding of a padded batch, the tail of a packed row); packed segments are
contiguous runs, so "causal in row order" is causal within each segment. A query with no visible
key (a padding token) outputs exactly 0 in every implementation, so it contributes nothing to any
gradient.

* ``plain``: [B, K, G, T, S] fp32 scores (`layers.attention` on the dense mask
  `layers.causal_mask`); reference semantics. Rows of 2-4 blocks of `PLAIN_CAUSAL_BLOCK` take
  their queries in blocks, each against its causal key prefix (the tiles above the diagonal
  are never formed).
* ``blockwise``: flash-attention-style online softmax over KV blocks for each query block, fp32
  running max ``m``, normaliser ``l`` and accumulator. Dynamic loop bounds skip the tiles that
  hold no visible pair: those above the causal diagonal, and those whose queries and keys lie in
  different segments or in padding (packed rows, padding tails; `_tile_ranges`). Its
  ``jax.custom_vjp`` saves only q, k, v, the output and the per-row logsumexp
  ``lse = m + log l``, and the backward recomputes
  ``p = exp(s - lse)`` block by block (FlashAttention-2):
      D_t = sum_h dout[t] * out[t],   ds = p * (dout . v^T - D),
      dq = ds k,   dk = ds^T q,   dv = p^T dout,
  in one sweep (KV blocks outside, query blocks inside: each tile's p and ds computed once).
  Inside, tensors are head-major (q [B, K, G, T, H], k and v [B, K, S, H]), so that a tile's
  products are batched over (B, K) with (G, Q) as one matrix dimension.
  Memory is O(T * block) instead of O(T^2), in the forward and the backward.
* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` (GPU only; raises a clear
  error elsewhere). ``dot_product_attention(..., implementation="xla")`` runs the same call path
  with XLA's kernel, which is how it is tested on CPU.

Shape letters: B batch, T query length, S key length (T == S: self-attention), N query heads,
K KV heads, G = N // K, H head dim.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from bapo_jax.checks import choices
from bapo_jax.models import layers as L
from bapo_jax.models.config import AttentionImpl

__all__ = [
    "attend",
    "blockwise_attention",
    "dot_product_attention",
    "self_attention",
]

_NEG = -1e30  # masked score; finite so that max/exp of a fully masked block never makes NaN
# Query block of the plain implementation's causal skipping (`layers.attention`): rows of 129
# to 512 tokens (2-4 blocks) form only the scores on and below the diagonal blocks. For the
# 256-token rows of `benchmarks.model_step` the train step ran 3-5% faster than without skipping;
# blocks of 64 (more, smaller GEMMs) were within noise of 128 (1.4% faster one day, 2.2% slower
# another; docs/model.md). Rows up to 128 tokens (the CPU main job's) are one block, as are
# rows past 512 (long rows are blockwise attention's).
PLAIN_CAUSAL_BLOCK = 128


def _has_visible_key(segment_ids: Int[Array, "B T"]) -> Bool[Array, "B T"]:
    """Every non-padding query sees at least itself."""
    return segment_ids != 0


# ---- blockwise with custom VJP -------------------------------------------------------------------
def _pad_to(x: Array, axis: int, multiple: int, value=0) -> Array:
    pad = -x.shape[axis] % multiple
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths, constant_values=value)


def _block(x: Array, start: Array, size: int, axis: int) -> Array:
    """x[..., start:start + size, ...] along ``axis``."""
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=axis)


def _block_mask(seg_q, seg_k, q_start, k_start, bq: int, bk: int) -> Bool[Array, "B Q C"]:
    """Visibility of a [bq, bk] tile: same non-zero segment and causal in row order."""
    iq = q_start + jnp.arange(bq)  # [Q]
    ik = k_start + jnp.arange(bk)  # [C]
    causal = iq[:, None] >= ik[None, :]  # [Q, C]
    same = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q != 0)[:, :, None]  # [B, Q, C]
    return same & causal[None]


def _tile_ranges(seg: Int[Array, "B Tp"], bq: int, bk: int, by_segment: bool):
    """The tiles that can hold a visible (query, key) pair, as loop ranges (int32):
    ``(kv_lo, kv_hi)`` [nq], KV blocks query block i visits, and ``(q_lo, q_hi)`` [nk], query
    blocks KV block j is visited by.

    A tile is needed when it is on or below the causal diagonal and, in some row, the segment
    ids of its real queries and of its real keys span overlapping ranges (disjoint ranges share
    no id; a block with no real token needs nothing). Each range runs from the first needed
    tile to the last, so a tile between them still runs, masked. A skipped tile is fully
    masked, so it would have added exactly zero: results are those of visiting every causal
    tile (``by_segment=False``, tested equal). Packed rows of short sequences and padding tails
    (segment 0) skip most of the triangle."""
    b, tp = seg.shape
    nq, nk = tp // bq, tp // bk
    qi, kj = jnp.arange(nq)[:, None], jnp.arange(nk)[None, :]
    need = kj * bk <= qi * bq + bq - 1  # [nq, nk]: causal, the KV block starts by the last query
    if by_segment:
        real = seg != 0

        def id_span(n: int, size: int):  # [B, n] each: min and max real id per block
            ids, r = seg.reshape(b, n, size), real.reshape(b, n, size)
            low = jnp.where(r, ids, jnp.iinfo(jnp.int32).max).min(-1)
            return low, jnp.where(r, ids, -1).max(-1)

        q_min, q_max = id_span(nq, bq)
        k_min, k_max = id_span(nk, bk)
        overlap = (q_min[:, :, None] <= k_max[:, None]) & (k_min[:, None] <= q_max[:, :, None])
        need = need & jnp.any(overlap, axis=0)  # [nq, nk]

    def span(axis: int):
        n = need.shape[axis]
        some = jnp.any(need, axis=axis)
        first = jnp.argmax(need, axis=axis)
        last = n - 1 - jnp.argmax(jnp.flip(need, axis=axis), axis=axis)
        return (
            jnp.where(some, first, 0).astype(jnp.int32),
            jnp.where(some, last + 1, 0).astype(jnp.int32),
        )

    (kv_lo, kv_hi), (q_lo, q_hi) = span(1), span(0)
    return kv_lo, kv_hi, q_lo, q_hi


def _forward(q, k, v, seg, bq: int, bk: int, by_segment: bool):
    """(out [B, K, G, Tq, H] in q's dtype, lse [B, K, G, Tq] fp32) on block-padded, head-major
    inputs (q [B, K, G, Tq, H], k and v [B, K, S, H])."""
    b, kv, g, tq, h = q.shape
    nq = tq // bq
    kv_lo, kv_hi, _, _ = _tile_ranges(seg, bq, bk, by_segment)

    def q_block(_, qi):
        q_start = qi * bq
        q_i = _block(q, q_start, bq, 3)  # [B, K, G, Q, H]
        seg_q = _block(seg, q_start, bq, 1)  # [B, Q]

        def kv_step(kj, carry):
            m, norm, acc = carry
            k_start = kj * bk
            k_j, v_j = _block(k, k_start, bk, 2), _block(v, k_start, bk, 2)  # [B, K, C, H]
            mask = _block_mask(seg_q, _block(seg, k_start, bk, 1), q_start, k_start, bq, bk)
            s = jnp.einsum("bkgqh,bkch->bkgqc", q_i, k_j, preferred_element_type=jnp.float32)
            s = jnp.where(mask[:, None, None], s, _NEG)  # [B, K, G, Q, C] fp32
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))  # [B, K, G, Q]
            # A row with no visible key yet keeps m = _NEG: subtracting 0 instead makes its
            # p = exp(_NEG) = 0, as for every masked score of the other rows.
            p = jnp.exp(s - jnp.where(m_new > _NEG, m_new, 0.0)[..., None])
            alpha = jnp.exp(m - m_new)  # [B, K, G, Q]
            norm = norm * alpha + jnp.sum(p, axis=-1)
            pv = jnp.einsum(
                "bkgqc,bkch->bkgqh", p.astype(v.dtype), v_j, preferred_element_type=jnp.float32
            )  # [B, K, G, Q, H] fp32
            return m_new, norm, acc * alpha[..., None] + pv

        init = (
            jnp.full((b, kv, g, bq), _NEG, jnp.float32),
            jnp.zeros((b, kv, g, bq), jnp.float32),
            jnp.zeros((b, kv, g, bq, h), jnp.float32),
        )
        m, norm, acc = jax.lax.fori_loop(kv_lo[qi], kv_hi[qi], kv_step, init)
        seen = norm > 0  # [B, K, G, Q]: False only for padding queries
        out = jnp.where(seen[..., None], acc / jnp.where(seen, norm, 1.0)[..., None], 0.0)
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, norm, 1.0)), 0.0)
        return None, (out.astype(q.dtype), lse)

    _, (out, lse) = jax.lax.scan(q_block, None, jnp.arange(nq))
    # out [nq, B, K, G, Q, H] -> [B, K, G, Tq, H]; lse [nq, B, K, G, Q] -> [B, K, G, Tq]
    out = jnp.moveaxis(out, 0, 3).reshape(b, kv, g, tq, h)
    lse = jnp.moveaxis(lse, 0, 3).reshape(b, kv, g, tq)
    return out, lse


def _backward(q, k, v, seg, out, lse, dout, bq: int, bk: int, by_segment: bool):
    """(dq, dk, dv) by recomputing each tile's probabilities from the saved logsumexp, in one
    sweep: KV blocks outside, their query blocks inside, dk and dv accumulated per KV block and
    dq in a buffer for the whole length. Tiles are computed transposed, [B, K, C, G, Q], which
    makes every product contract over a dimension of its operands' preferred side (this CPU's
    dots ran 2-3x slower on ``ds^T q`` contracted over the tile's query axis)."""
    b, kv, g, tq, h = q.shape
    nk = k.shape[2] // bk
    _, _, q_lo, q_hi = _tile_ranges(seg, bq, bk, by_segment)
    delta = jnp.einsum(
        "bkgqh,bkgqh->bkgq", dout.astype(jnp.float32), out.astype(jnp.float32)
    )  # [B, K, G, Tq] fp32

    def dkv_block(dq_t, kj):
        k_start = kj * bk
        k_j, v_j = _block(k, k_start, bk, 2), _block(v, k_start, bk, 2)  # [B, K, C, H]
        seg_k = _block(seg, k_start, bk, 1)  # [B, C]

        def step(qi, carry):
            dq_t, dk, dv = carry
            q_start = qi * bq
            q_i, do_i = _block(q, q_start, bq, 3), _block(dout, q_start, bq, 3)  # [B,K,G,Q,H]
            lse_i = _block(lse, q_start, bq, 3)[:, :, None]  # [B, K, 1, G, Q]
            d_i = _block(delta, q_start, bq, 3)[:, :, None]  # [B, K, 1, G, Q]
            mask = _block_mask(_block(seg, q_start, bq, 1), seg_k, q_start, k_start, bq, bk)
            mask_t = jnp.swapaxes(mask, 1, 2)[:, None, :, None]  # [B, 1, C, 1, Q]
            s_t = jnp.einsum("bkch,bkgqh->bkcgq", k_j, q_i, preferred_element_type=jnp.float32)
            p_t = jnp.exp(jnp.where(mask_t, s_t, _NEG) - lse_i)  # [B, K, C, G, Q] fp32
            dp_t = jnp.einsum("bkch,bkgqh->bkcgq", v_j, do_i, preferred_element_type=jnp.float32)
            ds_t = p_t * (dp_t - d_i)  # [B, K, C, G, Q] fp32
            dv = dv + jnp.einsum("bkcgq,bkgqh->bkch", p_t, do_i.astype(jnp.float32))
            dk = dk + jnp.einsum("bkcgq,bkgqh->bkch", ds_t, q_i.astype(jnp.float32))
            dq_i = _block(dq_t, q_start, bq, 4) + jnp.einsum(
                "bkch,bkcgq->bkhgq", k_j.astype(jnp.float32), ds_t
            )  # [B, K, H, G, Q]
            dq_t = jax.lax.dynamic_update_slice_in_dim(dq_t, dq_i, q_start, axis=4)
            return dq_t, dk, dv

        zeros = jnp.zeros((b, kv, bk, h), jnp.float32)
        dq_t, dk, dv = jax.lax.fori_loop(q_lo[kj], q_hi[kj], step, (dq_t, zeros, zeros))
        return dq_t, (dk, dv)

    dq_t = jnp.zeros((b, kv, h, g, tq), jnp.float32)  # dq transposed, [B, K, H, G, Tq]
    dq_t, (dk, dv) = jax.lax.scan(dkv_block, dq_t, jnp.arange(nk))  # dk, dv [nk, B, K, C, H]
    dq = jnp.einsum("bkhgq->bkgqh", dq_t).astype(q.dtype)
    dk = jnp.moveaxis(dk, 0, 2).reshape(k.shape).astype(k.dtype)
    dv = jnp.moveaxis(dv, 0, 2).reshape(v.shape).astype(v.dtype)
    return dq, dk, dv


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, seg, bq: int, bk: int, by_segment: bool):
    return _forward(q, k, v, seg, bq, bk, by_segment)[0]


def _flash_fwd(q, k, v, seg, bq, bk, by_segment):
    out, lse = _forward(q, k, v, seg, bq, bk, by_segment)
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(bq, bk, by_segment, residuals, dout):
    q, k, v, seg, out, lse = residuals
    dq, dk, dv = _backward(q, k, v, seg, out, lse, dout, bq, bk, by_segment)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def blockwise_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    segment_ids: Int[Array, "B T"],
    *,
    block_q: int = 512,
    block_kv: int = 512,
) -> Float[Array, "B T N H"]:
    """Memory-efficient causal self-attention, equal to the plain one (see module doc).

    The length is padded up to a multiple of each block size with segment 0 (masked), so any
    T works; blocks larger than T shrink to T.
    """
    b, t, n, h = q.shape
    kv = k.shape[2]
    if k.shape[1] != t:
        raise ValueError(f"blockwise attention is self-attention: T={t} but S={k.shape[1]}")
    for name, value in (("block_q", block_q), ("block_kv", block_kv)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    bq, bk = min(block_q, t), min(block_kv, t)
    tp = math.lcm(bq, bk)  # pad the length to a multiple of both block sizes
    scale = jnp.asarray(h**-0.5, dtype=q.dtype)
    qg = (q * scale).reshape(b, t, kv, n // kv, h)
    qg = _pad_to(jnp.einsum("btkgh->bkgth", qg), 3, tp)  # [B, K, G, Tp, H]
    kp = _pad_to(jnp.einsum("bskh->bksh", k), 2, tp)  # [B, K, Tp, H]
    vp = _pad_to(jnp.einsum("bskh->bksh", v), 2, tp)  # [B, K, Tp, H]
    seg = _pad_to(segment_ids.astype(jnp.int32), 1, tp)  # [B, Tp], padding = segment 0
    out = _flash(qg, kp, vp, seg, bq, bk, True)  # [B, K, G, Tp, H]
    return jnp.einsum("bkgth->btkgh", out[:, :, :, :t]).reshape(b, t, n, h)


# ---- jax.nn.dot_product_attention (cuDNN on GPU) -------------------------------------------------
def dot_product_attention(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B S K H"],
    v: Float[Array, "B S K H"],
    segment_ids: Int[Array, "B T"],
    *,
    implementation: Literal["cudnn", "xla"] = "cudnn",
) -> Float[Array, "B T N H"]:
    """``jax.nn.dot_product_attention`` with the segment mask; padding queries -> 0.

    ``implementation="cudnn"`` needs a GPU (raises ValueError otherwise, never falls back);
    ``"xla"`` is the same call with XLA's kernel (CPU tests of this path).
    """
    if implementation not in ("cudnn", "xla"):
        raise ValueError(f"implementation must be 'cudnn' or 'xla', got {implementation!r}")
    if implementation == "cudnn" and jax.default_backend() != "gpu":
        raise ValueError(
            "attention='cudnn' needs a GPU (cuDNN flash attention), but the default JAX backend "
            f"is {jax.default_backend()!r}; use attention='blockwise' or 'plain'"
        )
    mask = L.causal_mask(segment_ids)[:, None]  # [B, 1, T, S]
    out = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation=implementation)
    real = _has_visible_key(segment_ids)[:, :, None, None]  # [B, T, 1, 1]
    return jnp.where(real, out, 0).astype(q.dtype)


# ---- dispatch ------------------------------------------------------------------------------------
AttentionCore = Callable[[Array, Array, Array], Array]


def self_attention(
    segment_ids: Int[Array, "B T"],
    implementation: AttentionImpl = "plain",
    *,
    block_q: int = 512,
    block_kv: int = 512,
) -> AttentionCore:
    """``(q [B,T,N,H], k [B,T,K,H], v [B,T,K,H]) -> [B,T,N,H]``: causal self-attention within
    the segments of ``segment_ids`` by the named implementation (all equal). The plain one's
    dense [B, T, T] mask is built here, once for every layer that calls the result."""
    if implementation == "plain":
        return functools.partial(
            L.attention, mask=L.causal_mask(segment_ids), causal_block=PLAIN_CAUSAL_BLOCK
        )
    if implementation == "blockwise":
        return functools.partial(
            blockwise_attention, segment_ids=segment_ids, block_q=block_q, block_kv=block_kv
        )
    if implementation == "cudnn":
        return functools.partial(dot_product_attention, segment_ids=segment_ids)
    raise ValueError(
        f"attention implementation must be one of {choices(AttentionImpl)}, got {implementation!r}"
    )


def attend(
    q: Float[Array, "B T N H"],
    k: Float[Array, "B T K H"],
    v: Float[Array, "B T K H"],
    segment_ids: Int[Array, "B T"],
    *,
    implementation: AttentionImpl = "plain",
    block_q: int = 512,
    block_kv: int = 512,
) -> Float[Array, "B T N H"]:
    """`self_attention` applied once."""
    core = self_attention(segment_ids, implementation, block_q=block_q, block_kv=block_kv)
    return core(q, k, v)
