"""The optimizer: AdamW with decoupled weight decay, global-norm clipping, warm-up + constant.

Paper / authors' example config: lr 1e-6 (paper 2e-6), weight decay 0.1, warm-up 10% of the
steps, gradient clipping at global norm 1.0.
"""

from __future__ import annotations

import dataclasses

import optax

from bapo_jax.checks import check_field, check_int, is_finite_number


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
        for name in ("learning_rate", "weight_decay", "eps", "max_grad_norm"):
            value = getattr(self, name)
            if value is None and name == "max_grad_norm":
                continue
            zero_ok = name == "weight_decay"  # the only one that may be 0
            ok = is_finite_number(value) and (value > 0 or (zero_ok and value == 0))
            rule = "finite and >= 0" if zero_ok else "finite and > 0"
            check_field(ok, f"OptimizerConfig.{name}", rule, value)
        for name in ("b1", "b2"):
            value = getattr(self, name)
            check_field(0 <= value < 1, f"OptimizerConfig.{name}", "in [0, 1)", value)
        check_int("OptimizerConfig.warmup_steps", self.warmup_steps, 0)


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
