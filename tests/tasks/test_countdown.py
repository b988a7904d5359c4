"""The countdown task: problems, demonstrations, reward and evaluation, by hand."""

import numpy as np
import pytest

from bapo_jax.rollout.types import Rollout, Sample
from bapo_jax.tasks import countdown as cd
from bapo_jax.tasks import kinds


def test_values_and_solutions_by_hand():
    # 5 3 2 1: +++ 11, ++- 9, +-+ 7, +-- 5, -++ 5, -+- 3, --+ 1, --- -1
    values = [cd.value_of((5, 3, 2, 1), s) for s in cd.sign_patterns(4)]
    assert values == [11, 9, 7, 5, 5, 3, 1, -1]
    assert cd.solutions((5, 3, 2, 1), 7) == ("5+3-2+1",)
    assert cd.solutions((5, 3, 2, 1), 5) == ("5+3-2-1", "5-3+2+1")  # several correct answers
    assert cd.render((5, 3, 2, 1), "+-+") == "5+3-2+1"


def test_demonstration_tries_until_the_first_solution():
    p = cd.CountdownProblem((5, 3, 2, 1), 5, (("+", "+", "+"), ("-", "+", "+")))
    assert p.prompt_text == "5,3,2,1:5="
    assert p.target_text == "5+3+2+1=11,5-3+2+1=5.\\boxed{5-3+2+1}"
    assert cd.countdown_reward(p.target_text, p.answer) == 1.0


@pytest.mark.parametrize(
    "text, reward",
    [
        ("5+3-2-1=5.\\boxed{5+3-2-1}", 1.0),
        ("\\boxed{5-3+2+1}", 1.0),  # the other solution scores too
        ("\\boxed{5+3-2+1}", 0.0),  # valid expression, value 7
        ("\\boxed{3+5-2-1}", 0.0),  # numbers out of order
        ("\\boxed{5+3-2}", 0.0),  # a number left out
        ("\\boxed{05+3-2-1}", 0.0),  # not the number's text
        ("\\boxed{5 +3-2-1}", 0.0),
        ("\\boxed{5*3-2-1}", 0.0),
        ("\\boxed{5+-3-2-1}", 0.0),
        ("\\boxed{5}", 0.0),
        ("5+3-2-1=5.", 0.0),  # no box
        ("\\boxed{5+3-2-1},\\boxed{5+3+2+1}", 0.0),  # the last box counts
        ("\\boxed{5+3+2+1},\\boxed{5+3-2-1}", 1.0),
    ],
)
def test_reward_by_hand(text, reward):
    assert cd.countdown_reward(text, "5,3,2,1:5") == reward


def test_answer_and_config_errors():
    with pytest.raises(ValueError, match="answer must read"):
        cd.countdown_reward("\\boxed{1+1}", "1+1=2")
    with pytest.raises(ValueError, match=r"CountdownConfig\.numbers"):
        cd.CountdownConfig(numbers=1)
    with pytest.raises(ValueError, match="problem space is too small"):
        cd.generate_problems(cd.CountdownConfig(numbers=2, max_number=2), "rl", 50, 0)


def test_problems_are_seeded_distinct_solvable_and_split_by_hash():
    config = cd.CountdownConfig(numbers=4, max_number=9)
    a = cd.generate_problems(config, "rl", 200, 3)
    assert a == cd.generate_problems(config, "rl", 200, 3)
    assert len({p.expression for p in a}) == 200
    assert all(p.split == "rl" for p in a)
    held_out = {p.expression for p in cd.generate_problems(config, "eval", 200, 3)}
    assert not held_out & {p.expression for p in a}
    for p in a:
        tried = [cd.value_of(p.numbers, s) for s in p.order]
        assert tried[-1] == p.target and p.target not in tried[:-1]
        assert len(set(p.order)) == len(p.order) <= 8
        assert cd.render(p.numbers, p.order[-1]) in p.solutions
    # the demonstrations' search orders differ between problems (a random searcher)
    assert len({p.order[0] for p in a}) == 8


def _rollout(prompts, texts, n):
    samples = tuple(
        Sample(
            prompt_index=i // n,
            sample_index=i % n,
            token_ids=np.array([i], np.int32),
            logprobs=np.zeros(1, np.float32),
            versions=np.zeros(1, np.int64),
            finish_reason="stop",
        )
        for i in range(len(texts))
    )
    return Rollout(tuple(tuple(p) for p in prompts), n, samples), dict(enumerate(texts))


class _ScriptedEngine:
    """Answers greedy and sampled calls with given texts (token i decodes to texts[i])."""

    def __init__(self, greedy, sampled):
        self.greedy, self.sampled, self.table = greedy, sampled, {}

    def generate(self, prompts, n, sampling, seed, *, greedy=False):
        rollout, self.table = _rollout(prompts, self.greedy if greedy else self.sampled, n)
        return rollout


def test_evaluate_reports_pass_at_k_and_distinct_correct_answers():
    problems = [
        cd.CountdownProblem((5, 3, 2, 1), 5, (("+", "-", "-"),)),
        cd.CountdownProblem((5, 3, 2, 1), 7, (("+", "-", "+"),)),
    ]

    class Source:
        def __len__(self):
            return 2

        def __getitem__(self, i):
            return type("E", (), {"prompt_ids": (1, 2, i), "answer": problems[i].answer})

    engine = _ScriptedEngine(
        greedy=["\\boxed{5+3-2-1}", "\\boxed{5+3+2+1}"],
        sampled=[
            *["\\boxed{5+3-2-1}", "\\boxed{5-3+2+1}", "\\boxed{5-3+2+1}", "x"],  # 2 distinct
            *["x", "x", "x", "x"],  # problem 1: none
        ],
    )
    out = kinds.evaluate(
        engine, "countdown", Source(), lambda ids: engine.table[int(ids[0])], 0, 16, samples=4
    )
    assert out == {
        "accuracy": 0.5,
        "pass@4": 0.5,
        "sampled_accuracy": 3 / 8,
        "distinct_correct": 1.0,  # (2 + 0) / 2
    }
    assert kinds.evaluate(engine, "countdown", Source(), lambda ids: "x", 0, 16) == {
        "accuracy": 0.0
    }


def test_the_job_builds_a_countdown_task_and_keeps_arithmetic_fingerprints():
    from bapo_jax.tasks import arithmetic_job as job

    with pytest.raises(ValueError, match="kind"):
        job.TaskConfig(kind="sudoku")
    with pytest.raises(ValueError, match="size"):
        job.TaskConfig(size=1)
    config = job.TaskConfig(kind="countdown", size=4, n_basic=40, n_target_sft=8, n_eval=8)
    task = job.build_task(config, job.ModelShape(), rl_prompts=16)
    assert {len(p.numbers) for p in task.warm_start.problems} == {3, 4}
    assert {len(p.numbers) for p in task.rl.problems} == {4}
    reward = job.reward_fn_of(task)
    first = task.rl.problems[0]
    np.testing.assert_array_equal(reward([first.target_text, "x"], [first.answer] * 2), [1, 0])
    # Fields added later stay out of an arithmetic warm start's fingerprint (still valid).
    shape, warm = job.ModelShape(), job.WarmStartConfig()
    fingerprint = job._fingerprint(job.TaskConfig(eval_samples=8), shape, warm)
    assert set(fingerprint["task"]) == {
        "max_operand", "n_basic", "n_target_sft", "n_eval", "vocab_size", "seed"
    }  # fmt: skip
    assert job._fingerprint(config, shape, warm)["task"]["kind"] == "countdown"
