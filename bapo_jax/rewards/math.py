"""Verifiable math rewards: `math_reward(response, answer) -> 1.0 | 0.0`.

The response's answer is the content of its LAST complete `\\boxed{...}` (no box, or an
empty one, scores 0). It is compared with the gold answer by math-verify (LaTeX / number
equivalence, see `bapo_jax.rewards.checker`) in a worker process with a hard timeout: a
pathological response (megabytes of text, thousands of nested braces, a power tower) scores 0
within the timeout and is counted in `reward_stats()`; it never hangs or crashes the caller.

The pool behind `math_reward` is created on first use with `configure_reward_pool`'s
settings (defaults of `RewardPool`) and shut down at interpreter exit. A process forked from
the one that created it gets a fresh pool of its own.
"""

from __future__ import annotations

import atexit
import inspect
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
from jaxtyping import Float

from bapo_jax.rewards.boxed import has_boxed_answer
from bapo_jax.rewards.pool import PoolStats, RewardPool

_lock = threading.Lock()
_pool: RewardPool | None = None
_pool_kwargs: dict[str, Any] = {}
_atexit_registered = False


def configure_reward_pool(**kwargs: Any) -> None:
    """Set the `RewardPool` arguments of the pool behind `math_reward` (num_workers,
    timeout_s, ...). Closes the current pool; the next call creates one with these."""
    global _pool_kwargs
    try:
        inspect.signature(RewardPool).bind(**kwargs)
    except TypeError as error:
        raise ValueError(
            f"configure_reward_pool got bad arguments {sorted(kwargs)}: {error}"
        ) from None
    with _lock:
        _close_locked()
        _pool_kwargs = dict(kwargs)


def reward_pool() -> RewardPool:
    """The shared pool (created lazily, one per process)."""
    global _pool, _atexit_registered
    with _lock:
        if _pool is not None and _pool._owner_pid != os.getpid():
            _pool = None  # inherited through fork: its workers belong to the parent
        if _pool is None:
            _pool = RewardPool(**_pool_kwargs)
            if not _atexit_registered:
                atexit.register(shutdown_reward_pool)
                _atexit_registered = True
        return _pool


def shutdown_reward_pool() -> None:
    """Stop the shared pool's workers (also runs at exit). A later call starts a new pool."""
    with _lock:
        _close_locked()


def _close_locked() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


def reward_stats() -> PoolStats:
    """Counters of the shared pool (timeouts, worker restarts, ...); zeros if none exists."""
    with _lock:
        pool = _pool
    return pool.stats if pool is not None else PoolStats()


def math_reward(response: str, answer: str) -> float:
    """1.0 if the last `\\boxed{}` answer of `response` equals `answer`, else 0.0.

    `answer` is the gold answer as LaTeX or plain text (`"33"`, `"\\frac{1}{2}"`,
    `"(-\\infty, 3]"`); an int is accepted too (AIME). Time-bounded by the pool's timeout.
    """
    return reward_pool().score(response, answer)


def math_reward_batch(
    responses: Sequence[str], answers: Sequence[str | int]
) -> Float[np.ndarray, " B"]:
    """`math_reward` for a batch, checked in parallel over the pool: float32 [B]."""
    return reward_pool().score_batch(responses, answers)


def format_reward(response: str) -> float:
    """1.0 if `response` ends its reasoning with a complete, non-empty `\\boxed{}`, else 0.0.

    An optional shaping term: it rewards the requested answer format whatever the answer.
    """
    return 1.0 if has_boxed_answer(response) else 0.0
