"""The worker pool: adversarial responses end within the timeout with score 0, and dead or
stuck workers are replaced while the run goes on."""

import os
import signal
import threading
import time

import numpy as np
import pytest

from bapo_jax.rewards import (
    PoolStats,
    RewardPool,
    configure_reward_pool,
    math_reward,
    reward_stats,
    shutdown_reward_pool,
)

TIMEOUT_S = 2.0
MARGIN_S = 1.5  # killing and reaping a worker, scheduling noise on a loaded machine

POWER_TOWER = "The answer is \\boxed{9^{9^{9^{9}}}}"
NESTED_BRACES = "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}"
MEGABYTE_TEXT = "Let me think. " * 75_000  # ~1 MB, no box
MEGABYTE_BOX = "\\boxed{" + "1+" * 500_000 + "1}"  # ~1 MB inside one box


@pytest.fixture(scope="module")
def pool():
    with RewardPool(2, timeout_s=TIMEOUT_S) as p:
        yield p


@pytest.fixture(scope="module")
def hard_pool():
    """No soft timeout and no answer-length cap: only the parent's kill stops a check."""
    with RewardPool(2, timeout_s=TIMEOUT_S, soft_timeout_fraction=None, max_answer_chars=None) as p:
        yield p


def _timed_score(pool: RewardPool, response: str, answer: str) -> tuple[float, float]:
    pool.wait_ready()  # time the check, not the start of a replacement worker
    start = time.monotonic()
    score = pool.score(response, answer)
    return score, time.monotonic() - start


@pytest.mark.parametrize(
    "response",
    [POWER_TOWER, NESTED_BRACES, MEGABYTE_TEXT, MEGABYTE_BOX],
    ids=["power_tower", "nested_braces", "megabyte_text", "megabyte_box"],
)
def test_adversarial_scores_zero_within_timeout(pool, response):
    score, elapsed = _timed_score(pool, response, "9")
    assert score == 0.0
    assert elapsed < TIMEOUT_S + MARGIN_S
    assert pool.score("\\boxed{9}", "9") == 1.0  # the run goes on


def test_power_tower_is_counted_as_a_timeout(pool):
    before = pool.stats.timeouts
    assert pool.score(POWER_TOWER, "9") == 0.0
    assert pool.stats.timeouts == before + 1


@pytest.mark.parametrize(
    "response",
    [POWER_TOWER, NESTED_BRACES, MEGABYTE_BOX],
    ids=["power_tower", "nested_braces", "megabyte_box"],
)
def test_hard_timeout_kills_and_replaces_the_worker(hard_pool, response):
    before = hard_pool.stats
    pids_before = set(hard_pool.worker_pids())
    score, elapsed = _timed_score(hard_pool, response, "9")
    after = hard_pool.stats
    assert score == 0.0
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + MARGIN_S
    assert after.hard_timeouts == before.hard_timeouts + 1
    assert after.worker_restarts == before.worker_restarts + 1
    assert len(set(hard_pool.worker_pids()) - pids_before) == 1
    np.testing.assert_array_equal(
        hard_pool.score_batch(["\\boxed{1}", "\\boxed{2}", "\\boxed{4}"], ["1", "2", "3"]),
        np.array([1.0, 1.0, 0.0], np.float32),
    )


def test_killed_idle_worker_is_replaced_and_run_goes_on():
    with RewardPool(2, timeout_s=TIMEOUT_S) as pool:
        victim = pool.worker_pids()[0]
        os.kill(victim, signal.SIGKILL)
        responses = [f"\\boxed{{{i}}}" for i in range(8)]
        scores = pool.score_batch(responses, [str(i) for i in range(8)])
        np.testing.assert_array_equal(scores, np.ones(8, np.float32))
        assert victim not in pool.worker_pids()
        assert len(pool.worker_pids()) == 2
        assert pool.stats.worker_crashes == 1
        assert pool.stats.worker_restarts == 1


def test_worker_killed_mid_check_is_retried_then_times_out():
    with RewardPool(2, timeout_s=TIMEOUT_S, soft_timeout_fraction=None) as pool:
        victim = pool.worker_pids()[0]  # the first task goes to the first worker
        killer = threading.Timer(0.5, os.kill, (victim, signal.SIGKILL))
        killer.start()
        scores = pool.score_batch([POWER_TOWER, "\\boxed{5}"], ["9", "5"])
        killer.join()
        np.testing.assert_array_equal(scores, np.array([0.0, 1.0], np.float32))
        stats = pool.stats
        assert stats.worker_crashes == 1  # the kill; the tower was then retried once
        assert stats.hard_timeouts == 1  # ... and overran on its second worker
        assert stats.worker_restarts == 2


def test_math_reward_itself_is_time_bounded():
    configure_reward_pool(num_workers=2, timeout_s=TIMEOUT_S)
    try:
        for response in (POWER_TOWER, NESTED_BRACES, MEGABYTE_TEXT):
            start = time.monotonic()
            assert math_reward(response, "9") == 0.0
            assert time.monotonic() - start < TIMEOUT_S + MARGIN_S
        assert reward_stats().timeouts == 1
        assert reward_stats().too_long == 1
        assert reward_stats().no_answer == 1
    finally:
        configure_reward_pool()  # back to the defaults for other tests
    assert reward_stats() == PoolStats()  # no pool until the next call


def test_shutdown_and_recreate():
    assert math_reward("\\boxed{2}", "2") == 1.0
    shutdown_reward_pool()
    assert reward_stats() == PoolStats()
    assert math_reward("\\boxed{2}", "2") == 1.0


def test_closed_pool_raises():
    pool = RewardPool(1, timeout_s=TIMEOUT_S)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.score("\\boxed{1}", "1")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_workers": 0}, "num_workers must be an int >= 1, got 0"),
        ({"timeout_s": 0.0}, "timeout_s must be > 0, got 0.0"),
        ({"soft_timeout_fraction": 1.5}, "soft_timeout_fraction must be in \\(0, 1\\)"),
        ({"max_answer_chars": 0}, "max_answer_chars must be >= 1 or None, got 0"),
        ({"memory_limit_bytes": -1}, "memory_limit_bytes must be >= 0, got -1"),
    ],
)
def test_pool_rejects_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RewardPool(**kwargs)


def test_configure_rejects_unknown_argument():
    with pytest.raises(ValueError, match="bad arguments"):
        configure_reward_pool(timeout=3)
