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
over). `TrainBatch.split` takes micro-batch m = rows m, m + M, ..., and bins are dealt to the
used micro-batches in turn, so FFD's fuller first rows spread over all of them. With a fixed
``num_micro_batches`` (the trainer) every packed batch has one shape, so the train step compiles
once; the micro-batches beyond the used ones are empty and the step skips them.

Everything here is host-side numpy, run before the batch is placed on devices.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bapo_jax.checks import check_field, check_int, is_int
from bapo_jax.train.batch import TrainBatch

__all__ = ["PackedLayout", "PackingConfig", "first_fit_decreasing", "pack_batch", "unpack"]


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """row_length: tokens per packed row (>= the longest sequence).
    rows_per_micro_batch: rows per micro-batch; the token budget is row_length * this.
    row_multiple: rows_per_micro_batch must be a multiple of it (devices the batch axis spans).
    num_micro_batches: None = as many micro-batches as the rows need; else always this many
      (the trainer's fixed step shape; micro-batches left empty are skipped by the step), and
      more is an error.
    max_scored_per_row: None, or the most trained (loss_mask) tokens a row may hold: the
      step's output head sees only that many positions per row (`StepConfig.scored_length`).
    drop_untrained: leave out sequences without a trained token (they add nothing to the
      loss or its gradient; `unpack` gives them the fill value).
    """

    row_length: int
    rows_per_micro_batch: int = 1
    row_multiple: int = 1
    num_micro_batches: int | None = None
    max_scored_per_row: int | None = None
    drop_untrained: bool = False

    def __post_init__(self):
        for name in ("row_length", "rows_per_micro_batch", "row_multiple"):
            check_int(f"PackingConfig.{name}", getattr(self, name), 1)
        for name in ("num_micro_batches", "max_scored_per_row"):
            value = getattr(self, name)
            ok = value is None or is_int(value, 1)
            check_field(ok, f"PackingConfig.{name}", "None or an int >= 1", value)
        check_field(
            self.rows_per_micro_batch % self.row_multiple == 0,
            "PackingConfig.rows_per_micro_batch",
            f"a multiple of row_multiple={self.row_multiple}",
            self.rows_per_micro_batch,
        )

    @property
    def token_budget(self) -> int:
        return self.row_length * self.rows_per_micro_batch


@dataclasses.dataclass(frozen=True)
class PackedLayout:
    """Where each source sequence went: sequence i's real tokens src[i, start[i]:start[i] +
    length[i]] sit in packed row row[i] at columns offset[i]:offset[i] + length[i] (row -1: left
    out). num_micro_batches: the packed batch's micro-batches, used_micro_batches: those with
    rows in them (the first ones); used_rows: rows holding a sequence."""

    row: np.ndarray  # [B] int
    offset: np.ndarray  # [B] int
    start: np.ndarray  # [B] int
    length: np.ndarray  # [B] int
    source_shape: tuple[int, int]
    num_micro_batches: int
    used_micro_batches: int
    used_rows: int


def first_fit_decreasing(
    lengths, capacity: int, scored=None, scored_capacity: int | None = None
) -> list[list[int]]:
    """Bins (lists of indices, in placement order) of total length <= capacity each and, with
    `scored` / `scored_capacity`, of total scored length <= scored_capacity each."""
    lengths = [int(n) for n in lengths]
    scored = [0] * len(lengths) if scored is None else [int(n) for n in scored]
    scored_capacity = sum(scored) if scored_capacity is None else scored_capacity
    for i, (n, k) in enumerate(zip(lengths, scored, strict=True)):
        if n > capacity:
            raise ValueError(f"sequence {i} has length {n} > row_length={capacity}")
        if n < 0:
            raise ValueError(f"sequence {i} has negative length {n}")
        if k > scored_capacity:
            raise ValueError(
                f"sequence {i} has {k} trained tokens > max_scored_per_row={scored_capacity}"
            )
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[list[int]] = []  # per bin: [free tokens, free scored tokens]
    for i in order:
        if lengths[i] == 0:
            continue
        for b, (free, free_scored) in enumerate(room):
            if lengths[i] <= free and scored[i] <= free_scored:
                bins[b].append(i)
                room[b][0] -= lengths[i]
                room[b][1] -= scored[i]
                break
        else:
            bins.append([i])
            room.append([capacity - lengths[i], scored_capacity - scored[i]])
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
    Every per-token field moves with its token, so token-level sums are unchanged. Bin k goes
    to micro-batch k mod U (U = used micro-batches), so the fuller first bins spread over all.
    """
    if batch.segment_ids is not None:
        raise ValueError("pack_batch: the batch is already packed (segment_ids is set)")
    src = _to_numpy(batch)
    start, length = _real_spans(src["attention_mask"], src["loss_mask"])
    trained = (src["loss_mask"] > 0).sum(axis=1)
    if config.drop_untrained:
        length = np.where(trained > 0, length, 0)
    bins = first_fit_decreasing(
        length, config.row_length, trained, scored_capacity=config.max_scored_per_row
    )
    per_micro = config.rows_per_micro_batch
    used = max(1, -(-len(bins) // per_micro))
    num_micro = used if config.num_micro_batches is None else config.num_micro_batches
    if used > num_micro:
        raise ValueError(
            f"{len(bins)} packed rows need {used} micro-batches of {per_micro} rows > "
            f"num_micro_batches={num_micro}"
        )
    num_rows, width = num_micro * per_micro, config.row_length

    out = {
        name: np.zeros((num_rows, width), value.dtype)
        for name, value in src.items()
        if value is not None
    }
    segment_ids = np.zeros((num_rows, width), np.int32)
    positions = np.zeros((num_rows, width), np.int32)
    b = len(length)
    row, offset = np.full(b, -1, np.int64), np.zeros(b, np.int64)
    for k, members in enumerate(bins):
        # Row r of `TrainBatch.split(M)`'s micro-batch m is packed row r * M + m.
        r = (k // used) * num_micro + k % used
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
        used_micro_batches=used,
        used_rows=len(bins),
    )
    return packed, layout


def unpack(values: np.ndarray, layout: PackedLayout, fill=0) -> np.ndarray:
    """Per-token values of the packed rows [R, row_length] -> the source layout [B, T]
    (e.g. recomputed log-probs back to the rollout's padded order); padding gets ``fill``."""
    values = np.asarray(values)
    out = np.full(layout.source_shape, fill, values.dtype)
    for i in range(len(layout.length)):
        n, s, r, c = (int(x[i]) for x in (layout.length, layout.start, layout.row, layout.offset))
        if r >= 0:
            out[i, s : s + n] = values[r, c : c + n]
    return out


def _to_numpy(batch: TrainBatch) -> dict[str, np.ndarray | None]:
    """The batch's fields as host numpy arrays (None stays None)."""
    return {
        f.name: None if getattr(batch, f.name) is None else np.asarray(getattr(batch, f.name))
        for f in dataclasses.fields(batch)
    }
