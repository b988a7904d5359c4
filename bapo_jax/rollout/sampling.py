"""Token sampling from logits: temperature, top-k, top-p, min-p, and the processed log-prob.

The behaviour log-prob reported for a sampled token is that of the distribution it was
actually drawn from (vLLM's `processed_logprobs`):

    z' = z / tau,  then tokens outside top-k / the top-p nucleus / below min_p * p_max get -inf,
    logp(y) = log_softmax(z')[y].

With top_p = 1, top_k = 0, min_p = 0 (training rollouts) this is log_softmax(z / tau)[y], the
quantity the trainer recomputes. The filters are static Python choices, so a disabled filter
costs nothing in the compiled program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from bapo_jax.rollout.types import SamplingParams

NEG_INF = -jnp.inf


def processed_logits(logits: Float[Array, "R V"], params: SamplingParams) -> Float[Array, "R V"]:
    """Temperature-scaled logits with the truncation filters applied (-inf outside)."""
    z = logits.astype(jnp.float32) / params.temperature  # [R, V]
    if params.top_k > 0 and params.top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, params.top_k)[0][:, -1:]  # [R, 1]
        z = jnp.where(z >= kth, z, NEG_INF)
    if params.top_p < 1.0:
        order = jnp.argsort(-z, axis=-1)  # [R, V] descending
        sorted_z = jnp.take_along_axis(z, order, axis=-1)
        probs = jax.nn.softmax(sorted_z, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # [R, V]
        keep_sorted = mass_before < params.top_p  # the top token is always kept
        keep = (
            jnp.zeros_like(keep_sorted).at[jnp.arange(z.shape[0])[:, None], order].set(keep_sorted)
        )
        z = jnp.where(keep, z, NEG_INF)
    if params.min_p > 0.0:
        log_p = jax.nn.log_softmax(z, axis=-1)
        threshold = jnp.max(log_p, axis=-1, keepdims=True) + jnp.log(params.min_p)
        z = jnp.where(log_p >= threshold, z, NEG_INF)
    return z


def sample_tokens(
    logits: Float[Array, "R V"], key: Array, params: SamplingParams
) -> tuple[Int[Array, " R"], Float[Array, " R"]]:
    """One categorical draw per row and its processed log-prob."""
    z = processed_logits(logits, params)  # [R, V]
    tokens = jax.random.categorical(key, z, axis=-1).astype(jnp.int32)  # [R]
    logp = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logp


def greedy_tokens(logits: Float[Array, "R V"], params: SamplingParams):
    """argmax and its processed log-prob (at the params' temperature)."""
    z = processed_logits(logits, params)
    tokens = jnp.argmax(z, axis=-1).astype(jnp.int32)
    logp = jnp.take_along_axis(jax.nn.log_softmax(z, axis=-1), tokens[:, None], axis=-1)[:, 0]
    return tokens, logp
