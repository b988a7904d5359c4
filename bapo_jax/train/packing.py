"""Sequence packing (verl's remove-padding) with token-budget micro-batches.

RL responses have long-tailed lengths: padding every sequence of an update to the longest one
spends most of the compute on padding. Packing puts several sequences one after another into
fixed-length rows; ``segment_ids`` (1, 2, ... per sequence in a row, 0 for padding) keep them
apart in attention (a token sees earlier tokens of its own segment only), positions restart at
0 in each segment, and the log-prob shift never crosses a boundary (`train.step`).

Assignment is first-fit-decreasing (deterministic: ties keep input order): sequences sorted by
length, longest first, each into the first row with room. FFD uses at most 11/9 OPT + 6/9 rows.

Token-budget micro-batches: a micro-batch is ``rows_per_micro_batch`` rows of ``row_length``
tokens, i.e. a fixed token budget, whatever the number of sequences in it; the number of
micro-batches follows from the data. Rows are padded with empty rows to a whole number of
micro-batches (each a multiple of ``row_multiple``, the number of devices the batch is split
over). `TrainBatch.split` takes micro-batch m = rows m, m + M, ..., so FFD's fuller first rows
spread over all micro-batches. The train step compiles once per distinct micro-batch count.

Everything here is host-side numpy, run before the batch is placed on devices.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bapo_jax.train.batch import TrainBatch

__all__ = ["PackedLayout", "PackingConfig", "first_fit_decreasing", "pack_batch", "unpack"]


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """row_length: tokens per packed row (>= the longest sequence).
    rows_per_micro_batch: rows per micro-batch; the token budget is row_length * this.
    row_multiple: rows_per_micro_batch must be a multiple of it (devices the batch axis spans).
    """

    row_length: int
    rows_per_micro_batch: int = 1
    row_multiple: int = 1

    def __post_init__(self):
        for name in ("row_length", "rows_per_micro_batch", "row_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PackingConfig.{name} must be an int >= 1, got {value!r}")
        if self.rows_per_micro_batch % self.row_multiple:
            raise ValueError(
                f"PackingConfig.rows_per_micro_batch={self.rows_per_micro_batch} must be a "
                f"multiple of row_multiple={self.row_multiple}"
            )

    @property
    def token_budget(self) -> int:
        return self.row_length * self.rows_per_micro_batch


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each source sequence went: sequence i's real tokens src[i, start[i]:start[i] +
    length[i]] sit in packed row row[i] at columns offset[i]:offset[i] + length[i]."""

    row: np.ndarray  # [B] int
    offset: np.ndarray  # [B] int
    start: np.ndarray  # [B] int
    length: np.ndarray  # [B] int
    source_shape: tuple[int, int]
    num_micro_batches: int


def first_fit_decreasing(lengths, capacity: int) -> list[list[int]]:
    """Bins (lists of indices, in placement order) of total length <= capacity each."""
    lengths = [int(n) for n in lengths]
    for i, n in enumerate(lengths):
        if n > capacity:
            raise ValueError(f"sequence {i} has length {n} > row_length={capacity}")
        if n < 0:
            raise ValueError(f"sequence {i} has negative length {n}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        if lengths[i] == 0:
            continue
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def _real_spans(attention_mask: np.ndarray, loss_mask: np.ndarray) -> tuple[np.ndarray, ...]:
    """(start, length) of each row's real tokens, which must be one contiguous run whose first
    token is not trained on."""
    mask = attention_mask > 0
    length = mask.sum(axis=1)
    start = np.where(length > 0, mask.argmax(axis=1), 0)
    idx = np.arange(mask.shape[1])
    contiguous = (mask == ((idx >= start[:, None]) & (idx < (start + length)[:, None]))).all(1)
    if not contiguous.all():
        bad = int(np.flatnonzero(~contiguous)[0])
        raise ValueError(f"row {bad} of attention_mask is not one contiguous run of tokens")
    rows = np.flatnonzero(length > 0)
    if (loss_mask[rows, start[rows]] != 0).any():
        bad = int(rows[np.flatnonzero(loss_mask[rows, start[rows]] != 0)[0]])
        raise ValueError(
            f"row {bad}: the first real token has loss_mask != 0 (nothing predicts it)"
        )
    return start, length


def pack_batch(batch: TrainBatch, config: PackingConfig) -> tuple[TrainBatch, PackedLayout]:
    """A padded `TrainBatch` (one sequence per row) -> packed rows with segment ids/positions.

    Returns the packed batch (numpy arrays; [R, row_length] with R = M * rows_per_micro_batch)
    and its layout; train with ``StepConfig(num_micro_batches=layout.num_micro_batches)``.
    Every per-token field moves with its token, so token-level sums are unchanged.
    """
    if batch.segment_ids is not None:
        raise ValueError("pack_batch: the batch is already packed (segment_ids is set)")
    src = _to_numpy(batch)
    start, length = _real_spans(src["attention_mask"], src["loss_mask"])
    bins = first_fit_decreasing(length, config.row_length)
    per_micro = config.rows_per_micro_batch
    num_micro = max(1, -(-len(bins) // per_micro))
    num_rows, width = num_micro * per_micro, config.row_length

    out = {
        name: np.zeros((num_rows, width), value.dtype)
        for name, value in src.items()
        if value is not None
    }
    segment_ids = np.zeros((num_rows, width), np.int32)
    positions = np.zeros((num_rows, width), np.int32)
    b = len(length)
    row, offset = np.zeros(b, np.int64), np.zeros(b, np.int64)
    for r, members in enumerate(bins):
        col = 0
        for segment, i in enumerate(members, start=1):
            n, s = int(length[i]), int(start[i])
            for name, value in out.items():
                value[r, col : col + n] = src[name][i, s : s + n]
            segment_ids[r, col : col + n] = segment
            positions[r, col : col + n] = np.arange(n)
            row[i], offset[i] = r, col
            col += n
    packed = TrainBatch(**out, segment_ids=segment_ids, positions=positions)
    layout = PackedLayout(
        row=row,
        offset=offset,
        start=start.astype(np.int64),
        length=length.astype(np.int64),
        source_shape=tuple(src["input_ids"].shape),
        num_micro_batches=num_micro,
    )
    return packed, layout


def unpack(values: np.ndarray, layout: PackedLayout, fill=0) -> np.ndarray:
    """Per-token values of the packed rows [R, row_length] -> the source layout [B, T]
    (e.g. recomputed log-probs back to the rollout's padded order); padding gets ``fill``."""
    values = np.asarray(values)
    out = np.full(layout.source_shape, fill, values.dtype)
    for i in range(len(layout.length)):
        n, s, r, c = (int(x[i]) for x in (layout.length, layout.start, layout.row, layout.offset))
        out[i, s : s + n] = values[r, c : c + n]
    return out


def _to_numpy(batch: TrainBatch) -> dict[str, np.ndarray | None]:
    """The batch's fields as host numpy arrays (None stays None)."""
    return {
        f.name: None if getattr(batch, f.name) is None else np.asarray(getattr(batch, f.name))
        for f in dataclasses.fields(batch)
    }
