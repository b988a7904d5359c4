"""The trainer's reward function, built from the `rewards` config section and a `RewardPool`.

    pool = stack.enter_context(reward_pool_for(config.rewards))
    reward_fn = RewardFunction(config.rewards, pool)
    rewards = reward_fn(texts, answers, metadata)       # float32 [B]
    row.update(reward_fn.take_metrics())                # reward/* since the last take

reward = correctness_weight * correctness + format_weight * format, where correctness is the
configured reward's score (`rewards.fn`: math_verify, exact_match or a plug-in, scored by the
pool) and format is `format_reward` (computed here: a linear scan of each response).
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from jaxtyping import Float

from bapo_jax.rewards.config import RewardSection
from bapo_jax.rewards.math import format_reward
from bapo_jax.rewards.pool import PoolStats, RewardPool

# The pool counters reported per batch (worker restarts are pool-wide, not per call).
_COUNTERS = tuple(f.name for f in dataclasses.fields(PoolStats) if f.name != "worker_restarts")


def reward_pool_for(section: RewardSection) -> RewardPool:
    """The worker pool `section` asks for (its plug-in loaded in every worker)."""
    return RewardPool(
        section.worker_count,
        plugin=section.plugin,
        timeout_s=section.timeout_s,
        memory_limit_bytes=section.memory_limit_bytes,
    )


class RewardFunction:
    """`reward_fn(texts, answers, metadata) -> float32 [B]` (`train.producer.RewardFn`).

    section: the weights and the reward name; pool: scores the correctness term (for a
    plug-in, a pool made with `plugin=section.fn`, e.g. by `reward_pool_for`). Calls may come
    from any thread; `take_metrics` returns what the calls since the previous take counted.
    """

    def __init__(self, section: RewardSection, pool: RewardPool):
        loaded = None if pool.plugin is None else pool.plugin.spec
        if section.plugin is not None and section.plugin != loaded:
            raise ValueError(
                f"rewards.fn={section.fn!r} needs a RewardPool made with plugin={section.fn!r}, "
                f"this pool has plugin={loaded!r}"
            )
        self.section = section
        self.pool = pool
        self._lock = threading.Lock()
        self._counts: collections.Counter = collections.Counter()
        self._sums: collections.Counter = collections.Counter()

    def __call__(
        self,
        texts: Sequence[str],
        answers: Sequence[str],
        metadata: Sequence[Mapping[str, Any]] | None = None,
    ) -> Float[np.ndarray, " B"]:
        s = self.section
        correctness, stats = self.pool.score_batch_with_stats(texts, answers, metadata, reward=s.fn)
        rewards = s.correctness_weight * correctness.astype(np.float64)  # [B]
        formats = None
        if s.format_weight:
            formats = np.asarray([format_reward(t) for t in texts], np.float64)  # [B]
            rewards = rewards + s.format_weight * formats
        with self._lock:
            self._counts.update({name: getattr(stats, name) for name in _COUNTERS})
            self._sums["responses"] += len(texts)
            self._sums["correctness"] += float(correctness.sum())
            if formats is not None:
                self._sums["format"] += float(formats.sum())
        return rewards.astype(np.float32)

    def take_metrics(self) -> dict[str, float]:
        """Metrics of the responses scored since the last call, then reset: reward/<counter>
        (`PoolStats` counts: no_answer, timeouts, plugin_errors, non_finite, ...),
        reward/correctness_mean (the mean unweighted `fn` score) and, with a format term,
        reward/format_mean; the means are left out when nothing was scored."""
        with self._lock:
            counts, sums = self._counts, self._sums
            self._counts, self._sums = collections.Counter(), collections.Counter()
        n = sums["responses"]
        out = {f"reward/{name}": float(counts[name]) for name in _COUNTERS if name != "checks"}
        out["reward/timeouts"] = float(counts["soft_timeouts"] + counts["hard_timeouts"])
        out["reward/scored"] = float(n)
        if n:
            out["reward/correctness_mean"] = sums["correctness"] / n
            if self.section.format_weight:
                out["reward/format_mean"] = sums["format"] / n
        return out
