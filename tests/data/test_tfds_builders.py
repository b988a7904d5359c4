"""TFDS array_record builders: every shipped set prepared into a tmp data_dir and read back
through `tfds.data_source`, user JSONL/Parquet sets, and no TensorFlow anywhere."""

import json
import sys

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow_datasets as tfds

from bapo_jax.data import (
    SHIPPED_SETS,
    MalformedRowError,
    MathRow,
    decode_example,
    prepare_files,
    prepare_shipped,
    read_math_rows,
    skipped_rows,
)

tfds.display_progress_bar(False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tfds")
    for name in SHIPPED_SETS:
        prepare_shipped(name, directory)
    return directory


@pytest.mark.parametrize(
    ("name", "split"),
    [(entry.name, split) for entry in SHIPPED_SETS.values() for split in entry.splits],
)
def test_shipped_set_reads_back_with_right_count(data_dir, name, split):
    source = tfds.data_source(f"bapo_math/{name}", split=split, data_dir=str(data_dir))
    entry = SHIPPED_SETS[name]
    assert len(source) == entry.counts[split]
    rows, _ = read_math_rows(entry.path(split))
    # File order is kept (shuffling is the pipeline's job): spot-check both ends and middle.
    for index in (0, len(rows) // 2, len(rows) - 1):
        assert decode_example(source[index]) == rows[index]


def test_prepare_is_idempotent_and_needs_no_tensorflow(data_dir):
    builder = prepare_shipped("aime2024", data_dir)
    assert builder.info.splits["test"].num_examples == 30
    assert builder.info.file_format.value == "array_record"
    assert "tensorflow" not in sys.modules


def test_user_jsonl_strict_error_names_file_and_line(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        json.dumps({"problem": "1+1?", "answer": "2"}) + "\n" + json.dumps({"problem": "x"}) + "\n",
        encoding="utf-8",
    )
    with pytest.raises(MalformedRowError, match=f"{path}:2: missing field 'answer'"):
        prepare_files("strict_set", {"train": path}, tmp_path / "tfds")


def test_user_jsonl_and_parquet_with_skipped_rows(tmp_path):
    jsonl = tmp_path / "train.jsonl"
    jsonl.write_text(
        "\n".join(
            [
                json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}),
                "{broken",
                json.dumps({"problem": "2+2?", "answer": 4}),
                json.dumps({"problem": "no answer"}),
            ]
        )
        + "\n",
        encoding="utf-8",
    )
    parquet = tmp_path / "test.parquet"
    pq.write_table(pa.table({"problem": ["3+3?", "4+4?"], "answer": ["6", "8"]}), parquet)
    data_dir = tmp_path / "tfds"
    builder = prepare_files(
        "my_set", {"train": jsonl, "test": parquet}, data_dir, skip_malformed=True
    )
    assert skipped_rows(builder) == {"train": 2, "test": 0}
    train = tfds.data_source("bapo_math_files/my_set", split="train", data_dir=str(data_dir))
    test = tfds.data_source("bapo_math_files/my_set", split="test", data_dir=str(data_dir))
    assert [decode_example(train[i]) for i in range(len(train))] == [
        MathRow("a", "1+1?", "2"),
        MathRow("train-3", "2+2?", "4"),
    ]
    assert [decode_example(test[i]).answer for i in range(len(test))] == ["6", "8"]
    # The skip count is stored with the prepared set, readable from the data_dir alone.
    assert skipped_rows(tfds.builder("bapo_math_files/my_set", data_dir=str(data_dir))) == {
        "train": 2,
        "test": 0,
    }
    # Same name, same files: reused. Different flags: refused rather than stale data.
    prepare_files("my_set", {"train": jsonl, "test": parquet}, data_dir, skip_malformed=True)
    with pytest.raises(ValueError, match="was prepared from other files or flags"):
        prepare_files("my_set", {"train": jsonl, "test": parquet}, data_dir)


def test_prepare_files_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="name must be letters, digits"):
        prepare_files("bad/name", {"train": tmp_path / "x.jsonl"}, tmp_path)
    with pytest.raises(ValueError, match="data_files must map at least one split"):
        prepare_files("empty", {}, tmp_path)
    with pytest.raises(FileNotFoundError, match="data_files\\['train'\\] not found"):
        prepare_files("missing", {"train": tmp_path / "x.jsonl"}, tmp_path)
    with pytest.raises(ValueError, match="name must be one of"):
        prepare_shipped("aime1999", tmp_path)
