"""The embedded rollout engine: an in-process JAX sampler for small models and CPU runs.

Same interface as the vLLM engine (`RolloutEngine`). One `generate` call expands the prompts to
prompts x n rows, left-pads them to a bucketed length, prefills a KV cache, then decodes inside
one jitted `lax.while_loop` (no host round-trip per token) until every row has stopped or
`max_tokens` is reached. Each sampled token's behaviour log-prob is that of the distribution it
was drawn from (`sampling.processed_logits`); every token carries the engine's policy version.
Deterministic: the same weights, prompts, params and seed give the same samples.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bapo_jax.models import decode
from bapo_jax.models.qwen2 import Qwen2ForCausalLM
from bapo_jax.rollout import sampling as sampling_lib
from bapo_jax.rollout.types import Rollout, Sample, SamplingParams, validate_prompts

_UNSUPPORTED_DEFAULTS = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
}


def _bucket(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


class EmbeddedEngine:
    """In-process sampler over a `Qwen2ForCausalLM`.

    eos_token_ids: ids that end a sample (unless `SamplingParams.ignore_eos`).
    pad_token_id: id written into left padding and after a row stops (never attended).
    length_bucket: prompt lengths are padded up to a multiple of this, so prompts of similar
      length reuse one compiled program.
    """

    def __init__(
        self,
        model: Qwen2ForCausalLM,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int = 0,
        version: int = 0,
        length_bucket: int = 32,
    ):
        self._graphdef, self._params = nnx.split(model)
        self._eos = tuple(int(i) for i in eos_token_ids)
        self._pad = int(pad_token_id)
        self._version = int(version)
        if length_bucket < 1:
            raise ValueError(f"length_bucket must be >= 1, got {length_bucket}")
        self._bucket = length_bucket

    @property
    def policy_version(self) -> int:
        return self._version

    def update_weights(
        self, version: int, checkpoint: str | None = None, *, params: nnx.State | None = None
    ) -> None:
        """Sample from `params` (the trainer's `TrainState.params`) as policy `version` from now
        on. In process no checkpoint is needed; `checkpoint` is refused to avoid a silent no-op."""
        if checkpoint is not None:
            raise ValueError("EmbeddedEngine.update_weights takes params=, not a checkpoint path")
        if params is None:
            raise ValueError("EmbeddedEngine.update_weights needs params=")
        self._params = params
        self._version = int(version)

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seed: int,
        *,
        greedy: bool = False,
    ) -> Rollout:
        """`n` samples per prompt (greedy=True: argmax decoding, for evaluation)."""
        prompts = validate_prompts(prompt_ids, n)
        for name, default in _UNSUPPORTED_DEFAULTS.items():
            if getattr(sampling, name) != default:
                raise ValueError(
                    f"SamplingParams.{name}={getattr(sampling, name)!r} is not supported by the "
                    f"embedded engine (only {default!r})"
                )
        rows = [p for p in prompts for _ in range(n)]
        width = _bucket(max(len(p) for p in rows), self._bucket)
        ids = np.full((len(rows), width), self._pad, np.int32)  # [R, P] left-padded
        mask = np.zeros((len(rows), width), np.int32)
        for r, p in enumerate(rows):
            ids[r, width - len(p) :] = p
            mask[r, width - len(p) :] = 1
        stop_ids = tuple(
            sorted(set(sampling.stop_token_ids) | set(() if sampling.ignore_eos else self._eos))
        )
        tokens, logps, lengths, stopped = _generate(
            self._graphdef,
            self._params,
            jnp.asarray(ids),
            jnp.asarray(mask),
            jax.random.key(seed),
            sampling,
            stop_ids,
            greedy,
        )
        tokens, logps, lengths, stopped = jax.device_get((tokens, logps, lengths, stopped))
        samples = []
        for r in range(len(rows)):
            k = int(lengths[r])
            samples.append(
                Sample(
                    prompt_index=r // n,
                    sample_index=r % n,
                    token_ids=tokens[r, :k].astype(np.int32),
                    logprobs=logps[r, :k].astype(np.float32),
                    versions=np.full((k,), self._version, np.int64),
                    finish_reason="stop" if stopped[r] else "length",
                )
            )
        return Rollout(prompt_ids=prompts, n=n, samples=tuple(samples))


@functools.partial(jax.jit, static_argnums=(0, 5, 6, 7))
def _generate(graphdef, params, ids, mask, key, sampling: SamplingParams, stop_ids, greedy):
    """Prefill + `lax.while_loop` decode. Returns tokens/logps [R, M], lengths [R], stopped [R]."""
    model = nnx.merge(graphdef, params)
    rows, max_new = ids.shape[0], sampling.max_tokens
    logits, positions, cache = decode.prefill(model, ids, mask, ids.shape[1] + max_new)
    stop_table = jnp.asarray(stop_ids or (-1,), jnp.int32)

    def cond(state):
        step, *_, done, _, _, _ = state
        return (step < max_new) & ~jnp.all(done)

    def body(state):
        step, tokens, logps, lengths, done, logits, positions, cache = state
        if greedy:
            token, logp = sampling_lib.greedy_tokens(logits, sampling)
        else:
            token, logp = sampling_lib.sample_tokens(
                logits, jax.random.fold_in(key, step), sampling
            )
        live = ~done
        tokens = tokens.at[:, step].set(jnp.where(live, token, 0))
        logps = logps.at[:, step].set(jnp.where(live, logp, 0.0))
        lengths = lengths + live.astype(jnp.int32)
        hit_stop = jnp.any(token[:, None] == stop_table[None, :], axis=-1)  # [R]
        done = done | (live & hit_stop)
        logits, cache = decode.decode_step(model, token, positions, cache)
        return step + 1, tokens, logps, lengths, done, logits, positions + 1, cache

    init = (
        jnp.zeros((), jnp.int32),
        jnp.zeros((rows, max_new), jnp.int32),  # [R, M]
        jnp.zeros((rows, max_new), jnp.float32),  # [R, M]
        jnp.zeros((rows,), jnp.int32),
        jnp.zeros((rows,), jnp.bool_),
        logits,
        positions,
        cache,
    )
    _, tokens, logps, lengths, done, *_ = jax.lax.while_loop(cond, body, init)
    return tokens, logps, lengths, done
