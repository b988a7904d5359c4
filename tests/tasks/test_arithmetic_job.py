"""The main job's pieces: the model shape -> Qwen2 config mapping (`benchmarks.embedded_decode`
reuses it), the warm start kept on disk, and the loop report of summary.json."""

from __future__ import annotations

import dataclasses
import os

import chex
import pytest

from bapo_jax.models import Qwen2Config
from bapo_jax.models.tokenizer import load_tokenizer
from bapo_jax.tasks.arithmetic_job import (
    ModelShape,
    TaskConfig,
    WarmStartConfig,
    prepare,
    run_job,
)
from bapo_jax.tasks.job_report import loop_report


def test_model_shape_config_has_the_shape_a_tied_head_and_the_token_ids():
    config = ModelShape(layers=3, hidden=64, heads=4, kv_heads=2).qwen2_config(
        48, bos_token_id=1, eos_token_id=2, pad_token_id=0
    )
    chex.assert_equal(
        (config.vocab_size, config.hidden_size, config.intermediate_size), (48, 64, 256)
    )
    chex.assert_equal((config.num_hidden_layers, config.max_window_layers), (3, 3))
    chex.assert_equal((config.num_attention_heads, config.num_key_value_heads), (4, 2))
    chex.assert_equal((config.head_dim, config.tie_word_embeddings), (16, True))
    chex.assert_equal((config.bos_token_id, config.eos_token_id, config.pad_token_id), (1, 2, 0))


def test_warm_start_is_written_once_and_read_back_by_a_rerun(tmp_path):
    task = TaskConfig(n_basic=60, n_target_sft=8, n_eval=8, vocab_size=40)
    shape = ModelShape(layers=1, hidden=64, heads=1, kv_heads=1)
    warm = WarmStartConfig(steps=2, batch_size=8, length=32, warmup_steps=1)
    first = prepare(task, shape, warm, 16, str(tmp_path / "warm_start"), eval_max_tokens=8)
    assert first.warm is not None and sorted(os.listdir(tmp_path)) == ["warm_start"]
    config = Qwen2Config.from_hf(first.hf_dir)
    chex.assert_equal(config, first.task.model_config)
    again = prepare(task, shape, warm, 16, str(tmp_path / "warm_start"), eval_max_tokens=8)
    assert again.warm is None  # read back, not trained again
    chex.assert_equal((again.loss, again.accuracy), (first.loss, first.accuracy))
    assert again.task.tokenizer.encode("1+2*3=") == first.task.tokenizer.encode("1+2*3=")
    # hf/ is a whole HF checkpoint: the tokenizer in HF form gives the task tokenizer's ids.
    hf_tokenizer = load_tokenizer(first.hf_dir)
    assert (hf_tokenizer.eos_id, hf_tokenizer.pad_id) == (config.eos_token_id, config.pad_token_id)
    text = "3+4-2=7-2=5.\\boxed{5}"
    assert hf_tokenizer.encode(text) == first.task.tokenizer.encode(text)
    os.remove(os.path.join(first.hf_dir, "tokenizer.json"))  # a warm start from before
    prepare(task, shape, warm, 16, str(tmp_path / "warm_start"), eval_max_tokens=8)
    assert load_tokenizer(first.hf_dir).encode(text) == first.task.tokenizer.encode(text)
    other = dataclasses.replace(warm, steps=3)
    with pytest.raises(ValueError, match="holds a warm start for other settings"):
        prepare(task, shape, other, 16, str(tmp_path / "warm_start"), eval_max_tokens=8)


def test_loop_report_weighs_the_agreement_by_tokens_and_counts_mismatches():
    rows = [
        {"time/generate": 2.0, "time/update": 1.0, "overlap/generation_s": 2.0,
         "overlap/hidden_s": 0.0, "trained_tokens": 10.0, "agreement/tokens": 10.0,
         "agreement/mean_abs": 1e-6, "agreement/max_abs": 4e-6, "version_mismatch/tokens": 0.0},
        {"time/generate": 4.0, "time/update": 3.0, "overlap/generation_s": 4.0,
         "overlap/hidden_s": 3.0, "trained_tokens": 30.0, "agreement/tokens": 30.0,
         "agreement/mean_abs": 3e-6, "agreement/max_abs": 5e-6, "version_mismatch/tokens": 2.0},
    ]  # fmt: skip
    report = loop_report(rows)
    timing, behaviour = report["timing_per_iteration"], report["behaviour"]
    chex.assert_equal((timing["mean_generate_s"], timing["mean_update_s"]), (3.0, 2.0))
    assert timing["generation_hidden_share"] == 0.5  # 3 of 6 generation seconds
    assert behaviour["trained_tokens"] == behaviour["logprob_checked_tokens"] == 40
    assert abs(behaviour["logprob_abs_diff_mean"] - (10 * 1e-6 + 30 * 3e-6) / 40) < 1e-12
    chex.assert_equal(
        (behaviour["logprob_abs_diff_max"], behaviour["version_mismatch_tokens"]), (5e-6, 2)
    )


def test_a_job_without_evaluation_is_refused_before_any_work(tmp_path):
    from experiments import cpu_arithmetic as c

    config = dataclasses.replace(c.RUN, trainer=dataclasses.replace(c.RUN.trainer, eval_every=0))
    with pytest.raises(ValueError, match=r"trainer\.eval_every must be >= 1 for this job.*got 0"):
        run_job(c.TASK, c.SHAPE, c.WARM_START, config, str(tmp_path))
    assert os.listdir(tmp_path) == []  # no warm start, nothing written
