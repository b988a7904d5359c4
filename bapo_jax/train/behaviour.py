"""The trainer's side of the behaviour log-probs: how far the engine's numbers are from its own.

An engine reports, for every token it samples, log pi_behaviour(y_t) (`rollout.types`). The
trainer takes its loss ratio against that number, so it must be the log-prob of the weights
the trainer published, computed the trainer's way up to rounding. `TeacherLogprobs` checks it
token by token: it keeps a copy of the params of the versions last published to the engine
(the last one; with in-flight updates the last k + 1, any of which may have sampled a token
still being trained on) and, for every generation round, teacher-forces the sampled tokens
through the trainer's own log-prob function under the version the engine reported for each,

    trainer_logp_t = log softmax(z_t / tau)[y_t],   z = the trainer's logits given the row's
                                                     prompt + response tokens before t,

at the rollout temperature tau. `assemble.batch_metrics` then reports mean and max
|engine - trainer| over the trained tokens (`agreement/*`). With a vLLM engine in fp32 the gap
is kernel rounding (~1e-5); a broken weight sync or a version mix-up shows as a large one.

Cost: one copy of the params (a device copy: the train step donates its buffers) and one
forward pass per generated row, in the producer's thread (it overlaps the update when the
staleness is >= 1). Off by default (`logging.logprob_agreement`); the CPU main job turns it on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

ROW_MULTIPLE = 64  # rows are padded to a multiple of this: a bounded number of programs


class TeacherLogprobs:
    """`producer.Teacher`: (version, contexts, new tokens) -> the trainer's log-prob of each new
    token under `version`. `remember(version, params)` after every publish; the last `keep`
    versions are kept; another version (only possible if a sync did not take) gets NaN, which
    the metrics leave out.

    logprob_fn: `train.step.make_logprob_fn(...)`, token-aligned log-probs at the rollout
    temperature; width: row length (prompt cap + response cap); pad_id: filler token;
    place: puts the [R, width] (ids, mask) arrays where the params live (a mesh's batch
    sharding, or the default device)."""

    def __init__(
        self,
        logprob_fn: Callable,
        *,
        width: int,
        pad_id: int,
        place: Callable = jax.device_put,
        keep: int = 1,
    ):
        self._fn, self._width, self._pad, self._place = logprob_fn, width, pad_id, place
        self._keep = keep
        self._params: dict[int, object] = {}  # version -> params; replaced whole (threads)

    def remember(self, version: int, params) -> None:
        """Keep a private copy of `params` as `version` (the caller keeps training its own)."""
        kept = {**self._params, int(version): jax.tree.map(jnp.copy, params)}
        self._params = dict(sorted(kept.items())[-self._keep :])

    def __call__(
        self, version: int, contexts: Sequence[Sequence[int]], new_tokens: Sequence[np.ndarray]
    ) -> list[np.ndarray]:
        params = self._params.get(version)
        if params is None:
            return [np.full(len(t), np.nan, np.float32) for t in new_tokens]
        rows = -(-len(contexts) // ROW_MULTIPLE) * ROW_MULTIPLE
        ids = np.full((rows, self._width), self._pad, np.int32)  # [R, T]
        mask = np.zeros((rows, self._width), np.int32)  # [R, T]
        for r, (context, new) in enumerate(zip(contexts, new_tokens, strict=True)):
            seq = np.concatenate([np.asarray(context, np.int32), np.asarray(new, np.int32)])
            if len(seq) > self._width:
                raise ValueError(
                    f"row {r}: {len(seq)} tokens do not fit the trainer's row of {self._width}"
                )
            ids[r, self._width - len(seq) :] = seq  # right-aligned: new tokens end the row
            mask[r, self._width - len(seq) :] = 1
        logp, _ = self._fn(params, *self._place((ids, mask)))  # [R, T]
        logp = np.asarray(jax.device_get(logp))
        return [
            logp[r, self._width - len(new) :].astype(np.float32) for r, new in enumerate(new_tokens)
        ]
