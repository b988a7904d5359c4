"""The shipped math sets (a registry: name -> files, row counts), `MathRow`, and the strict
reader of `{problem, answer}` files.

Every shipped file holds `{problem, answer}` rows (an `id` is optional): JSON Lines.
`read_math_rows` validates each row; a malformed row (bad JSON, not an object, a missing or
empty `problem`/`answer`, a wrong type) raises `MalformedRowError` naming the file and line,
or, with `skip_malformed=True`, is skipped and reported in the returned `ReadReport`. Files
with other column names, nested fields (verl's Parquet) or chat prompts: `data.files`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

ASSETS_DATA_DIR = Path(__file__).resolve().parent.parent / "assets" / "data"


@dataclasses.dataclass(frozen=True)
class ShippedSet:
    """A data set shipped in `bapo_jax/assets/data` (provenance: assets/PROVENANCE.md).

    splits: split name -> path relative to `ASSETS_DATA_DIR`.
    counts: split name -> number of rows (checked when the set is prepared).
    """

    name: str
    splits: Mapping[str, str]
    counts: Mapping[str, int]
    description: str

    def path(self, split: str) -> Path:
        if split not in self.splits:
            raise ValueError(
                f"split must be one of {sorted(self.splits)} for {self.name}, got {split!r}"
            )
        return ASSETS_DATA_DIR / self.splits[split]


SHIPPED_SETS: dict[str, ShippedSet] = {
    s.name: s
    for s in (
        ShippedSet("aime2024", {"test": "aime/aime2024.jsonl"}, {"test": 30}, "AIME 2024 I and II"),
        ShippedSet("aime2025", {"test": "aime/aime2025.jsonl"}, {"test": 30}, "AIME 2025 I and II"),
        ShippedSet("math500", {"test": "math/math500_test.jsonl"}, {"test": 500}, "MATH-500"),
        ShippedSet(
            "math_l3to5",
            {"train": "math/math_l3to5_train.jsonl"},
            {"train": 8519},
            "MATH levels 3-5 train (SimpleRL 8.5k)",
        ),
        ShippedSet(
            "gsm8k",
            {"train": "gsm8k/train.jsonl", "test": "gsm8k/test.jsonl"},
            {"train": 7473, "test": 1319},
            "GSM8K",
        ),
    )
}


def shipped_set(name: str) -> ShippedSet:
    """The registry entry of a shipped set."""
    if name not in SHIPPED_SETS:
        raise ValueError(f"name must be one of {sorted(SHIPPED_SETS)}, got {name!r}")
    return SHIPPED_SETS[name]


@dataclasses.dataclass(frozen=True)
class MathRow:
    """One problem.

    id: unique within its file. problem: the problem text. answer: the gold answer as text
      (integers are converted: AIME's 33 -> "33").
    messages: None (the prompt is `build_messages(problem, style)`), or the chat prompt a
      data file gave (its messages column, or its template rendered as the user turn):
      a tuple of {"role", "content"} dicts (`data.files`).
    metadata: JSON-able fields a reward plug-in may need (verl: data_source, ability,
      extra_info); empty for shipped sets.
    Hashing uses id, problem and answer only (messages and metadata hold dicts).
    """

    id: str
    problem: str
    answer: str
    messages: tuple[dict[str, str], ...] | None = dataclasses.field(default=None, hash=False)
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)


class MalformedRowError(ValueError):
    """A row that is not a valid `{problem, answer}` record; the message names file and line."""


@dataclasses.dataclass
class ReadReport:
    """What `read_rows` / `read_math_rows` did with a file: `rows` kept, and `skipped`
    (line or Parquet row number, reason) with on_bad_row="skip"; `num_skipped` counts them."""

    path: str
    rows: int = 0
    skipped: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)


def read_math_rows(
    path: str | Path, *, skip_malformed: bool = False
) -> tuple[list[MathRow], ReadReport]:
    """Read and validate the `{problem, answer}` rows (`id` optional) of a .jsonl or .parquet
    file: `data.files.read_rows` with the default `DataFileSpec`.

    Args:
      path: a `.jsonl` / `.json` (JSON Lines) or `.parquet` file.
      skip_malformed: False: the first malformed row raises `MalformedRowError`
        ("file:line: reason"; for Parquet "file:row N: reason"). True: malformed rows are
        skipped and listed in the report.

    Returns:
      (rows, report). Rows without an `id` get "<file stem>-<line>".
    """
    from bapo_jax.data.files import DataFileSpec, DataSpecError, read_rows

    try:
        spec = DataFileSpec(str(path), on_bad_row="skip" if skip_malformed else "error")
    except DataSpecError as error:  # the path's suffix
        raise ValueError(str(error).removeprefix("path: ")) from None
    return read_rows(spec)
