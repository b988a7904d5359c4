"""A researcher's own data, reward and evaluation, end to end (docs/data.md, docs/rewards.md).

Two runs through `build_trainer`, each 2 iterations of a tiny head_dim-64 Qwen2 (random
weights, loaded from an HF directory) with the shipped Qwen2.5 tokenizer:
- verl's Parquet layout (chat-message prompts, `reward_model.ground_truth`, `extra_info`), one
  bad row skipped, scored by a verl-signature `compute_score` plug-in that reads `extra_info`;
- a JSONL file with renamed columns and a prompt template, exact-match reward plus a format
  term, evaluated during training on a JSONL eval file.
Then `python -m bapo_jax.eval` scores the verl file on the run's checkpoint, reading the same
columns.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bapo_jax.data.datasets import read_math_rows, shipped_set
from bapo_jax.models import init_model, save_pretrained
from bapo_jax.models.tokenizer import SHIPPED_TOKENIZER_DIR, load_tokenizer
from bapo_jax.overrides import apply_overrides
from bapo_jax.run import build
from bapo_jax.run.config import RunConfig, dump
from bapo_jax.run.dry_run import stand_in_architecture

pytestmark = pytest.mark.slow  # long: in `make test-slow` (CI runs it)

VERL_PLUGIN = "tests.rewards.plugins_for_tests:verl_index_score"
GSM8K = read_math_rows(shipped_set("gsm8k").path("test"))[0][:6]


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> str:
    """An HF directory: a random tiny-tied Qwen2 with head_dim 64 and the shipped tokenizer."""
    directory = tmp_path_factory.mktemp("policy")
    arch = stand_in_architecture(load_tokenizer(None), RunConfig().mesh_config(), head_dim=64)
    save_pretrained(init_model(arch, seed=0), directory)
    for name in os.listdir(SHIPPED_TOKENIZER_DIR):
        if os.path.isfile(SHIPPED_TOKENIZER_DIR / name):
            shutil.copy(SHIPPED_TOKENIZER_DIR / name, directory)
    return str(directory)


def write_verl_parquet(path) -> None:
    """verl's gsm8k preprocessing layout, 6 rows; row 3 has no ground truth (a bad row)."""
    rows = []
    for index, row in enumerate(GSM8K):
        truth = None if index == 3 else row.answer
        rows.append(
            {
                "data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{row.problem} Output the answer."}],
                "ability": "math",
                "reward_model": {"style": "rule", "ground_truth": truth},
                "extra_info": {"split": "test", "index": index},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)


def write_renamed_jsonl(path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in GSM8K:
            record = {"qid": row.id, "question": row.problem, "solution": row.answer}
            f.write(json.dumps(record) + "\n")


def run_config(policy_dir: str, out_dir, overrides: list[str]) -> RunConfig:
    base = [
        f"model.hf_dir={policy_dir}",
        "model.compute_dtype=float32",
        "trainer.steps=2",
        "trainer.rollout.prompts_per_step=2",
        "trainer.rollout.samples_per_prompt=2",
        "trainer.rollout.max_prompt_tokens=256",
        "trainer.rollout.max_response_tokens=8",
        f"trainer.checkpoint.directory={out_dir / 'checkpoints'}",
        "trainer.checkpoint.every=2",
        "trainer.checkpoint.async_save=false",
        "trainer.logging.plots=false",
        "trainer.logging.progress=false",
        "rewards.workers=1",
    ]
    return apply_overrides(RunConfig(), base + overrides)


def train(config: RunConfig, out_dir) -> list[dict]:
    out_dir.mkdir(parents=True)
    dump(config, str(out_dir / "config.json"))
    with build.build_trainer(config, str(out_dir)) as trainer:
        trainer.run()
    with open(out_dir / "metrics.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def test_verl_parquet_trains_with_a_verl_plugin_then_evaluates(policy_dir, tmp_path):
    data = tmp_path / "gsm8k_verl.parquet"
    write_verl_parquet(data)
    out = tmp_path / "verl_run"
    config = run_config(
        policy_dir,
        out,
        [
            f"data.train={data}",
            "data.messages_key=prompt",
            "data.answer_key=reward_model.ground_truth",
            "data.on_bad_row=skip",
            f"rewards.fn={VERL_PLUGIN}",
        ],
    )
    rows = train(config, out)
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:
        assert row["data/skipped_rows"] == 1
        assert row["reward/plugin_errors"] == 0
        # verl_index_score: 0.1 * (1 + extra_info["index"]) for gsm8k rows, whatever the text;
        # each batch holds 2 of the 5 good rows (indices 0, 1, 2, 4, 5), G=2 samples each.
        good = (0, 1, 2, 4, 5)
        possible = {0.1 * (2 + a + b) / 2 for a in good for b in good if a < b}
        assert min(abs(row["reward/mean"] - p) for p in possible) < 1e-6, row["reward/mean"]

    from bapo_jax.eval.__main__ import main as eval_main

    report = eval_main(
        [
            "--run",
            str(out),
            "--benchmark",
            str(data),
            "--messages-key",
            "prompt",
            "--answer-key",
            "reward_model.ground_truth",
            "--on-bad-row",
            "skip",
            "--reward",
            VERL_PLUGIN,
            "--k",
            "2",
            "--max-tokens",
            "8",
            "--out-dir",
            str(tmp_path / "eval"),
            "--no-progress",
        ]
    )
    assert report["config"]["num_problems"] == 5
    assert report["config"]["skipped_rows"] == 1
    assert report["config"]["reward"] == VERL_PLUGIN
    for problem, index in zip(report["problems"], (0, 1, 2, 4, 5), strict=True):
        score = 0.1 * (1 + index)  # the plug-in's, from the row's extra_info
        assert problem["samples"]["scores"] == pytest.approx([score, score])
        assert problem["samples"]["correct"] == [int(score > 0.5)] * 2
    assert report["summary"]["metrics"]["avg@2"] == pytest.approx(1 / 5)


def test_jsonl_with_renamed_columns_trains_and_evaluates(policy_dir, tmp_path):
    data = tmp_path / "renamed.jsonl"
    write_renamed_jsonl(data)
    out = tmp_path / "jsonl_run"
    columns = ["problem_key=question", "answer_key=solution", "id_key=qid"]
    template = json.dumps("{question}\nPut the final answer in \\boxed{{}}.")
    config = run_config(
        policy_dir,
        out,
        [f"data.train={data}", f"data.template={template}"]
        + [f"data.{c}" for c in columns]
        + [f"eval.{c}" for c in columns]
        + [
            f"eval.sets=[{json.dumps(str(data))}]",
            "eval.samples=2",
            "eval.max_tokens=8",
            "eval.limit=2",
            "eval.batch_size=2",
            "trainer.eval_every=2",
            "rewards.fn=exact_match",
            "rewards.format_weight=0.5",
        ],
    )
    rows = train(config, out)
    assert [r["step"] for r in rows] == [0, 1]
    assert rows[0]["data/skipped_rows"] == 0
    assert "eval/renamed/avg@2" in rows[-1]
    for row in rows:  # exact match and the format term give 0, 0.5, 1 or 1.5 per response
        assert np.isfinite(row["reward/mean"])
        assert round(row["reward/mean"] * 8) == pytest.approx(row["reward/mean"] * 8)

    # The run's avg@2 (evaluated after iteration 1 with version 2's weights, sampling seed 2)
    # against the same evaluation redone by the eval CLI on the run's step-2 checkpoint, with the
    # in-run evaluation's settings, and recomputed here from the responses it wrote: each
    # scored by exact_match against its gold answer (correct: > 0.5), then averaged. (The
    # random tiny model answers nothing right in 8 tokens: today both sides are 0.)
    from bapo_jax.eval.__main__ import main as eval_main
    from bapo_jax.rewards.plugins import exact_match

    ev = config.eval
    args = ["--run", str(out), "--step", "2", "--benchmark", str(data)]
    args += ["--problem-key", "question", "--answer-key", "solution", "--id-key", "qid"]
    args += ["--k", str(ev.samples), "--limit", str(ev.limit), "--batch-size", str(ev.batch_size)]
    args += ["--max-tokens", str(ev.max_tokens), "--temperature", str(ev.temperature)]
    args += ["--prompt-style", config.data.prompt_style, "--seed", "2", "--reward", "exact_match"]
    args += ["--out-dir", str(tmp_path / "eval"), "--save-responses", "--no-progress"]
    report = eval_main(args)
    with open(tmp_path / "eval" / "samples.jsonl", encoding="utf-8") as f:
        samples = [json.loads(line) for line in f]
    golds = {row.id: row.answer for row in GSM8K}
    assert [(s["id"], s["sample_index"]) for s in samples] == [
        (row.id, j) for row in GSM8K[: ev.limit] for j in range(ev.samples)
    ]
    correct = [float(exact_match(s["response"], golds[s["id"]]) > 0.5) for s in samples]
    assert [s["correct"] for s in samples] == correct
    assert report["summary"]["metrics"]["avg@2"] == pytest.approx(np.mean(correct), abs=1e-12)
    assert rows[-1]["eval/renamed/avg@2"] == pytest.approx(np.mean(correct), abs=1e-12)
