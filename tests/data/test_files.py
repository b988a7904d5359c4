"""Researchers' own files (`data.files`): verl's Parquet layout, renamed JSONL columns with a
prompt template, bad rows named by file, line and key (or skipped and counted), chat prompts
rendered by the shipped Qwen2.5 chat template, and array_record round trips."""

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import tensorflow_datasets as tfds

from bapo_jax.data import (
    DataFileSpec,
    DataSpecError,
    MalformedRowError,
    MathRow,
    PromptSource,
    decode_example,
    prepare_files,
    read_rows,
)
from bapo_jax.data.files import prompt_messages
from bapo_jax.data.tfds_builders import MathFilesConfig
from bapo_jax.models.tokenizer import load_tokenizer

tfds.display_progress_bar(False)

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
VERL_ROWS = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "What is 2+3?"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "5"},
        "extra_info": {"split": "train", "index": 7},
    },
    {
        "data_source": "openai/gsm8k",
        "prompt": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 4*4?"},
        ],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "16"},
        "extra_info": {"split": "train", "index": 8},
    },
]


def _verl_parquet(path, rows=VERL_ROWS):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _jsonl(path, records):
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records),
        encoding="utf-8",
    )
    return path


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer(None)


def test_verl_parquet_rows(tmp_path):
    path = _verl_parquet(tmp_path / "train.parquet")
    rows, report = read_rows(DataFileSpec.verl(path))
    assert report.rows == 2 and report.num_skipped == 0
    assert rows[0] == MathRow(
        id="train-1",
        problem="What is 2+3?",  # no problem column: the user turn
        answer="5",
        messages=({"role": "user", "content": "What is 2+3?"},),
        metadata={
            "data_source": "openai/gsm8k",
            "ability": "math",
            "extra_info": {"split": "train", "index": 7},
        },
    )
    assert rows[1].messages == (
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 4*4?"},
    )
    assert rows[1].answer == "16" and rows[1].problem == "What is 4*4?"
    json.dumps(rows[1].metadata)  # JSON-able
    assert hash(rows[0]) == hash(MathRow("train-1", "What is 2+3?", "5"))  # still hashable
    # An integer nested id, and only the metadata asked for (required).
    spec = DataFileSpec.verl(path, id_key="extra_info.index", metadata_keys=("extra_info.split",))
    rows, _ = read_rows(spec)
    assert [r.id for r in rows] == ["7", "8"]
    assert rows[0].metadata == {"extra_info.split": "train"}


def test_jsonl_with_renamed_columns_and_a_template(tmp_path):
    path = _jsonl(
        tmp_path / "mine.jsonl",
        [
            {"uid": "q1", "question": "What is 2+3?", "solution": 5, "meta": {"topic": "sums"}},
            {"uid": "q2", "question": "What is 4*4?", "solution": "16", "meta": {"topic": "x"}},
        ],
    )
    spec = DataFileSpec(
        path,
        problem_key="question",
        answer_key="solution",
        id_key="uid",
        template="[{meta[topic]}] {problem}\nAnswer in \\boxed{{}}.",
        metadata_keys=("meta.topic",),
    )
    rows, _ = read_rows(spec)
    assert rows[0] == MathRow(
        id="q1",
        problem="What is 2+3?",
        answer="5",
        messages=({"role": "user", "content": "[sums] What is 2+3?\nAnswer in \\boxed{}."},),
        metadata={"meta.topic": "sums"},
    )
    assert rows[1].messages[0]["content"] == "[x] What is 4*4?\nAnswer in \\boxed{}."
    # The row's own field names work too, and the prompt stands in for a missing problem.
    rows, _ = read_rows(DataFileSpec(path, answer_key="solution", template="Q: {question}"))
    assert rows[0].problem == "Q: What is 2+3?" and rows[0].id == "mine-1"


def test_nested_key_missing_names_file_line_and_key(tmp_path):
    good = VERL_ROWS[0]
    bad = {**good, "reward_model": {"style": "rule"}}
    path = _jsonl(tmp_path / "verl.jsonl", [good, bad])
    expected = (
        f"{path}:2: missing field 'reward_model.ground_truth' "
        "('reward_model' has no 'ground_truth'; its fields: style)"
    )
    with pytest.raises(MalformedRowError, match=re.escape(expected)):
        read_rows(DataFileSpec.verl(path))
    # Parquet: a null nested value, located by row number.
    rows = [good, {**good, "reward_model": {"style": "rule", "ground_truth": None}}]
    parquet = _verl_parquet(tmp_path / "verl.parquet", rows)
    with pytest.raises(
        MalformedRowError,
        match=re.escape(f"{parquet}:row 2: missing field 'reward_model.ground_truth'"),
    ):
        read_rows(DataFileSpec.verl(parquet))
    # A renamed column that the file does not have lists the row's fields.
    with pytest.raises(MalformedRowError, match=re.escape("its fields: data_source, prompt")):
        read_rows(DataFileSpec(path, problem_key="question"))


def test_bad_rows_skipped_and_counted(tmp_path):
    good = VERL_ROWS[0]
    records = [
        good,
        {**good, "prompt": [{"role": "assistant", "content": "hi"}]},  # last turn not the user's
        "{broken",
        {**good, "prompt": [{"role": "user", "content": "What is 1+1?"}]},
        {**good, "reward_model": {"ground_truth": 2.5}},  # float answer
    ]
    path = _jsonl(tmp_path / "train.jsonl", records)
    rows, report = read_rows(DataFileSpec.verl(path, on_bad_row="skip"))
    assert [r.problem for r in rows] == ["What is 2+3?", "What is 1+1?"]
    assert [r.id for r in rows] == ["train-1", "train-4"]
    assert report.rows == 2 and report.num_skipped == 3
    assert [line for line, _ in report.skipped] == [2, 3, 5]
    assert "the last message must be the user's" in report.skipped[0][1]
    assert report.skipped[1][1].startswith("bad JSON")
    assert (
        "field 'reward_model.ground_truth' must be a string or an integer, got float"
        in (report.skipped[2][1])
    )
    with pytest.raises(MalformedRowError, match=re.escape(f"{path}:2: field 'prompt'")):
        read_rows(DataFileSpec.verl(path))
    # Explicit metadata keys are required: every row lacks "difficulty" -> no good row.
    with pytest.raises(
        MalformedRowError, match=r"no valid rows \(5 malformed\); first, train.jsonl:1: missing"
    ):
        read_rows(DataFileSpec.verl(path, metadata_keys=("difficulty",), on_bad_row="skip"))


@pytest.mark.parametrize(
    ("changes", "field", "message"),
    [
        ({"path": "rows.csv"}, "path", "must end in .jsonl, .json or .parquet"),
        ({"template": "{}\nAnswer in \\boxed{}."}, "template", "positional field"),
        ({"template": "no fields here"}, "template", "uses no row field"),
        ({"template": "{question"}, "template", "expected '}' before end of string"),
        ({"messages_key": "prompt", "template": "{q}"}, "template", "not both"),
        ({"answer_key": "reward_model..x"}, "answer_key", "a field name or dotted key"),
        ({"metadata_keys": "extra_info"}, "metadata_keys", "a list of keys"),
        ({"on_bad_row": "ignore"}, "on_bad_row", "'error' or 'skip', got 'ignore'"),
    ],
)
def test_spec_errors_name_the_field(changes, field, message):
    with pytest.raises(DataSpecError, match=re.escape(message)) as info:
        DataFileSpec(**{"path": "rows.jsonl", **changes})
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")


def test_prompt_source_renders_row_messages_with_the_chat_template(tmp_path, qwen):
    rows, _ = read_rows(DataFileSpec.verl(_verl_parquet(tmp_path / "train.parquet")))
    plain = MathRow("p", "What is 1+1?", "2")
    source = PromptSource([*rows, plain], tokenizer=qwen)
    first, second, third = source[0], source[1], source[2]
    expected = (
        f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n"  # the template's default system turn
        "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert list(first.prompt_ids) == qwen.encode(expected)
    assert first.messages == rows[0].messages
    assert first.metadata == {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "extra_info": {"split": "train", "index": 7},
    }
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 4*4?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert list(second.prompt_ids) == qwen.encode(expected)
    # A row without messages keeps the style's prompt (problem + boxed instruction).
    assert third.messages[-1]["content"].startswith("What is 1+1?\nPlease reason step by step")
    assert third.metadata == {}
    # r1_distill: the same messages, the response opening with <think>.
    r1 = PromptSource(rows, style="r1_distill", tokenizer=qwen)
    assert list(r1[1].prompt_ids) == qwen.encode(expected + "<think>\n")


def test_system_prompt_goes_first_unless_the_row_has_one():
    rows = [
        MathRow("a", "x?", "1", messages=({"role": "user", "content": "x?"},)),
        MathRow(
            "b",
            "y?",
            "2",
            messages=({"role": "system", "content": "S"}, {"role": "user", "content": "y?"}),
        ),
    ]
    assert prompt_messages(rows[0], "qwen_math", system_prompt="T") == [
        {"role": "system", "content": "T"},
        {"role": "user", "content": "x?"},
    ]
    assert prompt_messages(rows[1], "qwen_math", system_prompt="T")[0]["content"] == "S"
    with pytest.raises(ValueError, match="system_prompt must be None for style 'r1_distill'"):
        prompt_messages(rows[0], "r1_distill", system_prompt="T")


def test_array_record_keeps_messages_and_metadata(tmp_path):
    path = _verl_parquet(tmp_path / "train.parquet")
    spec = DataFileSpec.verl(path)
    rows, _ = read_rows(spec)
    data_dir = tmp_path / "tfds"
    prepare_files("verl_set", {"train": spec}, data_dir)
    source = tfds.data_source("bapo_math_files/verl_set", split="train", data_dir=str(data_dir))
    assert [decode_example(source[i]) for i in range(len(source))] == rows
    # The fingerprint covers the columns: another spec of the same file is refused.
    with pytest.raises(ValueError, match="was prepared from other files or flags"):
        prepare_files(
            "verl_set", {"train": DataFileSpec.verl(path, id_key="extra_info.index")}, data_dir
        )
    same = MathFilesConfig(name="a", data_files={"train": spec}).fingerprint()
    assert (
        same
        == MathFilesConfig(name="b", data_files={"train": DataFileSpec.verl(path)}).fingerprint()
    )
