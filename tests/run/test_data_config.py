"""The run config's data side: column settings of `data` and `eval` (verl Parquet, renamed
JSONL), their command-line overrides, errors naming the key, and what `build_prompts` /
`EvalSets` read (skipped-row counts, row metadata on the prompts)."""

from __future__ import annotations

import dataclasses
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bapo_jax.data.datasets import shipped_set
from bapo_jax.models.tokenizer import load_tokenizer
from bapo_jax.overrides import apply_overrides, config_from_dict, config_to_dict
from bapo_jax.rewards.config import RewardSection
from bapo_jax.run.build import EvalSets, build_prompts
from bapo_jax.run.config import DataSection, EvalSection, RunConfig, RunConfigError
from bapo_jax.train.config import RolloutConfig, TrainerConfig

VERL = ["data.messages_key=prompt", "data.answer_key=reward_model.ground_truth"]


def _verl_parquet(path, answers=("5", "16", "9")):
    rows = [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"Question {i}?"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": i},
        }
        for i, answer in enumerate(answers)
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_overrides_set_the_columns_and_round_trip(tmp_path):
    train = _verl_parquet(tmp_path / "train.parquet")
    config = apply_overrides(
        RunConfig(),
        [
            f"data.train={train}",
            *VERL,
            'data.metadata_keys=["data_source", "extra_info.index"]',
            "data.on_bad_row=skip",
            f"eval.sets={train},aime2024",
            "eval.messages_key=prompt",
            "eval.answer_key=reward_model.ground_truth",
        ],
    )
    d = config.data
    assert (d.messages_key, d.answer_key, d.on_bad_row) == (
        "prompt",
        "reward_model.ground_truth",
        "skip",
    )
    assert d.metadata_keys == ("data_source", "extra_info.index")
    spec = d.file_spec()
    assert (spec.path, spec.messages_key, spec.metadata_keys) == (train, "prompt", d.metadata_keys)
    specs = config.eval.set_specs()
    assert list(specs) == ["train", "aime2024"]  # metric names: file stem, shipped name
    assert specs["train"].answer_key == "reward_model.ground_truth"
    # A shipped set keeps its own layout: the column keys do not apply to it.
    assert specs["aime2024"].messages_key is None
    assert specs["aime2024"].path == str(shipped_set("aime2024").path("test"))
    again = config_from_dict(RunConfig, json.loads(json.dumps(config_to_dict(config))))
    assert again.data == d and again.eval == config.eval
    # A template typed in JSON quotes gets its newline; shipped sets take it too.
    config = apply_overrides(RunConfig(), ['data.template="{problem}\\nAnswer: \\\\boxed{{}}."'])
    assert config.data.template == "{problem}\nAnswer: \\boxed{{}}."
    assert config.data.file_spec().template == config.data.template


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.template={}", "data: template: {} is a positional field"),
        ("data.answer_key=", "data: answer_key: a field name or dotted key"),
        ("data.on_bad_row=ignore", "bad value 'ignore' for config key 'data.on_bad_row'"),
        ("data.train=math_l3-5", "data: train: 'math_l3-5' is neither a shipped set"),
        ("eval.sets=/no/such/test.parquet", "eval: sets: file not found: '/no/such/test.parquet'"),
        ("eval.sets=math_l3to5", "eval: sets: 'math_l3to5' has no test split"),
        ("eval.sets=aime2024.txt", "eval: sets: 'aime2024.txt' is neither a shipped set"),
    ],
)
def test_bad_column_settings_name_the_key(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("{", r"\{")):
        apply_overrides(RunConfig(), [override])


def test_two_eval_sets_with_one_metric_name_are_refused(tmp_path):
    (tmp_path / "a").mkdir()
    first = _verl_parquet(tmp_path / "a" / "test.parquet")
    second = _verl_parquet(tmp_path / "test.parquet")
    with pytest.raises(RunConfigError, match="sets: two sets share a metric name"):
        EvalSection(sets=(first, second))


def test_build_prompts_reads_the_file_and_counts_skipped_rows(tmp_path):
    train = _verl_parquet(tmp_path / "train.parquet", answers=("5", None, "9"))
    trainer = TrainerConfig(rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=2))
    data = DataSection(
        train=train,
        messages_key="prompt",
        answer_key="reward_model.ground_truth",
        on_bad_row="skip",
        seed=3,
    )
    config = RunConfig(trainer=trainer, data=data)
    tokenizer = load_tokenizer(None)
    prompts = build_prompts(config, tokenizer)
    assert prompts.read_report.num_skipped == 1 and prompts.dropped_prompts == 0
    assert prompts.read_report.skipped[0][0] == 2  # the null answer's row
    assert prompts.metrics() == {"data/skipped_rows": 1, "data/dropped_prompts": 0}
    batch = next(prompts.batches)
    by_id = {example.id: example for example in batch}
    assert set(by_id) == {"train-1", "train-3"}
    assert by_id["train-3"].answer == "9"
    assert by_id["train-3"].metadata == {
        "data_source": "openai/gsm8k",
        "ability": "math",
        "extra_info": {"split": "train", "index": 2},
    }
    assert by_id["train-3"].messages == ({"role": "user", "content": "Question 2?"},)
    strict = dataclasses.replace(config, data=dataclasses.replace(data, on_bad_row="error"))
    with pytest.raises(RunConfigError, match=r"data.train: .*train.parquet:row 2: missing field"):
        build_prompts(strict, tokenizer)


def test_eval_files_are_read_with_the_eval_columns(tmp_path):
    test = _verl_parquet(tmp_path / "test.parquet", answers=("5", None, "9"))
    ev = EvalSection(
        sets=("aime2024", test),
        messages_key="prompt",
        answer_key="reward_model.ground_truth",
        on_bad_row="skip",
    )
    sets = EvalSets(RunConfig(eval=ev), tokenizer=None, pool=None, stops=(0,))
    assert sets.skipped == {"aime2024": 0, "test": 1}
    assert [len(rows) for rows in sets.rows.values()] == [30, 2]
    assert sets.reward == {"aime2024": "math_verify", "test": "math_verify"}
    plugin = RunConfig(eval=ev, rewards=RewardSection(fn="exact_match"))
    assert EvalSets(plugin, None, None, (0,)).reward == {
        "aime2024": "math_verify",
        "test": "exact_match",
    }
    strict = RunConfig(eval=dataclasses.replace(ev, on_bad_row="error"))
    with pytest.raises(RunConfigError, match=r"eval.sets: .*test.parquet:row 2: missing field"):
        EvalSets(strict, tokenizer=None, pool=None, stops=(0,))
