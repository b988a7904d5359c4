"""The embedded rollout engine: an in-process JAX sampler for small models and CPU runs.

Same interface as the vLLM engine (`RolloutEngine`). Prompts are expanded to prompts x n rows,
left-padded to a bucketed length, prefilled, then decoded in segments of growing length, each
one jitted `lax.while_loop` over a cache just long enough for it (`segment_bounds`). Each
sampled token's behaviour log-prob is that of the distribution it was drawn from
(`sampling.processed_logits`) and carries the engine's policy version. Deterministic: token i
of a call is drawn with `fold_in(key(seed), i)`. Programs are keyed by shapes and filter
switches only; the weights are held once, in the decode layout. docs/rollout.md, "The
embedded JAX engine", has the details and the measurements.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Bool, Int

from bapo_jax.models import decode
from bapo_jax.models.forward import KVCache, grow_cache
from bapo_jax.models.qwen2 import Qwen2ForCausalLM
from bapo_jax.rollout import cpu_kernels as cpu_kernels_lib
from bapo_jax.rollout import sampling as sampling_lib
from bapo_jax.rollout.types import (
    Rollout,
    Sample,
    SamplingParams,
    SyncTimings,
    check_update_args,
    validate_prompts,
)

_UNSUPPORTED_DEFAULTS = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 0,
}
ROW_MULTIPLE = 8  # rows are padded up to a multiple of this (one program for 1..8 rows, ...)
STOP_IDS_MULTIPLE = 8  # the stop-id table is padded with -1 to a multiple of this
FIRST_SEGMENT = 32  # new tokens of the first segment; segments double up to LINEAR_SEGMENT
LINEAR_SEGMENT = 512  # ... then grow by this many tokens each


def _bucket(length: int, multiple: int) -> int:
    return -(-length // multiple) * multiple


def segment_bounds(max_tokens: int) -> tuple[int, ...]:
    """Cumulative new-token bounds b_0 < b_1 < ... with b_last >= max_tokens.

    32, 64, 128, 256, 512, then every 512: the same list prefix for every budget, so calls with
    different `max_tokens` share their segment programs.
    """
    bounds = [FIRST_SEGMENT]
    while bounds[-1] < max_tokens:
        last = bounds[-1]
        bounds.append(last * 2 if last < LINEAR_SEGMENT else last + LINEAR_SEGMENT)
    return tuple(bounds)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """What one segment hands the next: the cache and per-row progress.

    token: last sampled token [R] (fed at the next step); positions: its position [R];
    lengths: tokens sampled while live [R]; done: stopped (or padding) rows [R];
    step: tokens sampled so far (scalar).
    """

    cache: KVCache
    token: Int[Array, " R"]
    positions: Int[Array, " R"]
    lengths: Int[Array, " R"]
    done: Bool[Array, " R"]
    step: Int[Array, ""]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TokenChoice:
    """How a call picks its tokens: token i is drawn from `choice`'s processed logits with
    `fold_in(key, i)` (greedy, a static switch: their argmax); a row stops at one of
    `stop_ids` (padded with -1) or after `max_new` tokens."""

    key: Array
    choice: sampling_lib.SamplingArrays
    stop_ids: Int[Array, " S"]
    max_new: Int[Array, ""]
    greedy: bool = dataclasses.field(metadata=dict(static=True))

    def __call__(self, logits, step) -> tuple:
        if self.greedy:
            return sampling_lib.greedy_tokens(logits, self.choice)
        return sampling_lib.sample_tokens(logits, jax.random.fold_in(self.key, step), self.choice)


@dataclasses.dataclass(frozen=True)
class PendingUpdate:
    """`begin_update`'s handle: the version and its params, copied in `copy_s` seconds."""

    version: int
    params: nnx.State
    copy_s: float


class EmbeddedEngine:
    """In-process sampler over a `Qwen2ForCausalLM`: a `RolloutEngine` and its own
    `WeightUpdater`.

    eos_token_ids: ids that end a sample (unless `SamplingParams.ignore_eos`).
    pad_token_id: id written into left padding and after a row stops (never attended).
    length_bucket: prompt lengths are padded up to a multiple of this, so prompts of similar
      length reuse one compiled program.
    cpu_kernels: decode with the CPU kernels (`cpu_kernels.PanelKernels`) when they can serve
      the model (fp32 on one CPU device); False: XLA's own dots (`decode.ColumnBlocks`).
    """

    def __init__(
        self,
        model: Qwen2ForCausalLM,
        *,
        eos_token_ids: Sequence[int],
        pad_token_id: int = 0,
        version: int = 0,
        length_bucket: int = 32,
        cpu_kernels: bool = True,
    ):
        self._graphdef, self._params = nnx.split(model)
        self._weights: decode.DecodeWeights | None = None
        self._eos = tuple(int(i) for i in eos_token_ids)
        self._pad = int(pad_token_id)
        self._version = int(version)
        if length_bucket < 1:
            raise ValueError(f"length_bucket must be >= 1, got {length_bucket}")
        self._bucket = length_bucket
        self._cpu_kernels = bool(cpu_kernels)

    restarted: tuple[str, ...] = ()  # no servers to restart

    @property
    def policy_version(self) -> int:
        return self._version

    def server_versions(self) -> dict[str, dict[str, Any]]:
        return {}  # no servers

    def begin_update(self, version: int, params: nnx.State, *, step: int = 0) -> PendingUpdate:
        """A private copy of `params` (the trainer's `TrainState.params`: the next train step
        donates their buffers); the engine samples from its old weights until
        `finish_update`."""
        check_update_args(version, step)
        t0 = time.perf_counter()
        copy = jax.block_until_ready(jax.tree.map(jnp.copy, params))
        return PendingUpdate(int(version), copy, time.perf_counter() - t0)

    def finish_update(
        self, handle: PendingUpdate, generating_until: float | None = None
    ) -> SyncTimings:
        """Sample from the copied params as policy `handle.version` from now on."""
        self._params, self._weights, self._version = handle.params, None, handle.version
        return SyncTimings(
            write_s=0.0,
            load_s=handle.copy_s,
            write_hidden_s=0.0,
            load_hidden_s=0.0,
            attempts=1,
            server_version=self._version,
        )

    def update_weights(self, version: int, params: nnx.State, *, step: int = 0) -> SyncTimings:
        return self.finish_update(self.begin_update(version, params, step=step))

    @property
    def decode_weights(self) -> decode.DecodeWeights:
        """The weights as the engine decodes with them (`decode.decode_weights`; the CPU kernels'
        panels when they serve this model: `cpu_kernels.decode_ops`)."""
        if self._weights is None:
            dtype = nnx.merge(self._graphdef, self._params).options.compute_dtype
            ops = cpu_kernels_lib.decode_ops(self._params, dtype, cpu_kernels=self._cpu_kernels)
            self._weights = _prepare_weights(self._graphdef, self._params, ops)
            self._params = None  # the decode layout is the engine's only copy
        return self._weights

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
        num_rows = _bucket(len(rows), ROW_MULTIPLE)
        width = _bucket(max(len(p) for p in rows), self._bucket)
        ids = np.full((num_rows, width), self._pad, np.int32)  # [R, P] left-padded
        mask = np.zeros((num_rows, width), np.int32)  # [R, P]; all-zero rows are padding
        for r, p in enumerate(rows):
            ids[r, width - len(p) :] = p
            mask[r, width - len(p) :] = 1
        stop = sorted(set(sampling.stop_token_ids) | set(() if sampling.ignore_eos else self._eos))
        stop_ids = np.full((_bucket(max(len(stop), 1), STOP_IDS_MULTIPLE),), -1, np.int32)
        stop_ids[: len(stop)] = stop
        pick = TokenChoice(
            key=jax.random.key(seed),
            choice=sampling_lib.SamplingArrays.from_params(sampling),
            stop_ids=jnp.asarray(stop_ids),
            max_new=jnp.asarray(sampling.max_tokens, jnp.int32),
            greedy=greedy,
        )
        weights = self.decode_weights
        bounds = segment_bounds(sampling.max_tokens)
        valid = jnp.asarray(np.arange(num_rows) < len(rows))
        state, tokens, logps = _first_segment(
            weights, jnp.asarray(ids), jnp.asarray(mask), valid, pick, end=bounds[0]
        )
        chunks = [(tokens, logps)]
        for start, end in itertools.pairwise(bounds):
            if bool(jnp.all(state.done)) or start >= sampling.max_tokens:
                break
            state, tokens, logps = _next_segment(weights, state, pick, start=start, end=end)
            chunks.append((tokens, logps))
        chunks, lengths, stopped = jax.device_get((chunks, state.lengths, state.done))
        tokens = np.concatenate([t for t, _ in chunks], axis=1)  # [R, >= max_tokens]
        logps = np.concatenate([lp for _, lp in chunks], axis=1)
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


@functools.partial(jax.jit, static_argnums=(0, 2))
def _prepare_weights(graphdef, params, ops: decode.DecodeOps) -> decode.DecodeWeights:
    return decode.decode_weights(nnx.merge(graphdef, params), ops)


def _record(state: DecodeState, token, logp, chunk, start: int, stop_ids) -> tuple:
    """Writes step `state.step`'s token into the chunk (0 for stopped rows); advances state."""
    tokens, logps = chunk
    live = ~state.done
    col = state.step - start
    tokens = jax.lax.dynamic_update_slice_in_dim(tokens, jnp.where(live, token, 0)[:, None], col, 1)
    logps = jax.lax.dynamic_update_slice_in_dim(logps, jnp.where(live, logp, 0.0)[:, None], col, 1)
    hit_stop = jnp.any(token[:, None] == stop_ids[None, :], axis=-1)  # [R]
    state = dataclasses.replace(
        state,
        token=token,
        lengths=state.lengths + live.astype(jnp.int32),
        done=state.done | (live & hit_stop),
        step=state.step + 1,
    )
    return state, (tokens, logps)


def _decode_loop(weights, state: DecodeState, chunk, start: int, end: int, pick) -> tuple:
    """Steps state.step .. min(end, max_new) - 1, stopping early once every row is done."""
    limit = jnp.minimum(end, pick.max_new)

    def cond(carry):
        state, _ = carry
        return (state.step < limit) & ~jnp.all(state.done)

    def body(carry):
        state, chunk = carry
        logits, cache = decode.decode_step(weights, state.token, state.positions, state.cache)
        token, logp = pick(logits, state.step)
        state = dataclasses.replace(state, cache=cache, positions=state.positions + 1)
        return _record(state, token, logp, chunk, start, pick.stop_ids)

    return jax.lax.while_loop(cond, body, (state, chunk))


def _empty_chunk(rows: int, size: int):
    return jnp.zeros((rows, size), jnp.int32), jnp.zeros((rows, size), jnp.float32)  # [R, C]


@functools.partial(jax.jit, static_argnames=("end",))
def _first_segment(weights, ids, mask, row_valid, pick: TokenChoice, *, end):
    """Prefill, sample token 0, decode up to bound `end` over a cache of P + end slots.

    Returns the state and this segment's tokens / log-probs [R, end]."""
    rows, width = ids.shape
    logits, positions, cache = decode.prefill(weights, ids, mask, width + end)
    zeros = jnp.zeros((rows,), jnp.int32)
    state = DecodeState(cache, zeros, positions, zeros, ~row_valid, jnp.zeros((), jnp.int32))
    token, logp = pick(logits, state.step)
    state, chunk = _record(state, token, logp, _empty_chunk(rows, end), 0, pick.stop_ids)
    state, (tokens, logps) = _decode_loop(weights, state, chunk, 0, end, pick)
    return state, tokens, logps


@functools.partial(jax.jit, static_argnames=("start", "end"))
def _next_segment(weights, state, pick: TokenChoice, *, start, end):
    """Grows the cache by end - start slots and decodes tokens [start, end) (fewer at max_new
    or once all rows are done). Returns the state and this segment's tokens / log-probs."""
    length = state.cache.key_valid.shape[1] + end - start
    state = dataclasses.replace(state, cache=grow_cache(state.cache, length))
    chunk = _empty_chunk(state.token.shape[0], end - start)
    state, (tokens, logps) = _decode_loop(weights, state, chunk, start, end, pick)
    return state, tokens, logps
