"""`python -m bapo_jax.eval`'s data side: the column flags of a --benchmark file (verl
Parquet, renamed JSONL with a template), errors naming the flag, and `evaluate` prompting
with a row's own chat messages."""

import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bapo_jax.data import DataFileSpec, MalformedRowError, MathRow, read_rows
from bapo_jax.eval.__main__ import (
    UsageError,
    benchmark_spec,
    build_parser,
    evaluate,
    main,
    resolve_benchmark,
)
from bapo_jax.models.tokenizer import load_tokenizer
from bapo_jax.rollout.types import Rollout, Sample, SamplingParams

QWEN_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."


def _args(*argv):
    return build_parser().parse_args([*argv, "--tiny-random", "--out-dir", "unused"])


def _spec(*argv):
    args = _args(*argv)
    _, path = resolve_benchmark(args.benchmark)
    return benchmark_spec(args, path)


def _verl_parquet(path):
    rows = [
        {
            "data_source": "aime",
            "prompt": [{"role": "user", "content": "What is 2+3?"}],
            "reward_model": {"style": "rule", "ground_truth": "5"},
            "extra_info": {"index": 0},
        }
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_column_flags_make_the_file_spec(tmp_path):
    path = _verl_parquet(tmp_path / "test.parquet")
    spec = _spec(
        "--benchmark",
        str(path),
        "--messages-key",
        "prompt",
        "--answer-key",
        "reward_model.ground_truth",
        "--id-key",
        "extra_info.index",
        "--on-bad-row",
        "skip",
    )
    assert spec == DataFileSpec.verl(path, id_key="extra_info.index", on_bad_row="skip")
    (row,) = read_rows(spec)[0]
    assert (row.id, row.answer) == ("0", "5")
    assert row.messages == ({"role": "user", "content": "What is 2+3?"},)
    assert row.metadata == {"data_source": "aime", "extra_info": {"index": 0}}
    # Defaults: today's {problem, answer} layout; a template in JSON quotes gets its escapes.
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text(json.dumps({"question": "1+1?", "solution": 2}) + "\n")
    assert _spec("--benchmark", str(jsonl)) == DataFileSpec(str(jsonl))
    spec = _spec(
        "--benchmark",
        str(jsonl),
        "--problem-key",
        "question",
        "--answer-key",
        "solution",
        "--template",
        '"{question}\\nAnswer in \\\\boxed{{}}."',
    )
    assert spec.template == "{question}\nAnswer in \\boxed{{}}."
    (row,) = read_rows(spec)[0]
    assert row.messages == ({"role": "user", "content": "1+1?\nAnswer in \\boxed{}."},)
    # A shipped benchmark takes a template (over its {problem}) but no column keys.
    assert _spec("--benchmark", "aime2024", "--template", "{problem} Go.").template == (
        "{problem} Go."
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--benchmark", "aime2024", "--problem-key", "question"],
            "--problem-key describes the columns of a --benchmark file; 'aime2024' is a shipped",
        ),
        (["--benchmark", "aime2024", "--template", "{}"], "--template: {} is a positional field"),
        (["--benchmark", "aime2024", "--template", '"{problem}\\x"'], "--template is not a JSON"),
    ],
)
def test_bad_column_flags_are_named(argv, message):
    with pytest.raises(UsageError, match=re.escape(message)):
        _spec(*argv)
    with pytest.raises(SystemExit):  # argparse refuses an unknown policy
        _args("--benchmark", "aime2024", "--on-bad-row", "ignore")


def test_bad_file_key_is_named_before_any_model_loads(tmp_path):
    path = _verl_parquet(tmp_path / "test.parquet")
    argv = ["--benchmark", str(path), "--tiny-random", "--out-dir", str(tmp_path / "out")]
    with pytest.raises(UsageError, match="--messages-key: a field name or dotted key"):
        main([*argv, "--messages-key", ".prompt"])
    with pytest.raises(MalformedRowError, match=re.escape(f"{path}:row 1: missing field 'answer'")):
        main([*argv, "--messages-key", "prompt"])
    assert not (tmp_path / "out").exists()


class _RecordingEngine:
    """Returns one 1-token sample per prompt, and keeps the prompts it was given."""

    def __init__(self):
        self.prompts = []

    def generate(self, prompt_ids, n, sampling, seed):
        self.prompts.extend(list(p) for p in prompt_ids)
        one = np.asarray([0], np.int32)
        samples = tuple(
            Sample(p, j, one, np.zeros(1, np.float32), np.zeros(1, np.int64), "stop")
            for p in range(len(prompt_ids))
            for j in range(n)
        )
        return Rollout(tuple(tuple(p) for p in prompt_ids), n, samples)


class _ZeroPool:
    def score_batch(self, texts, golds, metadata=None, *, reward="math_verify"):
        return [0.0] * len(texts)


def test_evaluate_prompts_with_the_rows_messages():
    qwen = load_tokenizer(None)
    rows = [
        MathRow("a", "What is 2+3?", "5", messages=({"role": "user", "content": "Sum 2, 3."},)),
        MathRow("b", "What is 4*4?", "16"),
    ]
    engine = _RecordingEngine()
    results = evaluate(
        engine,
        qwen,
        rows,
        k=1,
        sampling=SamplingParams(max_tokens=1, temperature=1.0),
        prompt_style="qwen_math",
        seed=0,
        batch_size=2,
        pool=_ZeroPool(),
    )
    assert [r.problem_id for r in results] == ["a", "b"]
    head = f"<|im_start|>system\n{QWEN_SYSTEM}<|im_end|>\n<|im_start|>user\n"
    tail = "<|im_end|>\n<|im_start|>assistant\n"
    assert engine.prompts[0] == qwen.encode(f"{head}Sum 2, 3.{tail}")
    boxed = "Please reason step by step, and put your final answer within \\boxed{}."
    assert engine.prompts[1] == qwen.encode(f"{head}What is 4*4?\n{boxed}{tail}")
