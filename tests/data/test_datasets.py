"""The shipped-set registry and the strict `{problem, answer}` row reader."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bapo_jax.data import (
    SHIPPED_SETS,
    MalformedRowError,
    MathRow,
    read_math_rows,
    shipped_set,
)
from bapo_jax.data.datasets import ASSETS_DATA_DIR

# Row counts stated in bapo_jax/assets/PROVENANCE.md.
PROVENANCE_COUNTS = {
    "aime/aime2024.jsonl": 30,
    "aime/aime2025.jsonl": 30,
    "math/math500_test.jsonl": 500,
    "math/math_l3to5_train.jsonl": 8519,
    "gsm8k/train.jsonl": 7473,
    "gsm8k/test.jsonl": 1319,
}


def test_registry_matches_provenance():
    registered = {
        entry.splits[split]: entry.counts[split]
        for entry in SHIPPED_SETS.values()
        for split in entry.splits
    }
    assert registered == PROVENANCE_COUNTS
    provenance = (ASSETS_DATA_DIR.parent / "PROVENANCE.md").read_text(encoding="utf-8")
    for path, count in PROVENANCE_COUNTS.items():
        assert re.search(rf"`{re.escape(path)}` \| {count} \|", provenance), path


@pytest.mark.parametrize("relative_path", sorted(PROVENANCE_COUNTS))
def test_every_shipped_file_reads_strictly(relative_path):
    rows, report = read_math_rows(ASSETS_DATA_DIR / relative_path)
    assert len(rows) == PROVENANCE_COUNTS[relative_path] == report.rows
    assert report.num_skipped == 0
    assert len({row.id for row in rows}) == len(rows)
    assert all(row.problem.strip() and row.answer for row in rows)


def test_aime_integer_answers_become_text():
    rows, _ = read_math_rows(shipped_set("aime2025").path("test"))
    assert rows[0] == MathRow(
        id="2025-I-1",
        problem="Find the sum of all integer bases $b>9$ for which $17_b$ is a divisor of $97_b.$",
        answer="70",
    )


def test_unknown_names_are_clear_errors():
    with pytest.raises(ValueError, match=r"name must be one of .*'aime2024'.*, got 'aime2030'"):
        shipped_set("aime2030")
    with pytest.raises(ValueError, match="split must be one of \\['test'\\] for math500"):
        shipped_set("math500").path("train")


def _write_lines(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


GOOD = json.dumps({"problem": "1+1?", "answer": "2"})


@pytest.mark.parametrize(
    ("bad_line", "reason"),
    [
        (json.dumps({"problem": "1+2?"}), "missing field 'answer'"),
        (json.dumps({"problem": "1+2?", "answer": None}), "missing field 'answer'"),
        (json.dumps({"answer": "3"}), "missing field 'problem'"),
        ('{"problem": "1+2?", "answer": "3"', "bad JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (json.dumps({"problem": "1+2?", "answer": ""}), "field 'answer' is empty"),
        (json.dumps({"problem": "  ", "answer": "3"}), "field 'problem' must be a non-empty"),
        (
            json.dumps({"problem": "half?", "answer": 0.5}),
            "field 'answer' must be a string or an integer, got float",
        ),
        (
            json.dumps({"problem": "1+2?", "answer": True}),
            "field 'answer' must be a string or an integer, got bool",
        ),
    ],
)
def test_malformed_row_error_names_file_and_line(tmp_path, bad_line, reason):
    path = _write_lines(tmp_path / "rows.jsonl", [GOOD, "", GOOD, bad_line, GOOD])
    with pytest.raises(MalformedRowError, match=re.escape(f"{path}:4: ") + re.escape(reason)):
        read_math_rows(path)


def test_malformed_rows_skipped_and_counted_when_asked(tmp_path):
    lines = [
        GOOD,
        json.dumps({"problem": "no answer"}),
        "not json at all",
        json.dumps({"id": "q7", "problem": "2+2?", "answer": 4}),
    ]
    path = _write_lines(tmp_path / "rows.jsonl", lines)
    rows, report = read_math_rows(path, skip_malformed=True)
    assert rows == [MathRow("rows-1", "1+1?", "2"), MathRow("q7", "2+2?", "4")]
    assert report.rows == 2
    assert report.num_skipped == 2
    assert [line for line, _ in report.skipped] == [2, 3]
    assert "missing field 'answer'" in report.skipped[0][1]
    assert "bad JSON" in report.skipped[1][1]


def test_all_rows_malformed_is_an_error_even_when_skipping(tmp_path):
    path = _write_lines(tmp_path / "rows.jsonl", ["{}", "nope"])
    with pytest.raises(MalformedRowError, match="no valid rows \\(2 malformed\\)"):
        read_math_rows(path, skip_malformed=True)


def test_parquet_rows_and_malformed_row_location(tmp_path):
    table = pa.table({"problem": ["a?", "b?", "c?"], "answer": ["1", None, "3"]})
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path)
    with pytest.raises(MalformedRowError, match=re.escape(f"{path}:row 2: missing field 'answer'")):
        read_math_rows(path)
    rows, report = read_math_rows(path, skip_malformed=True)
    assert [r.answer for r in rows] == ["1", "3"]
    assert report.skipped == [(2, "missing field 'answer'")]


def test_unsupported_suffix_and_missing_file(tmp_path):
    (tmp_path / "rows.csv").write_text("problem,answer\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"must end in \.jsonl, \.json or \.parquet"):
        read_math_rows(tmp_path / "rows.csv")
    with pytest.raises(FileNotFoundError, match="data file not found"):
        read_math_rows(tmp_path / "missing.jsonl")
