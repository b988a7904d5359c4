"""The shipped math sets (a registry: name -> files, row counts) and a strict row reader.

Every data file holds `{problem, answer}` rows (an `id` is optional): JSON Lines or Parquet.
`read_math_rows` validates each row; a malformed row (bad JSON, not an object, a missing or
empty `problem`/`answer`, a wrong type) raises `MalformedRowError` naming the file and line,
or, with `skip_malformed=True`, is skipped and reported in the returned `ReadReport`.
"""

from __future__ import annotations

import dataclasses
import json
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
    """One problem. `answer` is text (integers are converted: AIME's 33 -> "33")."""

    id: str
    problem: str
    answer: str


class MalformedRowError(ValueError):
    """A row that is not a valid `{problem, answer}` record; the message names file and line."""


@dataclasses.dataclass
class ReadReport:
    """What `read_math_rows` did with a file: rows kept and rows skipped (line, reason)."""

    path: str
    rows: int = 0
    skipped: list[tuple[int, str]] = dataclasses.field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return len(self.skipped)


def _validate(record: Any, default_id: str) -> MathRow:
    """A MathRow from a decoded record, or ValueError saying what is wrong (no location)."""
    if not isinstance(record, Mapping):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "problem" not in record or record["problem"] is None:
        raise ValueError("missing field 'problem'")
    if "answer" not in record or record["answer"] is None:
        raise ValueError("missing field 'answer'")
    problem, answer = record["problem"], record["answer"]
    if not isinstance(problem, str) or not problem.strip():
        raise ValueError(f"field 'problem' must be a non-empty string, got {problem!r:.80}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int)):
        raise ValueError(
            f"field 'answer' must be a string or an integer, got {type(answer).__name__} "
            f"{answer!r:.80} (write non-integer numbers as strings)"
        )
    answer = str(answer).strip()
    if not answer:
        raise ValueError("field 'answer' is empty")
    row_id = record.get("id", default_id)
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise ValueError(f"field 'id' must be a string or an integer, got {row_id!r:.80}")
    return MathRow(id=str(row_id), problem=problem, answer=answer)


def _jsonl_records(path: Path):
    """(line number, record or the ValueError of a line that is not JSON) for each line."""
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue  # blank lines (a trailing newline) are not rows
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as error:
                yield line_no, ValueError(f"bad JSON: {error}")


def _parquet_records(path: Path):
    import pyarrow.parquet as pq

    yield from enumerate(pq.read_table(path).to_pylist(), start=1)


def read_math_rows(
    path: str | Path, *, skip_malformed: bool = False
) -> tuple[list[MathRow], ReadReport]:
    """Read and validate the `{problem, answer}` rows of a .jsonl or .parquet file.

    Args:
      path: a `.jsonl` / `.json` (JSON Lines) or `.parquet` file.
      skip_malformed: False: the first malformed row raises `MalformedRowError`
        ("file:line: reason"; for Parquet "file:row N: reason"). True: malformed rows are
        skipped and listed in the report.

    Returns:
      (rows, report). Rows without an `id` get "<file stem>-<line>".
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".json"):
        records, where = _jsonl_records(path), "{path}:{n}"
    elif suffix == ".parquet":
        records, where = _parquet_records(path), "{path}:row {n}"
    else:
        raise ValueError(f"path must end in .jsonl, .json or .parquet, got {str(path)!r}")
    rows: list[MathRow] = []
    report = ReadReport(path=str(path))
    for n, record in records:
        try:
            if isinstance(record, ValueError):
                raise record
            rows.append(_validate(record, default_id=f"{path.stem}-{n}"))
        except ValueError as error:
            if not skip_malformed:
                raise MalformedRowError(f"{where.format(path=path, n=n)}: {error}") from None
            report.skipped.append((n, str(error)))
    report.rows = len(rows)
    if not rows:
        raise MalformedRowError(f"{path}: no valid rows ({report.num_skipped} malformed)")
    return rows, report
