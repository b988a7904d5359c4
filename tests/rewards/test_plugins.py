"""Reward plug-ins (`rewards.fn = "package.module:function"`), exact match, the format term.

Plug-ins run in the reward workers; whatever they do (raise, exit, hang, return NaN or a
string) scores 0 and is counted, and a bad spec fails before any worker starts."""

from __future__ import annotations

import math
import re
import time

import numpy as np
import pytest

from bapo_jax.rewards import (
    PluginError,
    RewardConfigError,
    RewardFunction,
    RewardPool,
    RewardSection,
    exact_match,
    load_plugin,
    plugins,
    reward_pool_for,
)
from tests.rewards import plugins_for_tests

MODULE = "tests.rewards.plugins_for_tests"
BEHAVE = f"{MODULE}:behave"
VERL = f"{MODULE}:compute_score"
TIMEOUT_S = 2.0
MARGIN_S = 1.5  # killing and reaping a worker, scheduling noise on a loaded machine


@pytest.fixture(scope="module")
def pool():
    """Two workers with the `behave` plug-in loaded (soft timeout at 1 s, hard at 2 s)."""
    with RewardPool(2, plugin=BEHAVE, timeout_s=TIMEOUT_S) as p:
        yield p


@pytest.fixture(scope="module")
def verl_pool():
    with reward_pool_for(RewardSection(fn=VERL, workers=1, timeout_s=TIMEOUT_S)) as p:
        yield p


def _modes(*modes: str) -> list[dict]:
    return [{"mode": mode} for mode in modes]


# ---- plug-ins in the pool -----------------------------------------------------------------------
def test_native_plugin_gets_response_answer_and_metadata(pool):
    scores = pool.score_batch(
        ["x 42 y", "nothing", "42"], ["42", 42, "42"], [{}, None, {"bonus": 0.5}], reward=BEHAVE
    )
    np.testing.assert_array_equal(scores, np.array([1.0, 0.0, 1.5], np.float32))


def test_plugin_failures_score_zero_and_are_counted(pool):
    modes = ["raise", "exit", "nan", "inf", "text", "dict_without_score", "dict", "sleep"]
    before = pool.stats
    scores, stats = pool.score_batch_with_stats(
        ["r"] * len(modes), ["a"] * len(modes), _modes(*modes), reward=BEHAVE
    )
    np.testing.assert_array_equal(scores, np.array([0, 0, 0, 0, 0, 0, 0.25, 0], np.float32))
    assert (stats.plugin_errors, stats.non_finite, stats.bad_returns) == (2, 2, 2)
    assert (stats.soft_timeouts, stats.hard_timeouts, stats.checks) == (1, 0, 8)
    after = pool.stats
    assert after.plugin_errors == before.plugin_errors + 2
    assert after.non_finite == before.non_finite + 2
    assert after.bad_returns == before.bad_returns + 2
    assert after.soft_timeouts == before.soft_timeouts + 1
    assert after.worker_restarts == before.worker_restarts  # every worker survived


def test_hanging_plugin_is_killed_and_its_worker_replaced(pool):
    pool.wait_ready()
    before = pool.stats
    start = time.monotonic()
    scores, stats = pool.score_batch_with_stats(
        ["r", "the answer"], ["a", "answer"], _modes("hang", "score"), reward=BEHAVE
    )
    elapsed = time.monotonic() - start
    np.testing.assert_array_equal(scores, np.array([0.0, 1.0], np.float32))
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + MARGIN_S
    assert stats.hard_timeouts == 1 and stats.timeouts == 1
    assert pool.stats.worker_restarts == before.worker_restarts + 1
    assert pool.score_batch(["5"], ["5"], reward=BEHAVE)[0] == 1.0  # the run goes on


def test_plugin_that_kills_its_worker_is_retried_once_then_scores_zero(pool):
    before = pool.stats
    scores, stats = pool.score_batch_with_stats(
        ["r", "a"], ["a", "a"], _modes("crash", "score"), reward=BEHAVE
    )
    np.testing.assert_array_equal(scores, np.array([0.0, 1.0], np.float32))
    assert stats.worker_crashes == 2  # the first try and the retry
    assert pool.stats.worker_restarts == before.worker_restarts + 2
    assert len(pool.worker_pids()) == 2


def test_a_plugin_pool_still_serves_math_verify_and_exact_match(pool):
    responses = ["so \\boxed{\\frac{1}{2}}", "\\boxed{ 7 }", "7"]
    answers = ["0.5", "7", "7"]
    np.testing.assert_array_equal(pool.score_batch(responses, answers), [1.0, 1.0, 0.0])
    np.testing.assert_array_equal(
        pool.score_batch(responses, answers, reward="exact_match"), [0.0, 1.0, 1.0]
    )


def test_score_batch_rejects_other_rewards_and_bad_metadata(pool):
    with pytest.raises(ValueError, match="reward must be one of"):
        pool.score_batch(["r"], ["a"], reward=VERL)
    with pytest.raises(ValueError, match="metadata must be a sequence of 2 mappings"):
        pool.score_batch(["r", "s"], ["a", "b"], [{}], reward=BEHAVE)
    with pytest.raises(ValueError, match="metadata\\[1\\] is not JSON-able"):
        pool.score_batch(["r", "s"], ["a", "b"], [{}, {"x": object()}], reward=BEHAVE)
    with pytest.raises(ValueError, match="metadata\\[0\\] must be a mapping"):
        pool.score_batch(["r"], ["a"], [["not", "a", "mapping"]], reward=BEHAVE)


# ---- verl's compute_score -----------------------------------------------------------------------
def test_verl_compute_score_is_accepted_as_is(verl_pool):
    metadata = [
        {"data_source": "openai/gsm8k", "extra_info": {"weight": 2.0}},
        {"data_source": "dict_source", "extra_info": None},
        {"data_source": "dict_source"},
        {},
    ]
    scores, stats = verl_pool.score_batch_with_stats(
        ["#### 7", "#### 7", "#### 8", "#### 7"], ["7", "7", "7", "7"], metadata, reward=VERL
    )
    np.testing.assert_array_equal(scores, np.array([2.0, 0.5, 0.0, 1.0], np.float32))
    assert stats.plugin_errors == stats.bad_returns == 0


def test_verl_signature_detection():
    verl = load_plugin(VERL)
    assert (verl.style, verl.extra_info) == ("verl", True)
    short = load_plugin(f"{MODULE}:verl_without_extra_info")
    assert (short.style, short.extra_info) == ("verl", False)
    assert plugins.call_plugin(short, " 3 ", "3", {"data_source": "math"}) == (1.0, "ok")
    assert plugins.call_plugin(short, "3", "3", {"extra_info": {"x": 1}}) == (0.0, "ok")
    native = load_plugin(BEHAVE)
    assert native.style == "native" and native.fn is plugins_for_tests.behave


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1, (1.0, "ok")),
        (True, (1.0, "ok")),
        (np.float32(0.5), (0.5, "ok")),
        ({"score": -1.0}, (-1.0, "ok")),
        ({"score": math.nan}, (0.0, "non_finite")),
        (math.inf, (0.0, "non_finite")),
        (1e39, (0.0, "non_finite")),  # inf as a float32 reward
        (None, (0.0, "bad_return")),
        ("1", (0.0, "bad_return")),
        ({"score": "1"}, (0.0, "bad_return")),
        (np.ones(2), (0.0, "bad_return")),
    ],
)
def test_as_score(value, expected):
    assert plugins.as_score(value) == expected


# ---- bad specs ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_colon", "not a shipped reward .* nor a plug-in 'package.module:function'"),
        ("tests.rewards.no_such_module:fn", "cannot import module 'tests.rewards.no_such_module'"),
        (f"{MODULE}:missing", "has no attribute 'missing'"),
        (f"{MODULE}:NOT_CALLABLE", "is not callable: int 3"),
        (f"{MODULE}:two_arguments", "takes neither \\(response, answer, metadata\\) nor verl"),
    ],
)
def test_bad_specs_fail_before_any_worker_starts(spec, message):
    start = time.monotonic()
    with pytest.raises(PluginError, match=f"^rewards\\.fn={re.escape(repr(spec))}: .*{message}"):
        RewardPool(1, plugin=spec)
    assert time.monotonic() - start < 0.5  # no worker was started (one takes ~1 s to warm up)


def test_plugin_that_does_not_load_in_a_worker_fails_clearly(tmp_path, monkeypatch):
    """Importable here but not in a worker (its file is gone): the pool raises at start."""
    (tmp_path / "vanishing_reward.py").write_text(
        "def fn(response, answer, metadata):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    load_plugin("vanishing_reward:fn")  # imported (and cached) in this process
    (tmp_path / "vanishing_reward.py").unlink()
    with pytest.raises(PluginError, match=r"^rewards\.fn='vanishing_reward:fn': cannot import"):
        RewardPool(1, plugin="vanishing_reward:fn")


def test_plugin_outside_the_repository_is_importable_in_workers(tmp_path, monkeypatch):
    package = tmp_path / "my_rewards"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "scoring.py").write_text(
        "def length(response, answer, metadata):\n    return float(len(response))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # this process only: the pool passes it on
    with RewardPool(1, plugin="my_rewards.scoring:length") as p:
        assert p.score_batch(["abc"], ["x"], reward="my_rewards.scoring:length")[0] == 3.0


# ---- exact match, weights, the trainer's reward function ----------------------------------------
@pytest.mark.parametrize(
    ("response", "answer", "score"),
    [
        ("so \\boxed{ New   York }", "New York", 1.0),
        ("  New\nYork \n", "New York", 1.0),  # no box: the whole response
        ("\\boxed{3} then \\boxed{4}", "4", 1.0),  # the last box
        ("The answer is 4", "4", 0.0),
        ("\\boxed{}", "4", 0.0),
        ("\\boxed{paris}", "Paris", 0.0),  # case counts
        ("\\boxed{42}", 42, 1.0),
    ],
)
def test_exact_match(response, answer, score):
    assert exact_match(response, answer) == score


def test_exact_match_with_a_format_term(pool):
    reward_fn = RewardFunction(
        RewardSection(fn="exact_match", correctness_weight=0.75, format_weight=0.25), pool
    )
    responses = ["\\boxed{ Paris }", "\\boxed{London}", "Paris", "It is Paris", "\\boxed{}"]
    rewards = reward_fn(responses, ["Paris"] * 5, [{}] * 5)
    assert rewards.dtype == np.float32
    np.testing.assert_allclose(rewards, [1.0, 0.25, 0.75, 0.0, 0.0])
    metrics = reward_fn.take_metrics()
    assert metrics["reward/scored"] == 5
    assert metrics["reward/correctness_mean"] == pytest.approx(2 / 5)
    assert metrics["reward/format_mean"] == pytest.approx(2 / 5)
    assert reward_fn.take_metrics()["reward/scored"] == 0  # reset by the take


def test_math_verify_with_a_format_term(pool):
    reward_fn = RewardFunction(RewardSection(format_weight=0.5), pool)
    rewards = reward_fn(["\\boxed{\\frac{1}{2}}", "\\boxed{3}", "0.5"], ["0.5"] * 3, None)
    np.testing.assert_allclose(rewards, [1.5, 0.5, 0.0])
    metrics = reward_fn.take_metrics()
    assert metrics["reward/no_answer"] == 1 and metrics["reward/timeouts"] == 0


def test_plugin_reward_function_counts_failures(pool):
    reward_fn = RewardFunction(RewardSection(fn=BEHAVE, format_weight=0.5), pool)
    rewards = reward_fn(
        ["\\boxed{1}", "\\boxed{1}", "1", "1"], ["1"] * 4, _modes("raise", "score", "nan", "dict")
    )
    np.testing.assert_allclose(rewards, [0.5, 1.5, 0.0, 0.25])
    metrics = reward_fn.take_metrics()
    assert metrics["reward/plugin_errors"] == 1 and metrics["reward/non_finite"] == 1
    assert metrics["reward/correctness_mean"] == pytest.approx(1.25 / 4)


def test_reward_function_needs_the_pool_of_its_plugin(verl_pool):
    with pytest.raises(ValueError, match="needs a RewardPool made with plugin="):
        RewardFunction(RewardSection(fn=BEHAVE), verl_pool)


# ---- config -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fn": "math-verify"}, "rewards.fn='math-verify': not a shipped reward"),
        ({"fn": 3}, "rewards.fn must be a str"),
        ({"format_weight": -0.1}, "rewards.format_weight: a finite weight >= 0, got -0.1"),
        ({"correctness_weight": math.nan}, "rewards.correctness_weight: a finite weight"),
        ({"correctness_weight": 0.0}, "rewards.correctness_weight: .* both 0"),
        ({"timeout_s": 0}, "rewards.timeout_s: > 0 seconds, got 0"),
        ({"workers": 0}, r"rewards.workers: an int >= 1 \(or None: from the CPU count\), got 0"),
        ({"memory_limit_gb": -1}, "rewards.memory_limit_gb: >= 0"),
    ],
)
def test_reward_section_rejects_bad_values(kwargs, message):
    with pytest.raises(RewardConfigError, match=message):
        RewardSection(**kwargs)


def test_run_config_rewards_overrides():
    from bapo_jax.overrides import apply_overrides
    from bapo_jax.run.config import RunConfig

    config = apply_overrides(
        RunConfig(), [f"rewards.fn={BEHAVE}", "rewards.format_weight=0.1", "rewards.workers=3"]
    )
    assert config.rewards == RewardSection(fn=BEHAVE, format_weight=0.1, workers=3)
    assert config.rewards.plugin == BEHAVE and RewardSection().plugin is None
    with pytest.raises(ValueError, match=r"rewards\.fn='nope'"):
        apply_overrides(RunConfig(), ["rewards.fn=nope"])


def test_reward_workers_default_to_half_the_cpus_within_2_to_32(monkeypatch):
    monkeypatch.setattr("os.cpu_count", lambda: 128)
    assert RewardSection().worker_count == 32
    monkeypatch.setattr("os.cpu_count", lambda: 20)
    assert RewardSection().worker_count == 10
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert RewardSection().worker_count == 2
    assert RewardSection(workers=5).worker_count == 5  # the override stays
    with pytest.raises(RewardConfigError, match="workers: an int >= 1 \\(or None"):
        RewardSection(workers=0)
