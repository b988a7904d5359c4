"""Token log-probabilities and entropies without materialising the [B, T, V] logits.

For final hidden states h [B, T, D], the unembedding W [V, D] (HF layout) and a sampling
temperature tau, per position (b, t) with target token y:

    z    = h W^T / tau                              logits, [B, T, V], fp32
    lse  = log sum_v exp(z_v)                       fp32 logsumexp, [B, T]
    logp = z[y] - lse                               log-prob of the target, [B, T]
    H    = -sum_v p_v log p_v,  p = exp(z - lse)    entropy, [B, T]

Tiling. The sequence is processed in chunks of `chunk_size` positions (`lax.map` / `lax.scan`
over T; B stays a batch dimension, so a data-sharded batch stays local), and within a chunk
the vocabulary in blocks of `vocab_block_size` rows of W (`lax.fori_loop`, plus one static
partial block when V is not a multiple). Only a [B, chunk, block] tile of logits is ever live.
The forward merges per-block statistics, all finite and relative to a running max:

    m = max z,  s = sum exp(z - m),  q = sum exp(z - m) (z - m)
    merge(a, b): m = max(m_a, m_b),  s = sum_i e^(m_i - m) s_i,
                 q = sum_i e^(m_i - m) (q_i + (m_i - m) s_i)
    lse = m + log s,   H = -sum p (z - lse) = log s - q / s

Backward (`jax.custom_vjp`): the residuals are only h, W, y, lse and H; every tile's logits
are recomputed. With upstream cotangents g (of logp) and e (of H), per position:

    d logp / d z_k = 1[k = y] - p_k
    d H / d z_k    = -sum_j (log p_j + 1) p_j (1[j = k] - p_k)
                   = -p_k (log p_k + 1) + p_k (1 - H)  =  -p_k (log p_k + H)
    dz_k           = g 1[k = y] - p_k (g + e (log p_k + H))
    d(h W^T)       = dz / tau
    dh_chunk       = sum_blocks (dz / tau) W_block                  [B, C, D], fp32
    dW_block      += (dz / tau)^T h_chunk   (in place, fp32 [V, D] accumulator)

Peak memory is O(B * chunk * block + V * D + B * T * D) instead of O(B * T * V). T not
divisible by the chunk is padded with zero positions whose cotangents are zero, then sliced off.

`compute_dtype` (e.g. bf16) is the dtype of the matmul operands; matmuls accumulate in fp32
(`preferred_element_type`) and all softmax statistics are fp32. Targets outside [0, V) give NaN
log-probs (loud, never silently wrong), so padded positions need a valid id (e.g. the pad id).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Protocol

import chex
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

DEFAULT_CHUNK_SIZE = 512
DEFAULT_VOCAB_BLOCK_SIZE = 8192


@dataclasses.dataclass(frozen=True)
class _ChunkSpec:
    """Static configuration of one tiled computation (hashable, passed as a nondiff arg)."""

    temperature: float
    chunk_size: int
    vocab_block_size: int
    compute_dtype: Any
    with_entropy: bool


def _validate(hidden, unembedding, targets, temperature) -> None:
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [B, T, D], got shape {hidden.shape}")
    if unembedding.ndim != 2:
        raise ValueError(f"unembedding must be [V, D], got shape {unembedding.shape}")
    if hidden.shape[-1] != unembedding.shape[-1]:
        raise ValueError(
            f"hidden D={hidden.shape[-1]} must equal unembedding D={unembedding.shape[-1]}"
        )
    if targets.shape != hidden.shape[:2]:
        raise ValueError(f"targets must be [B, T]={hidden.shape[:2]}, got shape {targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"targets must be integer token ids, got dtype {targets.dtype}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a Python float, got {type(temperature).__name__}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")


def _validate_block(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _logits(h: Float[Array, "B C D"], w: Float[Array, "V D"], temperature: float):
    logits = jnp.einsum("BCD,VD->BCV", h, w, preferred_element_type=jnp.float32)  # [B, C, V]
    return logits if temperature == 1.0 else logits / temperature


def _to_chunks(x: jax.Array, num_chunks: int, chunk: int) -> jax.Array:
    """[B, T, ...] -> [num_chunks, B, chunk, ...], zero-padding T to num_chunks * chunk."""
    batch, length = x.shape[:2]
    pad = num_chunks * chunk - length
    if pad:
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(batch, num_chunks, chunk, *x.shape[2:]), 1, 0)


def _from_chunks(x: jax.Array, length: int) -> jax.Array:
    """[num_chunks, B, chunk, ...] -> [B, T, ...], dropping the padding."""
    num_chunks, batch, chunk = x.shape[:3]
    x = jnp.moveaxis(x, 0, 1).reshape(batch, num_chunks * chunk, *x.shape[3:])
    return x[:, :length]


def _sequence_chunks(spec: _ChunkSpec, length: int) -> tuple[int, int]:
    chunk = min(spec.chunk_size, length)
    return -(-length // chunk), chunk


def _vocab_blocks(spec: _ChunkSpec, vocab: int) -> tuple[int, int, int]:
    """(block size, number of full blocks, size of the final partial block or 0)."""
    block = min(spec.vocab_block_size, vocab)
    return block, vocab // block, vocab % block


def _operand_dtype(spec: _ChunkSpec, hidden, unembedding):
    if spec.compute_dtype is not None:
        return spec.compute_dtype
    return jnp.promote_types(hidden.dtype, unembedding.dtype)


class _SoftmaxStats(NamedTuple):
    """Running softmax statistics ([B, C] each) over the vocab blocks seen so far.

    m = max z;  s = sum exp(z - m);  q = sum exp(z - m) (z - m);  picked = z[target] (0 if the
    target was not in a seen block). Then lse = m + log s and H = log s - q / s.
    """

    m: jax.Array
    s: jax.Array
    q: jax.Array
    picked: jax.Array


def _block_stats(logits: Float[Array, "B C V"], local_targets: Int[Array, "B C"]) -> _SoftmaxStats:
    block = logits.shape[-1]
    m = jnp.max(logits, axis=-1)  # [B, C]
    shifted = logits - m[..., None]  # [B, C, Vb], <= 0
    e = jnp.exp(shifted)
    in_block = (local_targets >= 0) & (local_targets < block)
    index = jnp.clip(local_targets, 0, block - 1)[..., None]
    picked = jnp.where(in_block, jnp.take_along_axis(logits, index, axis=-1)[..., 0], 0.0)
    return _SoftmaxStats(m, jnp.sum(e, axis=-1), jnp.sum(e * shifted, axis=-1), picked)


def _merge(a: _SoftmaxStats, b: _SoftmaxStats) -> _SoftmaxStats:
    """Stats of the union of two disjoint vocab ranges (all terms finite)."""
    m = jnp.maximum(a.m, b.m)
    scale_a, scale_b = jnp.exp(a.m - m), jnp.exp(b.m - m)
    s = scale_a * a.s + scale_b * b.s
    q = scale_a * (a.q + (a.m - m) * a.s) + scale_b * (b.q + (b.m - m) * b.s)
    return _SoftmaxStats(m, s, q, a.picked + b.picked)


def _forward(spec: _ChunkSpec, hidden, unembedding, targets):
    """logp, lse and entropy [B, T], looping over sequence chunks and vocab blocks."""
    length = hidden.shape[1]
    vocab = unembedding.shape[0]
    num_chunks, chunk = _sequence_chunks(spec, length)
    block, full_blocks, tail = _vocab_blocks(spec, vocab)
    dtype = _operand_dtype(spec, hidden, unembedding)
    w = unembedding.astype(dtype)

    def stats_of(h_c, t_c, start, size):
        w_b = jax.lax.dynamic_slice_in_dim(w, start, size, axis=0)  # [Vb, D]
        return _block_stats(_logits(h_c, w_b, spec.temperature), t_c - start)

    def one_chunk(xs):
        h_c, t_c = xs  # [B, C, D], [B, C]
        h_c = h_c.astype(dtype)
        stats = stats_of(h_c, t_c, 0, block)
        stats = jax.lax.fori_loop(
            1, full_blocks, lambda i, st: _merge(st, stats_of(h_c, t_c, i * block, block)), stats
        )
        if tail:
            stats = _merge(stats, stats_of(h_c, t_c, full_blocks * block, tail))
        log_s = jnp.log(stats.s)
        lse = stats.m + log_s  # [B, C] fp32
        in_range = (t_c >= 0) & (t_c < vocab)
        logp = jnp.where(in_range, stats.picked - lse, jnp.nan)
        return logp, lse, log_s - stats.q / stats.s

    xs = (_to_chunks(hidden, num_chunks, chunk), _to_chunks(targets, num_chunks, chunk))
    outputs = jax.lax.map(one_chunk, xs)  # each [num_chunks, B, C]
    return tuple(_from_chunks(x, length) for x in outputs)


def _outputs(spec: _ChunkSpec, logp, ent):
    return (logp, ent) if spec.with_entropy else (logp,)


def _chunked_logprobs_primal(spec, hidden, unembedding, targets):
    logp, _, ent = _forward(spec, hidden, unembedding, targets)
    return _outputs(spec, logp, ent)


def _chunked_logprobs_fwd(spec, hidden, unembedding, targets):
    logp, lse, ent = _forward(spec, hidden, unembedding, targets)
    return _outputs(spec, logp, ent), (hidden, unembedding, targets, lse, ent)


def _chunked_logprobs_bwd(spec, residuals, cotangents):
    hidden, unembedding, targets, lse, ent = residuals
    g_logp = cotangents[0].astype(jnp.float32)
    g_ent = cotangents[1].astype(jnp.float32) if spec.with_entropy else jnp.zeros_like(g_logp)
    batch, length, dim = hidden.shape
    vocab = unembedding.shape[0]
    num_chunks, chunk = _sequence_chunks(spec, length)
    block, full_blocks, tail = _vocab_blocks(spec, vocab)
    dtype = _operand_dtype(spec, hidden, unembedding)
    w = unembedding.astype(dtype)
    inv_temperature = 1.0 / spec.temperature

    def one_chunk(d_w, xs):
        h_c, t_c, lse_c, ent_c, g_c, e_c = xs  # [B, C, D], then [B, C] each
        h_c = h_c.astype(dtype)
        g, e = g_c[..., None], e_c[..., None]

        def one_block(start, size, carry):
            d_w, d_h = carry
            w_b = jax.lax.dynamic_slice_in_dim(w, start, size, axis=0)  # [Vb, D]
            log_p = _logits(h_c, w_b, spec.temperature) - lse_c[..., None]  # [B, C, Vb]
            p = jnp.exp(log_p)
            scale = g + e * (log_p + ent_c[..., None])
            is_target = jnp.arange(size) + start == t_c[..., None]  # [B, C, Vb]
            d_logits = (jnp.where(is_target, g, 0.0) - p * scale) * inv_temperature
            d_logits = d_logits.astype(dtype)  # [B, C, Vb]
            d_h = d_h + jnp.einsum("BCV,VD->BCD", d_logits, w_b, preferred_element_type=jnp.float32)
            # dW over one token axis (B*C): contracting (B, C) made XLA:CPU write a transposed
            # copy of d_logits first (see `layers._tokens`).
            d_w_b = jnp.einsum(
                "TV,TD->VD",
                d_logits.reshape(-1, size),
                h_c.reshape(-1, dim),
                preferred_element_type=jnp.float32,
            )
            d_w_b = d_w_b + jax.lax.dynamic_slice_in_dim(d_w, start, size, axis=0)
            return jax.lax.dynamic_update_slice_in_dim(d_w, d_w_b, start, axis=0), d_h

        carry = (d_w, jnp.zeros((batch, chunk, dim), jnp.float32))  # d_h: [B, C, D]
        carry = jax.lax.fori_loop(
            0, full_blocks, lambda i, c: one_block(i * block, block, c), carry
        )
        if tail:
            carry = one_block(full_blocks * block, tail, carry)
        return carry

    xs = tuple(_to_chunks(x, num_chunks, chunk) for x in (hidden, targets, lse, ent, g_logp, g_ent))
    d_w0 = jnp.zeros((vocab, dim), jnp.float32)  # [V, D] fp32 accumulator
    d_w, d_h = jax.lax.scan(one_chunk, d_w0, xs)  # d_h: [num_chunks, B, C, D]
    d_h = _from_chunks(d_h, length)
    return d_h.astype(hidden.dtype), d_w.astype(unembedding.dtype), None


_chunked_logprobs = jax.custom_vjp(_chunked_logprobs_primal, nondiff_argnums=(0,))
_chunked_logprobs.defvjp(_chunked_logprobs_fwd, _chunked_logprobs_bwd)
# Jitted so eager calls compile the loops once per shape instead of dispatching op by op.
_jitted_chunked_logprobs = jax.jit(_chunked_logprobs, static_argnums=0)


def token_logprobs(
    hidden: Float[Array, "B T D"],
    unembedding: Float[Array, "V D"],
    targets: Int[Array, "B T"],
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_block_size: int = DEFAULT_VOCAB_BLOCK_SIZE,
    compute_dtype: Any = None,
    return_entropy: bool = True,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"] | None]:
    """Log-prob of each target token and the entropy at each position, tiled (see module doc).

    Args:
      hidden: final-normed hidden states [B, T, D].
      unembedding: LM head / tied embedding [V, D] (HF layout).
      targets: token ids [B, T] in [0, V) whose log-probs are wanted (callers shift: the target
        at position t is the token at t + 1). Out-of-range ids give NaN.
      temperature: Python float > 0; logits are divided by it (the sampling temperature).
      chunk_size: sequence positions per chunk.
      vocab_block_size: vocabulary rows per block; the fp32 logits tile is
        B * chunk_size * vocab_block_size * 4 bytes, in forward and backward.
      compute_dtype: matmul operand dtype (e.g. jnp.bfloat16); None = promote(hidden, W).
      return_entropy: if False, the entropy is not returned (None) and gets no gradient.

    Returns:
      (logp [B, T] fp32, entropy [B, T] fp32 or None). Differentiable w.r.t. hidden and
      unembedding through the memory-bounded custom backward.
    """
    hidden, unembedding, targets = map(jnp.asarray, (hidden, unembedding, targets))
    _validate(hidden, unembedding, targets, temperature)
    _validate_block("chunk_size", chunk_size)
    _validate_block("vocab_block_size", vocab_block_size)
    batch, length, _ = hidden.shape
    spec = _ChunkSpec(
        float(temperature), chunk_size, vocab_block_size, compute_dtype, bool(return_entropy)
    )
    if batch * length == 0:
        empty = jnp.zeros((batch, length), jnp.float32)
        return empty, (empty if return_entropy else None)
    outputs = _jitted_chunked_logprobs(spec, hidden, unembedding, targets)
    logp = outputs[0]  # [B, T] fp32
    entropy = outputs[1] if return_entropy else None  # [B, T] fp32
    chex.assert_shape(logp, (batch, length))
    return logp, entropy


def full_token_logprobs(
    hidden: Float[Array, "B T D"],
    unembedding: Float[Array, "V D"],
    targets: Int[Array, "B T"],
    *,
    temperature: float = 1.0,
    compute_dtype: Any = None,
    return_entropy: bool = True,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"] | None]:
    """Reference: the same quantities from the whole [B, T, V] logits, differentiated by JAX."""
    hidden, unembedding, targets = map(jnp.asarray, (hidden, unembedding, targets))
    _validate(hidden, unembedding, targets, temperature)
    dtype = compute_dtype or jnp.promote_types(hidden.dtype, unembedding.dtype)
    logits = jnp.einsum(
        "BTD,VD->BTV",
        hidden.astype(dtype),
        unembedding.astype(dtype),
        preferred_element_type=jnp.float32,
    )  # [B, T, V] fp32
    log_probs = jax.nn.log_softmax(logits / temperature, axis=-1)  # [B, T, V]
    vocab = log_probs.shape[-1]
    in_range = (targets >= 0) & (targets < vocab)
    picked = jnp.take_along_axis(log_probs, jnp.clip(targets, 0, vocab - 1)[..., None], axis=-1)
    logp = jnp.where(in_range, picked[..., 0], jnp.nan)
    if not return_entropy:
        return logp, None
    return logp, -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


class HiddenStateModel(Protocol):
    """What `model_token_logprobs` needs from a model."""

    def hidden_states(self, input_ids, attention_mask=None, positions=None) -> jax.Array: ...

    def unembedding(self) -> jax.Array: ...


def model_token_logprobs(
    model: HiddenStateModel,
    input_ids: Int[Array, "B T"],
    attention_mask: Int[Array, "B T"] | None,
    targets: Int[Array, "B T"],
    *,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_block_size: int = DEFAULT_VOCAB_BLOCK_SIZE,
    compute_dtype: Any = None,
    return_entropy: bool = True,
) -> tuple[Float[Array, "B T"], Float[Array, "B T"] | None]:
    """`token_logprobs` on `model.hidden_states(input_ids, attention_mask)` and
    `model.unembedding()`; padded positions are not masked here (mask them in the loss)."""
    hidden = model.hidden_states(input_ids, attention_mask=attention_mask)  # [B, T, D]
    return token_logprobs(
        hidden,
        model.unembedding(),
        targets,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_block_size=vocab_block_size,
        compute_dtype=compute_dtype,
        return_entropy=return_entropy,
    )
