"""What the updates of one rollout batch consume: placed-ready `TrainBatch`es (packed or
padded), the log-prob pass before them, and what the step computed (real tokens, rows run).

Packing (`algorithm.packing`, `train.packing`): an update's sequences with a trained token go
into rows of prompt cap + response cap tokens, at most `max_response_tokens` trained tokens a
row (the step's scored width), dealt over the update's M micro-batches; the batch keeps the
padded update's shape, so the step compiles once and skips the micro-batches left empty.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from bapo_jax.train import assemble, multihost, packing
from bapo_jax.train import step as step_lib
from bapo_jax.train.batch import RowLogprobs, TrainBatch
from bapo_jax.train.config import TrainerConfig


def packing_config(config: TrainerConfig, batch_devices: int = 1) -> packing.PackingConfig | None:
    """How a trainer packs an update (None with `algorithm.packing` off): rows of the run's row
    length, the padded update's M micro-batches of rows_per_micro_batch rows (one step shape),
    at most the response cap of trained tokens a row (the step's scored width), sequences
    without a trained token left out."""
    if not config.algorithm.packing:
        return None
    return packing.PackingConfig(
        row_length=config.row_length,
        rows_per_micro_batch=config.rows_per_micro_batch,
        row_multiple=batch_devices,
        num_micro_batches=config.algorithm.micro_batches,
        max_scored_per_row=config.rollout.max_response_tokens,
        drop_untrained=True,
    )


class RowFill:
    """What the updates of one rollout batch computed: the lengths of the sequences with a
    trained token (the real tokens), and the micro-batches the step ran (those with a trained
    token; `TrainBatch.split`'s strided micro-batches) with their rows."""

    def __init__(self):
        self.lengths: list[np.ndarray] = []
        self.computed_rows = 0
        self.micro_batches: list[int] = []

    def add_sequences(self, padded: TrainBatch) -> None:
        trained = np.asarray(padded.loss_mask).sum(axis=1) > 0
        self.lengths.append(np.asarray(padded.attention_mask).sum(axis=1)[trained])

    def add_computed(self, batch: TrainBatch, num_micro_batches: int) -> None:
        trained = np.asarray(batch.loss_mask) > 0
        m = num_micro_batches
        used = sum(bool(trained[k::m].any()) for k in range(m))
        self.micro_batches.append(used)
        self.computed_rows += used * (batch.batch_size // m)

    @property
    def sequence_lengths(self) -> np.ndarray:
        return np.concatenate(self.lengths) if self.lengths else np.zeros(0, np.int64)

    def metrics(self, row_length: int) -> dict[str, float]:
        """packing/tokens_per_row: real tokens per computed row; packing/padding_share: the
        computed token slots that are padding; packing/micro_batches: micro-batches run per
        update (mean)."""
        real = float(self.sequence_lengths.sum())
        rows = max(self.computed_rows, 1)
        return {
            "packing/tokens_per_row": real / rows,
            "packing/padding_share": 1.0 - real / (rows * row_length),
            "packing/micro_batches": float(np.mean(self.micro_batches)),
        }


def train_batch(
    rows: assemble.RowArrays,
    logps: RowLogprobs,
    packing_config: packing.PackingConfig | None,
    *,
    fill: RowFill,
    micro_batches: int,
    scored_length: int | None,
    lags: np.ndarray | None = None,
) -> TrainBatch:
    """One update's rows -> its host `TrainBatch`, packed when `packing_config` is given;
    `fill` records its real tokens and the rows the step will compute; `lags` ([N, T]) for a
    staleness-aware loss (`staleness.token_lags`)."""
    batch = TrainBatch(
        input_ids=rows.input_ids,
        attention_mask=rows.attention_mask,
        loss_mask=rows.loss_mask,
        advantages=rows.advantages,
        behavior_logp=rows.behavior_logp,
        old_logp=logps.old,
        ref_logp=logps.ref,
        lags=lags,
    )
    batch.check()
    fill.add_sequences(batch)
    if packing_config is not None:
        batch, _ = packing.pack_batch(batch, packing_config)
    fill.add_computed(batch, micro_batches)
    step_lib.check_scored_width(batch.loss_mask, scored_length)
    return batch


def recompute_logprobs(
    rows: assemble.RowArrays,
    params: Mapping[str, Any],
    logprob_fn: Callable[..., Any],
    packing_config: packing.PackingConfig | None,
    *,
    chunk_rows: int,
    place: Callable[[TrainBatch], TrainBatch],
) -> RowLogprobs:
    """log pi(y_t) of every trained token at the rollout temperature (0 elsewhere) under each
    of `params` ({"old": ..., "ref": ...}), in chunks of `chunk_rows` rows (one compiled
    program), packed when `packing_config` is given (fewer chunks); each chunk is placed once
    for all params."""
    zeros = np.zeros(rows.input_ids.shape, np.float32)
    batch = TrainBatch(rows.input_ids, rows.attention_mask, rows.loss_mask, zeros, zeros)
    layout = None
    if packing_config is not None:
        config = dataclasses.replace(
            packing_config, rows_per_micro_batch=chunk_rows, num_micro_batches=None
        )
        batch, layout = packing.pack_batch(batch, config)
    parts: dict[str, list[np.ndarray]] = {key: [] for key in params}
    for start in range(0, batch.batch_size, chunk_rows):
        part = slice(start, start + chunk_rows)
        chunk = place(jax.tree.map(lambda x, part=part: x[part], batch))
        args = (chunk.input_ids, chunk.attention_mask, chunk.segment_ids, chunk.positions)
        for key, p in params.items():
            logp, _ = logprob_fn(p, *args, chunk.loss_mask)
            parts[key].append(multihost.to_host(logp))
    out = {key: np.concatenate(p) for key, p in parts.items()}
    if layout is not None:
        out = {key: packing.unpack(p, layout) for key, p in out.items()}
    trained = rows.loss_mask > 0
    return RowLogprobs(**{key: p * trained for key, p in out.items()})
