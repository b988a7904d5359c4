"""The arithmetic task: seeded generation, disjoint splits, scratchpads, reward, prompt source."""

import itertools

import numpy as np
import pytest

from bapo_jax.data.pipeline import PipelineConfig, prompt_iterator
from bapo_jax.models.spm_tokenizer import SentencePieceTokenizer
from bapo_jax.tasks import arithmetic as A

MIXED = A.ArithmeticConfig(
    min_ops=1, max_ops=4, max_operand=99, operators=("+", "-", "*"), max_mul_operand=9
)


def test_generation_is_deterministic_and_seed_dependent():
    first = A.generate_problems(MIXED, "rl", 200, seed=7)
    again = A.generate_problems(MIXED, "rl", 200, seed=7)
    other = A.generate_problems(MIXED, "rl", 200, seed=8)
    assert first == again
    assert [p.expression for p in first] != [p.expression for p in other]


def test_problems_follow_the_config():
    problems = A.generate_problems(MIXED, "sft", 500, seed=0)
    assert len({p.expression for p in problems}) == 500
    for p in problems:
        operators = [c for c in p.expression if c in "+-*"]
        operands = [int(v) for v in p.expression.replace("-", "+").replace("*", "+").split("+")]
        assert 1 <= len(operators) <= 4
        assert all(0 <= v <= 99 for v in operands)
        assert len(p.steps) == len(operators)
        # Python's own precedence is the ground truth (operands are non-negative literals).
        assert p.answer == eval(p.expression)
    assert {c for p in problems for c in p.expression if not c.isdigit()} == {"+", "-", "*"}


def test_splits_are_disjoint_by_construction():
    """Every split's problems hash into that split only, even across configs and seeds."""
    narrow = A.ArithmeticConfig(min_ops=1, max_ops=2, max_operand=9)
    sets = {}
    for split in A.SPLIT_FRACTIONS:
        problems = A.generate_problems(narrow, split, 150, seed=0)
        problems += A.generate_problems(narrow, split, 150, seed=1)
        problems += A.generate_problems(MIXED, split, 300, seed=0)
        assert all(A.split_of(p.expression) == split for p in problems)
        assert all(p.split == split for p in problems)
        sets[split] = {p.expression for p in problems}
    names = list(sets)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert not sets[a] & sets[b], (a, b)


def test_split_fractions_tile_the_unit_interval():
    bounds = sorted(A.SPLIT_FRACTIONS.values())
    assert bounds[0][0] == 0.0 and bounds[-1][1] == 1.0
    assert all(a[1] == b[0] for a, b in itertools.pairwise(bounds))
    fractions = np.array([A.hash_fraction(f"{i}+{j}") for i in range(100) for j in range(100)])
    for low, high in A.SPLIT_FRACTIONS.values():
        share = np.mean((fractions >= low) & (fractions < high))
        np.testing.assert_allclose(share, high - low, atol=0.02)


def test_scratchpads_by_hand():
    problem = A.make_problem([12, 7, 3, 5], ["+", "*", "-"])
    assert problem.expression == "12+7*3-5"
    assert problem.answer == 28
    assert problem.steps == ("7*3=21", "12+21=33", "33-5=28")
    assert problem.chain == ("12+21-5", "33-5", "28")
    assert problem.prompt_text == "12+7*3-5="
    assert problem.target_text == "12+21-5=33-5=28.\\boxed{28}"
    steps = A.make_problem([12, 7, 3, 5], ["+", "*", "-"], scratchpad="steps")
    assert steps.target_text == "7*3=21,12+21=33,33-5=28.\\boxed{28}"
    negative = A.make_problem([5, 9, 3], ["-", "-"])
    assert negative.target_text == "-4-3=-7.\\boxed{-7}"
    assert A.make_problem([2, 3, 4], ["*", "*"]).chain == ("6*4", "24")
    for p in (problem, steps, negative):
        assert A.arithmetic_reward(p.target_text, p.answer) == 1.0
    with pytest.raises(ValueError, match="scratchpad must be one of"):
        A.make_problem([1, 2], ["+"], scratchpad="tree")
    with pytest.raises(ValueError, match="operands must be non-negative ints"):
        A.make_problem([1, -2], ["+"])
    with pytest.raises(ValueError, match="operator must be one of"):
        A.make_problem([1, 2], ["/"])


def test_generator_uses_the_configured_scratchpad():
    config = A.ArithmeticConfig(min_ops=2, max_ops=2, max_operand=9, scratchpad="steps")
    for p in A.generate_problems(config, "sft", 20, seed=0):
        assert p.scratchpad == "steps"
        assert p.target_text.startswith(p.steps[0] + ",")


def test_too_small_problem_space_raises():
    tiny = A.ArithmeticConfig(min_ops=1, max_ops=1, max_operand=2, operators=("+",))
    with pytest.raises(ValueError, match="problem space is too small"):
        A.generate_problems(tiny, "eval", 50, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"min_ops": 0}, "min_ops"),
        ({"min_ops": 3, "max_ops": 2}, "max_ops"),
        ({"min_operand": -1}, "min_operand"),
        ({"max_operand": -1, "min_operand": 0}, "max_operand"),
        ({"operators": ("+", "/")}, "operators"),
        ({"operators": ()}, "operators"),
        ({"max_mul_operand": -3}, "max_mul_operand"),
        ({"scratchpad": "tree"}, "scratchpad"),
    ],
)
def test_bad_config_names_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"ArithmeticConfig.{field}"):
        A.ArithmeticConfig(**kwargs)


def test_bad_generate_arguments():
    with pytest.raises(ValueError, match="split must be one of"):
        A.generate_problems(MIXED, "test", 3, seed=0)
    with pytest.raises(ValueError, match="count must be"):
        A.generate_problems(MIXED, "rl", -1, seed=0)
    with pytest.raises(ValueError, match="seed must be"):
        A.generate_problems(MIXED, "rl", 3, seed=-2)


@pytest.mark.parametrize(
    ("response", "answer", "reward"),
    [
        ("3+4=7.\\boxed{7}", 7, 1.0),  # correct
        ("3+4=8.\\boxed{8}", 7, 0.0),  # wrong
        ("\\boxed{7}", "7", 1.0),  # answer given as text
        ("\\boxed{ 7 }", 7, 1.0),  # surrounding spaces are trimmed
        ("\\boxed{7} then \\boxed{8}", 8, 1.0),  # multiple boxes: the last counts
        ("\\boxed{7} then \\boxed{8}", 7, 0.0),
        ("\\boxed{8} and an unfinished \\boxed{7", 8, 1.0),  # open box at the end is ignored
        ("5-9=-4.\\boxed{-4}", -4, 1.0),  # negative numbers
        ("\\boxed{-4}", 4, 0.0),
        ("\\boxed{4}", -4, 0.0),
        ("\\boxed{--4}", -4, 0.0),
        ("\\boxed{+4}", 4, 0.0),  # canonical form only
        ("\\boxed{04}", 4, 0.0),
        ("\\boxed{4.0}", 4, 0.0),
        ("\\boxed{\\boxed{4}}", 4, 0.0),  # nested: the outer box holds text, not an integer
        ("\\boxed{{4}}", 4, 0.0),
        ("\\boxed{}", 0, 0.0),
        ("\\boxed{0}", 0, 1.0),
        ("no box at all: 4", 4, 0.0),
        ("\\boxed{4x}", 4, 0.0),  # garbage
        ("}}\\boxed{4}{{", 4, 1.0),
        ("", 4, 0.0),
    ],
)
def test_reward_cases(response, answer, reward):
    assert A.arithmetic_reward(response, answer) == reward


def test_reward_rejects_bad_arguments():
    with pytest.raises(ValueError, match="response_text must be a str"):
        A.arithmetic_reward(None, 3)
    with pytest.raises(ValueError, match="answer must be a canonical integer text"):
        A.arithmetic_reward("\\boxed{3}", "three")
    with pytest.raises(ValueError, match="answer must be an int"):
        A.arithmetic_reward("\\boxed{3}", 3.0)


@pytest.fixture(scope="module")
def task_tokenizer():
    problems = A.generate_problems(MIXED, "sft", 300, seed=0)
    return SentencePieceTokenizer.train(A.tokenizer_corpus(problems), vocab_size=48)


def test_source_items_and_prompt_iterator(task_tokenizer):
    problems = A.generate_problems(MIXED, "rl", 40, seed=3)
    source = A.ArithmeticSource(problems, task_tokenizer)
    assert len(source) == 40
    item = source[5]
    assert item.prompt_ids[0] == task_tokenizer.bos_id
    assert task_tokenizer.decode(item.prompt_ids[1:]) == problems[5].prompt_text
    assert item.answer == str(problems[5].answer)
    assert item.problem == problems[5].expression
    target = source.target_ids(5)
    assert target[-1] == task_tokenizer.eos_id
    assert task_tokenizer.decode(target[:-1]) == problems[5].target_text

    config = PipelineConfig(batch_size=8, seed=1, num_epochs=1, read_threads=1)
    batches = list(prompt_iterator(source, config))
    assert len(batches) == 5
    indices = sorted(e.index for batch in batches for e in batch)
    assert indices == list(range(40))
    again = [e.id for e in next(iter(prompt_iterator(source, config)))]
    assert again == [e.id for e in batches[0]]
    for example in batches[0]:
        assert example.prompt_ids == source[example.index].prompt_ids


def test_empty_source_raises(task_tokenizer):
    with pytest.raises(ValueError, match="problems must be non-empty"):
        A.ArithmeticSource([], task_tokenizer)
