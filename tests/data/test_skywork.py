"""SkyWork-OR1-RL-Data's math records into the own-data path's JSONL (`data.skywork`), on
hand-made records in the data set's layout (nothing is downloaded)."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bapo_jax.data.datasets import MalformedRowError
from bapo_jax.data.files import DataFileSpec, read_rows
from bapo_jax.data.skywork import accepted_answers, convert_files, convert_record, main
from bapo_jax.run.config import DataSection

PROBLEM = "Find $x$ if $2x + 3 = 19$. Let's think step by step."


def record(index=7, ground_truth='["8"]', **changes):
    """One math record as the data set holds it (verl's layout)."""
    row = {
        "data_source": "train-math-deepscaler",
        "prompt": [{"role": "user", "content": PROBLEM}],
        "ability": "math",
        "reward_model": {"ground_truth": ground_truth, "style": "rule"},
        "extra_info": {
            "index": index,
            "model_difficulty": {
                "DeepSeek-R1-Distill-Qwen-1.5B": 3,
                "DeepSeek-R1-Distill-Qwen-32B": 16,
                "DeepSeek-R1-Distill-Qwen-7B": 12,
            },
        },
    }
    row.update(changes)
    return row


def test_a_record_becomes_a_row_with_one_answer_and_its_own_prompt():
    row = convert_record(record(ground_truth='["\\\\frac{1}{2}", "0.5"]'))
    assert row["id"] == "skywork-or1-math-7"
    assert row["prompt"] == [{"role": "user", "content": PROBLEM}]
    assert row["problem"] == PROBLEM
    assert (row["answer"], row["answers"]) == ("\\frac{1}{2}", ["\\frac{1}{2}", "0.5"])
    assert row["ability"] == "math" and row["data_source"] == "train-math-deepscaler"
    assert row["extra_info"]["model_difficulty"]["DeepSeek-R1-Distill-Qwen-7B"] == 12


def test_ground_truth_forms():
    assert accepted_answers('["8"]') == ["8"]
    assert accepted_answers("[8, 2.5]") == ["8", "2.5"]
    assert accepted_answers("\\frac{1}{2}") == ["\\frac{1}{2}"]  # plain text: one answer
    assert accepted_answers(" 12 ") == ["12"]
    assert accepted_answers(["3", 4]) == ["3", "4"]
    for bad in ("[]", '[""]', "  ", "[true]", '[{"a": 1}]'):
        with pytest.raises(ValueError, match=r"reward_model\.ground_truth"):
            accepted_answers(bad)


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"prompt": None}, "'prompt'"),
        ({"prompt": []}, "'prompt'"),
        ({"prompt": [{"role": "assistant", "content": "hi"}]}, "'prompt'"),
        ({"reward_model": {"style": "rule"}}, "'reward_model.ground_truth'"),
        ({"reward_model": {"ground_truth": "[]"}}, "'reward_model.ground_truth'"),
        ({"extra_info": {"model_difficulty": {}}}, "'extra_info.index'"),
        ({"extra_info": {"index": "7"}}, "'extra_info.index'"),
        ({"ability": "code"}, "'ability'"),
    ],
)
def test_a_record_without_a_needed_field_is_refused_naming_it(bad, field):
    with pytest.raises(ValueError, match=field):
        convert_record(record(**bad))


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_the_converted_file_is_what_the_run_reads(tmp_path):
    source = tmp_path / "math-00000-of-00001.parquet"
    _write_parquet(source, [record(0), record(1, ground_truth='["3", "3.0"]')])
    out = tmp_path / "skywork_math.jsonl"
    report = convert_files([source], out)
    assert (report.rows, report.several_answers, report.skipped) == (2, 1, [])
    # The run's own-data path, with the documented keys.
    section = DataSection(train=str(out), messages_key="prompt")
    rows, read = read_rows(section.file_spec())
    assert read.num_skipped == 0 and [r.id for r in rows] == [
        "skywork-or1-math-0",
        "skywork-or1-math-1",
    ]
    assert rows[1].answer == "3"
    assert rows[0].messages == ({"role": "user", "content": PROBLEM},)
    assert rows[0].metadata["ability"] == "math"
    # Without messages_key the prompt style's instruction is added to `problem` instead.
    plain, _ = read_rows(DataFileSpec(str(out)))
    assert plain[0].problem == PROBLEM and plain[0].messages is None


def test_a_bad_record_stops_the_conversion_unless_skipped(tmp_path):
    source = tmp_path / "math.jsonl"
    lines = [record(0), record(1, reward_model={"style": "rule"}), record(2)]
    source.write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    with pytest.raises(MalformedRowError, match=r"math.jsonl:2: missing field 'reward_model"):
        convert_files([source], out)
    assert not out.exists() and not list(tmp_path.glob("*.partial"))  # nothing half-written
    report = convert_files([source], out, skip_bad=True)
    assert report.rows == 2 and [w for w, _ in report.skipped] == [f"{source}:2"]
    assert main([str(source), "--out", str(tmp_path / "x.txt")]) == 2  # not a .jsonl file
