"""`evaluate` + `build_report` on scripted responses (a fake engine), with real tokenization and
real `math_reward` scoring: every metric of the report is checked against values worked out by
hand; the markdown and samples files carry the same rows."""

import dataclasses
import json
import sys

import numpy as np
import pytest

from bapo_jax.data.datasets import MathRow
from bapo_jax.eval import build_report, render_markdown, write_report, write_samples
from bapo_jax.eval.__main__ import Progress, chunk_seed, evaluate
from bapo_jax.models.tokenizer import load_tokenizer
from bapo_jax.rewards.pool import RewardPool
from bapo_jax.rollout.types import Rollout, Sample, SamplingParams

ROWS = [
    MathRow("a", "What is 30 + 3?", "33"),
    MathRow("b", "What is 1/4 + 1/4?", "\\frac{1}{2}"),
    MathRow("c", "What is 2 + 3?", "5"),
]
# (text, finish) of the 4 samples of each problem, by problem text.
SCRIPT = {
    "What is 30 + 3?": [
        ("So the sum is \\boxed{033}", "stop"),  # leading zero: correct
        ("\\boxed{12}", "stop"),
        ("I think \\boxed{12}.", "stop"),
        ("no box here and I ran out of", "length"),
    ],
    "What is 1/4 + 1/4?": [
        ("\\boxed{\\dfrac{1}{2}}", "stop"),
        ("\\boxed{3}", "stop"),
        ("\\boxed{3}", "stop"),
        ("\\boxed{ \\frac{1}{2} }", "stop"),
    ],
    "What is 2 + 3?": [("The answer is \\boxed{5}", "stop")] * 4,
}


class ScriptedEngine:
    """Replies with SCRIPT's texts (token ids from the real tokenizer, eos on "stop")."""

    policy_version = 0

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.calls = []  # (number of prompts, seed)

    def generate(self, prompt_ids, n, sampling, seed):
        self.calls.append((len(prompt_ids), seed))
        samples = []
        for p, ids in enumerate(prompt_ids):
            prompt = self.tokenizer.decode(ids)
            (script,) = [s for problem, s in SCRIPT.items() if problem in prompt]
            for j in range(n):
                text, finish = script[j]
                tokens = self.tokenizer.encode(text)
                tokens += [self.tokenizer.eos_id] if finish == "stop" else []
                t = len(tokens)
                samples.append(
                    Sample(
                        p,
                        j,
                        np.asarray(tokens, np.int32),
                        np.zeros(t, np.float32),
                        np.zeros(t, np.int64),
                        finish,
                    )
                )
        return Rollout(tuple(tuple(p) for p in prompt_ids), n, tuple(samples))

    def begin_update(self, version, params, *, step):
        raise AssertionError("evaluation must never update the engine's weights")

    def finish_update(self, handle, generating_until=None):
        raise AssertionError("evaluation must never update the engine's weights")

    def update_weights(self, version, params, *, step=0):
        raise AssertionError("evaluation must never update the engine's weights")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def pool():
    with RewardPool(1, timeout_s=20.0) as pool:
        yield pool


@pytest.fixture(scope="module")
def evaluated(tokenizer, pool):
    engine = ScriptedEngine(tokenizer)
    results = evaluate(
        engine,
        tokenizer,
        ROWS,
        k=4,
        sampling=SamplingParams(max_tokens=64, temperature=0.6),
        prompt_style="qwen_math",
        seed=5,
        batch_size=2,
        pool=pool,
    )
    return engine, results


def test_evaluate_batches_prompts_and_scores_each_sample(evaluated, tokenizer):
    engine, results = evaluated
    assert engine.calls == [(2, chunk_seed(5, 0)), (1, chunk_seed(5, 1))]
    assert [r.problem_id for r in results] == ["a", "b", "c"]
    assert [r.correct for r in results] == [(1, 0, 0, 0), (1, 0, 0, 1), (1, 1, 1, 1)]
    assert results[0].answers == ("033", "12", "12", None)
    assert results[1].answers == ("\\dfrac{1}{2}", "3", "3", "\\frac{1}{2}")
    assert results[0].responses[0] == "So the sum is \\boxed{033}"  # eos not decoded
    expected_lengths = [
        len(tokenizer.encode(text)) + (finish == "stop") for text, finish in SCRIPT[ROWS[0].problem]
    ]
    assert list(results[0].lengths) == expected_lengths
    assert results[0].finish_reasons == ("stop", "stop", "stop", "length")


def test_report_metrics_by_hand(evaluated):
    _, results = evaluated
    report = build_report(results, {"benchmark": "scripted", "k": 4})
    m = report["summary"]["metrics"]
    np.testing.assert_allclose(
        [m["avg@4"], m["pass@1"], m["pass@2"], m["pass@4"], m["maj@4"]],
        # c = 1, 2, 4 of 4. pass@2 = 1 - C(4-c, 2)/C(4, 2): 1/2, 5/6, 1.
        # Votes: a -> "12" (wrong), b -> tie \frac{1}{2} vs 3, \frac{1}{2} first (right), c right.
        [7 / 12, 7 / 12, (1 / 2 + 5 / 6 + 1) / 3, 1.0, 2 / 3],
        rtol=1e-12,
    )
    problems = report["problems"]
    assert [p["majority_answer"] for p in problems] == ["12", "\\frac{1}{2}", "5"]
    assert [p["majority_count"] for p in problems] == [2, 2, 4]
    assert [p["no_answer"] for p in problems] == [1, 0, 0]
    assert [p["truncated"] for p in problems] == [1, 0, 0]
    assert report["summary"]["lengths"]["truncated_fraction"] == 1 / 12
    assert report["summary"]["lengths"]["no_answer_fraction"] == 1 / 12


def test_report_files_round_trip(evaluated, tmp_path):
    _, results = evaluated
    report = build_report(results, {"benchmark": "scripted"}, rewards={"checks": 12})
    json_path, md_path = write_report(report, tmp_path / "out")
    assert json.loads(json_path.read_text()) == json.loads(json.dumps(report))
    markdown = md_path.read_text()
    assert markdown == render_markdown(report)
    table = [line for line in markdown.splitlines() if line.startswith("| ") and "| 4 |" in line]
    assert len(table) == 1 and "| c |" in table[0]  # problem c: 4 of 4 correct
    assert "| avg@4 | 58.33 |" in markdown and "| maj@4 | 66.67 |" in markdown
    samples = [json.loads(line) for line in write_samples(results, tmp_path / "s.jsonl").open()]
    assert len(samples) == 12
    assert samples[3] == {
        "problem_index": 0,
        "id": "a",
        "sample_index": 3,
        "response": "no box here and I ran out of",
        "answer": None,
        "correct": 0,
        "score": 0.0,
        "length": results[0].lengths[3],
        "finish_reason": "length",
    }


def test_build_report_rejects_ragged_results(evaluated):
    _, results = evaluated
    short = dataclasses.replace(
        results[0],
        responses=("x",),
        answers=(None,),
        correct=(0.0,),
        lengths=(1,),
        finish_reasons=("stop",),
        scores=(0.0,),
    )
    with pytest.raises(ValueError, match="same number of samples"):
        build_report([results[1], short], {})
    with pytest.raises(ValueError, match="at least one problem"):
        build_report([], {})


def test_progress_falls_back_to_a_stderr_line_without_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm -> ImportError
    progress = Progress(3, desc="eval t")
    progress.update(2)
    progress.update(1)
    progress.close()
    err = capsys.readouterr().err
    assert "eval t: 2/3 problems (67%)" in err and "eval t: 3/3 problems (100%)" in err


def test_chunk_seeds_are_distinct_and_reproducible():
    seeds = [chunk_seed(0, i) for i in range(64)] + [chunk_seed(1, i) for i in range(64)]
    assert len(set(seeds)) == 128
    assert seeds[:64] == [chunk_seed(0, i) for i in range(64)]
