"""`python -m bapo_jax.eval` end to end on the embedded engine with a tiny random model on AIME
2024 (scores ~0: the report's structure and its consistency are what is checked), and the
early, named errors for bad input."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from bapo_jax.data.datasets import read_math_rows, shipped_set
from bapo_jax.eval import metrics
from bapo_jax.eval.__main__ import (
    UsageError,
    build_engine,
    build_parser,
    main,
    resolve_benchmark,
    tiny_random_model,
    validate_args,
)
from bapo_jax.models import Qwen2Config, save_pretrained
from bapo_jax.models.tokenizer import SHIPPED_TOKENIZER_DIR, load_tokenizer

SMOKE = ["--benchmark", "aime2024", "--tiny-random", "--limit", "3", "--k", "2"]
SMOKE += ["--max-tokens", "8", "--seed", "3"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("eval")
    report = main([*SMOKE, "--out-dir", str(out), "--save-responses"])
    return report, out


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_cli_writes_a_consistent_report(run):
    report, out = run
    assert json.loads((out / "eval.json").read_text()) == json.loads(json.dumps(report))
    config, summary, problems = report["config"], report["summary"], report["problems"]
    assert config["engine"] == "embedded" and config["model"] == "tiny-random(seed=3)"
    assert config["k"] == 2 and config["num_problems"] == 3
    assert config["sampling"]["temperature"] == 0.6 and config["sampling"]["top_p"] == 1.0
    gold_rows, _ = read_math_rows(shipped_set("aime2024").path("test"))
    assert [p["id"] for p in problems] == [r.id for r in gold_rows[:3]]
    assert [p["gold"] for p in problems] == [r.answer for r in gold_rows[:3]]

    correct = np.asarray([p["samples"]["correct"] for p in problems], bool)  # [3, 2]
    lengths = np.asarray([p["samples"]["lengths"] for p in problems])
    finish = np.asarray([p["samples"]["finish_reasons"] for p in problems])
    assert correct.shape == lengths.shape == finish.shape == (3, 2)
    assert ((lengths >= 1) & (lengths <= 8)).all()
    assert set(finish.ravel()) <= {"stop", "length"}
    np.testing.assert_array_equal(finish == "length", lengths == 8)
    for p, row in enumerate(problems):
        assert row["index"] == p
        assert row["num_correct"] == correct[p].sum()
        assert row["truncated"] == (finish[p] == "length").sum()
        np.testing.assert_allclose(row["mean_length"], lengths[p].mean())
        assert row["no_answer"] == sum(a is None for a in row["samples"]["answers"])

    m = summary["metrics"]
    assert set(m) == {
        "avg@2",
        "pass@1",
        "pass@2",
        "maj@2",
        "run_accuracy_std",
        "run_accuracy_min",
        "run_accuracy_max",
    }
    np.testing.assert_allclose(m["avg@2"], correct.mean())
    np.testing.assert_allclose(m["pass@1"], correct.mean())
    np.testing.assert_allclose(
        m["pass@2"], np.mean([metrics.pass_at_k(2, int(c), 2) for c in correct.sum(1)])
    )
    np.testing.assert_allclose(m["maj@2"], np.mean([p["majority_correct"] for p in problems]))
    assert summary["lengths"]["all"]["count"] == 6
    assert summary["lengths"]["all"]["max"] == lengths.max()
    assert report["rewards"]["checks"] == 6

    markdown = (out / "eval.md").read_text()
    for row in problems:
        assert f"| {row['index']} | {row['id']} | {row['gold']} |" in markdown
    samples = [json.loads(line) for line in (out / "samples.jsonl").open()]
    assert [(s["problem_index"], s["sample_index"]) for s in samples] == [
        (p, j) for p in range(3) for j in range(2)
    ]


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_cli_same_seed_same_report(run, tmp_path):
    report, _ = run
    again = main([*SMOKE, "--out-dir", str(tmp_path), "--no-progress"])
    assert again["problems"] == report["problems"]
    assert again["summary"] == report["summary"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--benchmark", "aime2023", "--tiny-random"], "--benchmark must be one of"),
        (["--benchmark", "/no/such/set.jsonl", "--tiny-random"], "file does not exist"),
        (["--benchmark", "aime2024", "--tiny-random", "--k", "0"], "--k must be >= 1, got 0"),
        (
            ["--benchmark", "aime2024", "--model-dir", "/no/such/model"],
            "--model-dir must be an existing directory, got '/no/such/model'",
        ),
        (["--benchmark", "aime2024"], "--model-dir is required with --engine embedded"),
        (["--benchmark", "aime2024", "--tiny-random", "--limit", "0"], "--limit must be >= 1"),
        (
            ["--benchmark", "aime2024", "--tiny-random", "--temperature", "0"],
            "--temperature must be > 0, got 0.0",
        ),
        (["--benchmark", "aime2024", "--tiny-random", "--top-p", "1.5"], "--top-p must be in"),
        (
            ["--benchmark", "aime2024", "--engine", "vllm", "--tiny-random"],
            "--tiny-random is only for --engine embedded",
        ),
        (
            ["--benchmark", "aime2024", "--engine", "vllm", "--model-dir", "."],
            "--engine vllm needs at least one --vllm-url",
        ),
    ],
)
def test_bad_input_fails_early_naming_the_flag(argv, message, tmp_path):
    with pytest.raises(UsageError, match=message.replace("(", r"\(").replace(")", r"\)")):
        main([*argv, "--out-dir", str(tmp_path)])
    assert not (tmp_path / "eval.json").exists()


def test_vllm_engine_is_built_from_urls_without_contacting_a_server():
    args = build_parser().parse_args(
        [
            "--benchmark",
            "aime2024",
            "--engine",
            "vllm",
            "--vllm-url",
            "http://127.0.0.1:1/",
            "--vllm-url",
            "http://127.0.0.1:2",
            "--vllm-model",
            "served",
            "--tokenizer-dir",
            str(SHIPPED_TOKENIZER_DIR),
            "--out-dir",
            "unused",
        ]
    )
    validate_args(args)
    tokenizer = load_tokenizer(Path(args.tokenizer_dir))
    engine, stop_ids, description, max_context = build_engine(args, tokenizer)
    assert engine.config.urls == ("http://127.0.0.1:1", "http://127.0.0.1:2")
    assert engine.config.model == "served" and description == "vllm:served"
    assert stop_ids == (tokenizer.eos_id,) and max_context is None
    engine.close()


def _checkpoint_with_tokenizer(path: Path, model) -> Path:
    save_pretrained(model, path)
    for f in SHIPPED_TOKENIZER_DIR.iterdir():
        if f.is_file():
            shutil.copy(f, path / f.name)
    return path


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_cli_loads_a_model_dir_and_stops_on_every_eos(tmp_path, capsys):
    tokenizer = load_tokenizer()
    model = tiny_random_model(tokenizer.vocab_size, tokenizer.eos_id, seed=1)
    # An instruct model's eos list, and a context too short for the prompt (a warning).
    model.config = model.config.replace(eos_token_id=(151645, 151643), max_position_embeddings=64)
    model_dir = _checkpoint_with_tokenizer(tmp_path / "model", model)
    report = main(
        [
            "--benchmark",
            "aime2025",
            "--model-dir",
            str(model_dir),
            "--limit",
            "1",
            "--k",
            "1",
            "--max-tokens",
            "4",
            "--no-progress",
            "--out-dir",
            str(tmp_path / "out"),
        ]
    )
    assert report["config"]["model"] == str(model_dir)
    assert report["config"]["sampling"]["stop_token_ids"] == [151643, 151645]
    assert report["config"]["tokenizer"] == str(model_dir)
    (row,) = report["problems"]
    assert row["samples"]["lengths"][0] <= 4 and len(row["samples"]["correct"]) == 1
    assert "1 of 1 prompts + max_tokens=4 exceed the model's max_position_embeddings=64" in (
        capsys.readouterr().err
    )


def test_model_whose_vocab_is_smaller_than_the_tokenizer_is_refused_before_loading(tmp_path):
    model_dir = tmp_path / "model"  # config.json only: the check comes before any weight is read
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(Qwen2Config.preset("tiny").to_hf_dict()))
    for f in SHIPPED_TOKENIZER_DIR.iterdir():
        if f.is_file():
            shutil.copy(f, model_dir / f.name)
    with pytest.raises(UsageError, match="tokenizer has 151665 ids but the model's vocab_size"):
        main(
            [
                "--benchmark",
                "aime2024",
                "--model-dir",
                str(model_dir),
                "--k",
                "1",
                "--out-dir",
                str(tmp_path / "out"),
            ]
        )


def test_user_jsonl_benchmark(tmp_path):
    data = tmp_path / "mine.jsonl"
    data.write_text('{"problem": "1+1?", "answer": 2}\n')
    assert resolve_benchmark(str(data)) == ("mine", data)
    assert resolve_benchmark("gsm8k") == ("gsm8k", shipped_set("gsm8k").path("test"))
    with pytest.raises(UsageError, match="'math_l3to5' has no test split"):
        resolve_benchmark("math_l3to5")
