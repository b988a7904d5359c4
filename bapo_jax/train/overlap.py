"""What the loop measures of its time: each phase (`timed`: the row's time/<phase>), the
generation hidden by the update, and the weight sync's parts hidden by generation (the
metrics row's overlap/* and time/sync_* fields)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import Any

from bapo_jax.rollout.types import SyncTimings


@contextlib.contextmanager
def timed(row: dict[str, Any], phase: str) -> Iterator[None]:
    """Times the block: row["time/<phase>"] = its wall seconds, once it has completed."""
    start = time.perf_counter()
    yield
    row[f"time/{phase}"] = time.perf_counter() - start


def hidden_generation(
    batches: Sequence[Any], updates: Sequence[tuple[float, float]]
) -> dict[str, float]:
    """How much of the generation of `batches` (`ProducedBatch`es: their engine calls'
    `generation_spans`) ran while an update ran (`updates`: disjoint spans, one per iteration):
    overlap/generation_s (their generation seconds), overlap/hidden_s (of those, inside an
    update's span) and overlap/hidden_share (their ratio)."""
    spans = [span for b in batches for span in b.generation_spans]
    if not spans:
        return {}
    total = sum(end - start for start, end in spans)
    hidden = sum(
        max(0.0, min(end, u_end) - max(start, u_start))
        for start, end in spans
        for u_start, u_end in updates
    )
    return {
        "overlap/generation_s": total,
        "overlap/hidden_s": hidden,
        "overlap/hidden_share": hidden / total if total > 0 else 0.0,
    }


def generation_end(batches: Sequence[Any]) -> float:
    """When the last engine call of `batches` (`ProducedBatch.generation_spans`) ended."""
    return max((end for b in batches for _, end in b.generation_spans), default=0.0)


def sync_row(timings: SyncTimings) -> dict[str, float]:
    """A weight update's timings (`WeightUpdater.finish_update`) as metrics row fields."""
    return {
        "time/sync_write": timings["write_s"],
        "time/sync_load": timings["load_s"],
        "time/sync_write_hidden": timings["write_hidden_s"],
        "time/sync_load_hidden": timings["load_hidden_s"],
        "sync/attempts": timings["attempts"],
        "sync/engine_version": timings["server_version"],
    }
