"""The optimizer: AdamW with decoupled weight decay, global-norm clipping, warm-up + constant.

Paper / authors' example config: lr 1e-6 (paper 2e-6), weight decay 0.1, warm-up 10% of the
steps, gradient clipping at global norm 1.0.
"""

from __future__ import annotations

import dataclasses
import math

import optax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW hyper-parameters.

    learning_rate: peak step size eta after warm-up.
    warmup_steps: linear warm-up from 0 to eta over this many optimizer updates, then constant.
    weight_decay: decoupled AdamW decay lambda (applied to every parameter, as verl does).
    b1, b2, eps: Adam moments' decay rates and denominator epsilon.
    max_grad_norm: clip the global L2 norm of the gradient to this (None: no clipping).
    """

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    weight_decay: float = 0.1
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self):
        def finite_positive(name, allow_zero=False):
            value = getattr(self, name)
            ok = isinstance(value, int | float) and math.isfinite(value)
            ok = ok and (value >= 0 if allow_zero else value > 0)
            if not ok:
                rule = ">= 0" if allow_zero else "> 0"
                raise ValueError(f"OptimizerConfig.{name} must be finite and {rule}, got {value!r}")

        finite_positive("learning_rate")
        finite_positive("weight_decay", allow_zero=True)
        finite_positive("eps")
        for name in ("b1", "b2"):
            value = getattr(self, name)
            if not 0 <= value < 1:
                raise ValueError(f"OptimizerConfig.{name} must be in [0, 1), got {value!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(
                f"OptimizerConfig.warmup_steps must be an int >= 0, got {self.warmup_steps!r}"
            )
        if self.max_grad_norm is not None:
            finite_positive("max_grad_norm")


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """eta * min(1, (step + 1) / warmup_steps): the first update already takes a step."""
    if config.warmup_steps == 0:
        return optax.constant_schedule(config.learning_rate)
    warmup = optax.linear_schedule(
        config.learning_rate / config.warmup_steps, config.learning_rate, config.warmup_steps - 1
    )
    return optax.join_schedules(
        [warmup, optax.constant_schedule(config.learning_rate)], [config.warmup_steps - 1]
    )


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
    """clip_by_global_norm -> AdamW(schedule). Optimizer state mirrors the params' structure, so
    it inherits their sharding."""
    adamw = optax.adamw(
        learning_rate_schedule(config),
        b1=config.b1,
        b2=config.b2,
        eps=config.eps,
        weight_decay=config.weight_decay,
    )
    if config.max_grad_norm is None:
        return adamw
    return optax.chain(optax.clip_by_global_norm(config.max_grad_norm), adamw)
