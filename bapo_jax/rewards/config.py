"""The `rewards` section of a run config: which reward, its weights, its worker pool.

    rewards.fn=math_verify                       # the default: math-verify on the last \\boxed{}
    rewards.fn=exact_match                       # the last \\boxed{} (or the whole response)
    rewards.fn=my_package.my_rewards:score       # a plug-in (docs/rewards.md)
    rewards.format_weight=0.1                    # + 0.1 x format_reward (a complete \\boxed{})

The reward of a response is `correctness_weight * correctness + format_weight * format`, where
correctness is what `fn` returns (1.0 / 0.0 for the shipped rewards) and format is
`rewards.math.format_reward` (1.0 when the response ends with a complete, non-empty
`\\boxed{}`). Validation errors name the key (`rewards.<field>`) and the value. Only the form
of `fn` is checked here; `RewardPool` imports and checks a plug-in before its workers start.
"""

from __future__ import annotations

import dataclasses
import math
import os

from bapo_jax.rewards import plugins


class RewardConfigError(ValueError):
    """A `rewards` setting that cannot work; the message names the key."""


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise RewardConfigError(f"rewards.{key}: {message}")


@dataclasses.dataclass(frozen=True)
class RewardSection:
    """How responses are scored.

    fn: "math_verify" (math-verify equivalence of the last `\\boxed{}` with the answer),
      "exact_match" (`plugins.exact_match`), or a plug-in "package.module:function" taking
      (response, answer, metadata) or verl's (data_source, solution_str, ground_truth,
      extra_info=None) (`rewards.plugins`).
    correctness_weight: the weight of `fn`'s score in the reward.
    format_weight: the weight of the format reward (1.0 for a complete, non-empty `\\boxed{}`);
      0 = no format term.
    timeout_s: the hard wall-clock limit of one check or plug-in call; an overrun scores 0 and
      its worker is replaced. The worker interrupts the call itself at half of it.
    workers: reward worker processes (each imports sympy; plug-ins run in them too); None:
      half of this host's CPUs, 2 to 32 (`worker_count`: the trainer's own threads and any CPU
      servers keep the other half; a pod node's 4,096 responses a batch need more than 2).
    memory_limit_gb: the address-space limit of each worker (0 = none); raise it for a
      plug-in that imports a large library.
    """

    fn: str = plugins.MATH_VERIFY
    correctness_weight: float = 1.0
    format_weight: float = 0.0
    timeout_s: float = 10.0
    workers: int | None = None
    memory_limit_gb: float = 4.0

    def __post_init__(self):
        try:
            plugins.check_spec(self.fn)
        except plugins.PluginError as error:
            raise RewardConfigError(str(error)) from None
        for key in ("correctness_weight", "format_weight"):
            value = getattr(self, key)
            _require(
                isinstance(value, (int, float)) and math.isfinite(value) and value >= 0,
                key,
                f"a finite weight >= 0, got {value!r}",
            )
        _require(
            self.correctness_weight > 0 or self.format_weight > 0,
            "correctness_weight",
            "correctness_weight and format_weight are both 0: every reward would be 0",
        )
        _require(self.timeout_s > 0, "timeout_s", f"> 0 seconds, got {self.timeout_s!r}")
        _require(
            self.workers is None or (isinstance(self.workers, int) and self.workers >= 1),
            "workers",
            f"an int >= 1 (or None: from the CPU count), got {self.workers!r}",
        )
        _require(
            self.memory_limit_gb >= 0,
            "memory_limit_gb",
            f">= 0 (0 = no limit), got {self.memory_limit_gb!r}",
        )

    @property
    def worker_count(self) -> int:
        """`workers`, or half of this host's CPUs, at least 2 and at most 32."""
        if self.workers is not None:
            return self.workers
        return max(2, min(32, (os.cpu_count() or 4) // 2))

    @property
    def plugin(self) -> str | None:
        """The plug-in spec the workers must load, or None for a shipped reward."""
        return None if self.fn in plugins.BUILTIN_REWARDS else self.fn

    @property
    def memory_limit_bytes(self) -> int:
        return int(self.memory_limit_gb * (1 << 30))
