"""`TrainBatch`: the padded [B, T] arrays one optimizer update consumes.

Every per-token array is aligned with `input_ids`: entry [b, t] describes token
`input_ids[b, t]` (its behaviour log-prob, its advantage, whether it is a trainable response
token). The train step shifts internally (token t is predicted from position t - 1), so the
first column can never be a response token.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """One update's data.

    input_ids:      prompt + response token ids, left-padded prompts are fine [B, T] int32.
    attention_mask: 1 for real tokens, 0 for padding [B, T].
    loss_mask:      1 for response tokens that are trained on [B, T] (a subset of the mask).
    advantages:     A_t broadcast to the response tokens [B, T] (GRPO: per sequence).
    behavior_logp:  log pi_behaviour(y_t) reported by the engine that sampled y_t [B, T].
    old_logp:       optional recomputed log pi_old(y_t) (ratio_base = "recomputed") [B, T].
    ref_logp:       optional log pi_ref(y_t) of the frozen reference policy at the rollout
                    temperature, 0 off the loss mask; required when kl_coef > 0 [B, T].
    segment_ids:    optional, packed rows (`bapo_jax.train.packing`): 1, 2, ... per sequence in
                    the row, 0 for padding [B, T]; tokens attend within their segment only.
    positions:      optional RoPE positions, restarting at 0 in each segment [B, T].
    lags:           optional per-token lag, the version trained minus the version that
                    sampled the token (staleness-aware BAPO, `BAPOConfig.lag_buckets`) [B, T].
    """

    input_ids: Int[Array, "B T"]
    attention_mask: Int[Array, "B T"]
    loss_mask: Float[Array, "B T"]
    advantages: Float[Array, "B T"]
    behavior_logp: Float[Array, "B T"]
    old_logp: Float[Array, "B T"] | None = None
    ref_logp: Float[Array, "B T"] | None = None
    segment_ids: Int[Array, "B T"] | None = None
    positions: Int[Array, "B T"] | None = None
    lags: Int[Array, "B T"] | None = None

    def check(self) -> None:
        """chex boundary check: every array is [B, T], one shape, ids integer."""
        arrays = jax.tree.leaves(self)
        chex.assert_rank(arrays, 2)
        chex.assert_equal_shape(arrays)
        chex.assert_type(self.input_ids, int)

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    def split(self, num_micro_batches: int) -> TrainBatch:
        """[B, ...] -> [M, B/M, ...] with micro-batch m = rows m, m + M, m + 2M, ... .

        The strided split keeps a batch that is sharded over devices balanced: every device
        contributes B/(M * devices) rows to every micro-batch and no rows move between devices.
        """
        b = self.batch_size
        if b % num_micro_batches:
            raise ValueError(
                f"batch size {b} is not divisible by num_micro_batches={num_micro_batches}"
            )

        def split(x):
            x = x.reshape(b // num_micro_batches, num_micro_batches, *x.shape[1:])
            return jnp.swapaxes(x, 0, 1)

        return jax.tree.map(split, self)


@dataclasses.dataclass(frozen=True)
class RowLogprobs:
    """Host-side log-probs the trainer computes for every row of a rollout batch before its
    updates (`Trainer._recompute_logp`), 0 off the loss mask; rows are sliced per update.

    old: log pi_old(y_t), the weights at the start of the iteration (ratio_base "recomputed").
    ref: log pi_ref(y_t), the frozen reference policy (kl_coef > 0; `train.reference`).
    """

    old: Float[np.ndarray, "N T"] | None = None
    ref: Float[np.ndarray, "N T"] | None = None

    def take(self, idx: np.ndarray) -> RowLogprobs:
        """The rows `idx` of every array that is there."""
        return RowLogprobs(*(None if x is None else x[idx] for x in (self.old, self.ref)))
