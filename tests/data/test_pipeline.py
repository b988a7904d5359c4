"""The grain prompt pipeline: deterministic for a seed, exact resumption from a saved
state, epochs that cover every prompt, and prompt-length filtering with a drop count."""

import itertools
import json

import numpy as np
import pytest
import tensorflow_datasets as tfds

from bapo_jax.data import (
    MathRow,
    PipelineConfig,
    PromptSource,
    build_messages,
    prepare_shipped,
    prompt_iterator,
    render_prompt,
)
from bapo_jax.models import tokenizer as tok

tfds.display_progress_bar(False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tfds")
    prepare_shipped("math_l3to5", directory)
    prepare_shipped("math500", directory)
    return str(directory)


@pytest.fixture(scope="module")
def math_train(data_dir):
    return tfds.data_source("bapo_math/math_l3to5", split="train", data_dir=data_dir)


@pytest.fixture(scope="module")
def qwen():
    return tok.load_tokenizer()


def _ids(batches):
    return [[example.id for example in batch] for batch in batches]


@pytest.fixture(scope="module")
def math500(data_dir):
    return tfds.data_source("bapo_math/math500", split="test", data_dir=data_dir)


def test_resume_exactly_from_saved_state(math500):
    source = PromptSource(math500)
    config = PipelineConfig(batch_size=64, seed=7)
    iterator = prompt_iterator(source, config)
    # 500 // 64 = 7 full batches per epoch: the saved position is inside the second epoch.
    head = [next(iterator) for _ in range(10)]
    state = json.loads(json.dumps(iterator.get_state()))  # saved to disk in a real run
    tail = [next(iterator) for _ in range(5)]

    resumed = prompt_iterator(source, config)
    resumed.set_state(state)
    assert _ids([next(resumed) for _ in range(5)]) == _ids(tail)
    fresh = prompt_iterator(source, config)
    assert _ids(itertools.islice(fresh, 10)) == _ids(head)  # same seed, same order
    first_epoch = [i for batch in _ids(head)[:7] for i in batch]
    assert len(set(first_epoch)) == 7 * 64  # no prompt repeats within an epoch


def test_one_epoch_covers_every_training_row_once(math_train):
    one_epoch = PipelineConfig(batch_size=500, seed=1, num_epochs=1, drop_remainder=False)
    batches = list(prompt_iterator(PromptSource(math_train), one_epoch))
    ids = [ex.id for batch in batches for ex in batch]
    assert [len(b) for b in batches] == [500] * 17 + [19]
    assert len(ids) == len(set(ids)) == 8519


def test_seed_changes_order_and_no_shuffle_keeps_file_order(math500):
    def epoch_indices(config):
        return [
            ex.index for batch in prompt_iterator(PromptSource(math500), config) for ex in batch
        ]

    seeded = [PipelineConfig(batch_size=100, seed=s, num_epochs=1) for s in (1, 2)]
    first, second = epoch_indices(seeded[0]), epoch_indices(seeded[1])
    assert sorted(first) == sorted(second) == list(range(500))
    assert first != second
    assert epoch_indices(seeded[0]) == first
    unshuffled = PipelineConfig(batch_size=100, shuffle=False, num_epochs=1)
    np.testing.assert_array_equal(epoch_indices(unshuffled), np.arange(500))


def test_examples_carry_rows_and_rendered_prompts(math500, qwen):
    source = PromptSource(math500, tokenizer=qwen)
    example = source[3]
    assert example.index == 3
    messages = build_messages(example.problem, "qwen_math")
    assert list(example.messages) == messages
    assert list(example.prompt_ids) == render_prompt(messages, qwen, "qwen_math")


def test_prompt_length_filter_counts_drops(math500, qwen):
    full = PromptSource(math500, tokenizer=qwen)
    lengths = [len(full[i].prompt_ids) for i in range(len(full))]
    limit = int(np.median(lengths))
    filtered = PromptSource(math500, tokenizer=qwen, max_prompt_tokens=limit)
    expected_kept = sum(n <= limit for n in lengths)
    assert len(filtered) == expected_kept
    assert filtered.num_dropped == 500 - expected_kept > 0
    assert all(len(filtered[i].prompt_ids) <= limit for i in range(len(filtered)))
    with pytest.raises(ValueError, match="no prompts left: all 500 rows are longer"):
        PromptSource(math500, tokenizer=qwen, max_prompt_tokens=1)


def test_source_from_rows_and_config_errors():
    rows = [MathRow(f"r{i}", f"What is {i}+{i}?", str(2 * i)) for i in range(10)]
    source = PromptSource(rows, style="r1_distill")
    assert source[4].answer == "8" and source[4].prompt_ids is None
    with pytest.raises(ValueError, match="max_prompt_tokens needs a tokenizer"):
        PromptSource(rows, max_prompt_tokens=100)
    with pytest.raises(ValueError, match="batch_size must be >= 1, got 0"):
        PipelineConfig(batch_size=0)
    with pytest.raises(ValueError, match="num_epochs must be >= 1 or None, got 0"):
        PipelineConfig(batch_size=2, num_epochs=0)
