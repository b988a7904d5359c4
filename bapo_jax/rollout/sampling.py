"""Token sampling from logits: temperature, top-k, top-p, min-p, and the processed log-prob.

The behaviour log-prob reported for a sampled token is that of the distribution it was
actually drawn from (vLLM's `processed_logprobs`):

    z' = z / tau,  then tokens outside top-k / the top-p nucleus / below min_p * p_max get -inf,
    logp(y) = z'[y] - logsumexp(z')   (= log_softmax(z')[y]).

With top_p = 1, top_k = 0, min_p = 0 (training rollouts) this is log_softmax(z / tau)[y], the
quantity the trainer recomputes. `SamplingArrays` carries tau, top_p and min_p as traced
scalars, so a compiled sampler serves every value of them; which filters run (and top_k, a
shape) are static, so a disabled filter costs nothing in the compiled program.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from bapo_jax.rollout.types import SamplingParams

NEG_INF = -jnp.inf
SAMPLING_BLOCK = 128  # vocabulary entries per block of `inverse_cdf`'s two-level search

__all__ = [
    "SamplingArrays",
    "greedy_tokens",
    "inverse_cdf",
    "processed_logits",
    "row_argmax",
    "sample_tokens",
]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingArrays:
    """The token-choice part of `SamplingParams`: values traced, filter switches static."""

    temperature: Float[Array, ""]
    top_p: Float[Array, ""]
    min_p: Float[Array, ""]
    top_k: int = dataclasses.field(metadata=dict(static=True))
    use_top_p: bool = dataclasses.field(metadata=dict(static=True))
    use_min_p: bool = dataclasses.field(metadata=dict(static=True))

    @classmethod
    def from_params(cls, params: SamplingParams) -> SamplingArrays:
        return cls(
            temperature=jnp.asarray(params.temperature, jnp.float32),
            top_p=jnp.asarray(params.top_p, jnp.float32),
            min_p=jnp.asarray(params.min_p, jnp.float32),
            top_k=params.top_k,
            use_top_p=params.top_p < 1.0,
            use_min_p=params.min_p > 0.0,
        )


def processed_logits(logits: Float[Array, "R V"], params: SamplingArrays) -> Float[Array, "R V"]:
    """Temperature-scaled logits with the truncation filters applied (-inf outside)."""
    z = logits.astype(jnp.float32) / params.temperature  # [R, V]
    if 0 < params.top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, params.top_k)[0][:, -1:]  # [R, 1]
        z = jnp.where(z >= kth, z, NEG_INF)
    if params.use_top_p:
        order = jnp.argsort(-z, axis=-1)  # [R, V] descending
        sorted_z = jnp.take_along_axis(z, order, axis=-1)
        probs = jax.nn.softmax(sorted_z, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs  # [R, V]
        keep_sorted = mass_before < params.top_p  # the top token is always kept
        keep = (
            jnp.zeros_like(keep_sorted).at[jnp.arange(z.shape[0])[:, None], order].set(keep_sorted)
        )
        z = jnp.where(keep, z, NEG_INF)
    if params.use_min_p:
        log_p = jax.nn.log_softmax(z, axis=-1)
        threshold = jnp.max(log_p, axis=-1, keepdims=True) + jnp.log(params.min_p)
        z = jnp.where(log_p >= threshold, z, NEG_INF)
    return z


def row_argmax(x: Float[Array, "R V"]) -> Int[Array, " R"]:
    """`jnp.argmax(x, -1)` (the first index of the row maximum) as two plain reductions.

    XLA's CPU argmax is one variadic (value, index) reduction that runs far slower than a max
    followed by a min over the indices where the max is attained (measured in
    `benchmarks.embedded_decode`). Rows must hold no NaN (an all -inf row gives 0, as argmax).
    """
    v = x.shape[-1]
    top = jnp.max(x, axis=-1, keepdims=True)  # [R, 1]
    index = jnp.where(x == top, jnp.arange(v, dtype=jnp.int32), v)  # [R, V]
    return jnp.minimum(jnp.min(index, axis=-1), v - 1)


def _first_above(
    cum: Float[Array, "R C"], target: Float[Array, " R"], weight: Float[Array, "R C"]
) -> Int[Array, " R"]:
    """Per row, the first c with cum[c] > target (cum non-decreasing), but never past the last
    entry of positive weight (rounding can leave target at or above the row's final sum)."""
    first = jnp.sum(cum <= target[:, None], axis=-1)  # [R]
    last = jnp.max(jnp.where(weight > 0, jnp.arange(cum.shape[-1]), 0), axis=-1)  # [R]
    return jnp.minimum(first, last).astype(jnp.int32)


def inverse_cdf(
    z: Float[Array, "R V"], u: Float[Array, " R"]
) -> tuple[Int[Array, " R"], Float[Array, " R"]]:
    """The token y whose interval of the cumulative distribution holds u in [0, 1):
    sum_{t<y} p_t <= u < sum_{t<=y} p_t with p = softmax(z) (-inf entries have p = 0 and are
    never returned); also logsumexp(z) [R], for the log-prob.

    Two levels, blocks of `SAMPLING_BLOCK` entries: a prefix sum over the blocks' masses picks
    the block, one inside it the entry, against the rest of u's mass measured from the block's
    start (so an entry is resolved against its block's mass, not the row's)."""
    r, v = z.shape
    blocks = -(-v // SAMPLING_BLOCK)
    top = jnp.max(z, axis=-1)  # [R] finite: a filter always keeps the top token
    w = jnp.exp(z - top[:, None])  # [R, V], 0 at -inf
    w = jnp.pad(w, ((0, 0), (0, blocks * SAMPLING_BLOCK - v))).reshape(r, blocks, -1)  # [R, NB, C]
    mass = jnp.sum(w, axis=-1)  # [R, NB]
    cum = jnp.cumsum(mass, axis=-1)  # [R, NB]
    target = u * cum[:, -1]  # [R]
    block = _first_above(cum, target, mass)  # [R]
    inside = jnp.take_along_axis(w, block[:, None, None], axis=1)[:, 0]  # [R, C]
    start = jnp.take_along_axis(cum - mass, block[:, None], axis=-1)[:, 0]  # [R]
    rest = jnp.maximum(target - start, 0.0)  # [R]
    entry = _first_above(jnp.cumsum(inside, axis=-1), rest, inside)  # [R]
    return block * SAMPLING_BLOCK + entry, top + jnp.log(cum[:, -1])


def sample_tokens(
    logits: Float[Array, "R V"], key: Array, params: SamplingArrays
) -> tuple[Int[Array, " R"], Float[Array, " R"]]:
    """One categorical draw per row and its processed log-prob: inverse-CDF sampling with one
    uniform per row (`inverse_cdf`). Gumbel-max would need a random number per vocabulary entry,
    a visible share of a small model's decode step on CPU (docs/rollout.md)."""
    z = processed_logits(logits, params)  # [R, V]
    tokens, log_total = inverse_cdf(z, jax.random.uniform(key, z.shape[:1]))  # [R] each
    chosen = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0]  # [R]
    return tokens, chosen - log_total


def greedy_tokens(
    logits: Float[Array, "R V"], params: SamplingArrays
) -> tuple[Int[Array, " R"], Float[Array, " R"]]:
    """argmax and its processed log-prob (at the params' temperature)."""
    z = processed_logits(logits, params)  # [R, V]
    tokens = row_argmax(z)  # [R]
    chosen = jnp.take_along_axis(z, tokens[:, None], axis=-1)[:, 0]  # [R]
    return tokens, chosen - jax.nn.logsumexp(z, axis=-1)  # log_softmax(z)[token]
