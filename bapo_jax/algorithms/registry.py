"""The loss registry: configs name a loss, the train step and loop ask it what it needs.

A loss registers its function, its config class, the reduction of every metric it returns, and
two optional hooks, so that the generic step and loop never name a loss:

  update_statistic: a statistic over every token of an optimizer update that the loss needs
    before the first backward (BAPO: the grid sums its bound search reads, `bapo.py`);
  config_metrics: config values logged beside the metrics (BAPO: its target rho_0, drawn as
    the rho panel's reference line).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal

from jaxtyping import Array

from bapo_jax.checks import check_choice

LossFn = Callable[..., tuple[Array, dict[str, Array]]]

# How a metric combines over the micro-batches of one update, then over the E updates of a
# rollout batch (micro-batches without trained tokens are left out of both):
#   "sum":  normalised by the update's global counts (the loss terms): sum; over updates: mean
#   "mean": a mean or share over the micro-batch's trained tokens: token-weighted mean; mean
#   "min" / "max": extrema: min / max, both times
#   "all":  flags: all, both times
#   "balance": a value share P / (P + N) (rho), recomputed from its parts "<key>/pos" and
#           "<key>/neg" (declared "sum"); over updates: mean
Reduction = Literal["sum", "mean", "min", "max", "all", "balance"]


@dataclasses.dataclass(frozen=True)
class UpdateStatistic:
    """A statistic over all the tokens of one optimizer update, computed before its backward.

    Under gradient accumulation the step runs one forward-only pass over the micro-batches:
    `partial(ratio, advantages, mask, base_logp, config)` of each micro-batch ([B, W] inputs at
    the scored tokens; plus `lags=` when the batch carries them) is a pytree of sums, added
    leaf by leaf from `zeros(config)`; then `finish(total, config)` once, and every
    micro-batch's loss receives the result as the keyword argument `keyword`. Without
    accumulation the batch is the update, and the loss computes the statistic itself.
    `applies(config)` says whether a config uses the hook (BAPO with scope="micro_batch" does
    not).
    """

    keyword: str
    applies: Callable[[Any], bool]
    zeros: Callable[[Any], Any]
    partial: Callable[..., Any]
    finish: Callable[[Any, Any], Any]


@dataclasses.dataclass(frozen=True)
class LossSpec:
    """A registered loss. metrics: every metric it returns -> its reduction (`Reduction`);
    progress: the metrics the progress bar shows, as (key, label, format); last: the metrics
    also logged as `<key>/last`, the value of an iteration's last update."""

    name: str
    fn: LossFn
    config_cls: type
    metrics: dict[str, str]
    update_statistic: UpdateStatistic | None = None
    config_metrics: Callable[[Any], dict[str, float]] | None = None
    progress: tuple[tuple[str, str, str], ...] = ()
    last: tuple[str, ...] = ()

    def reduction(self, key: str) -> str:
        if key not in self.metrics:
            raise KeyError(
                f"loss {self.name!r} returns metric {key!r} without a declared reduction"
            )
        return self.metrics[key]

    def update_statistic_for(self, config: Any) -> UpdateStatistic | None:
        """The update-wide statistic hook when `config` uses it, else None."""
        hook = self.update_statistic
        return hook if hook is not None and hook.applies(config) else None

    def logged_config(self, config: Any) -> dict[str, float]:
        """The config values this loss logs beside its metrics."""
        return {} if self.config_metrics is None else dict(self.config_metrics(config))


_REGISTRY: dict[str, LossSpec] = {}


def register_loss(
    name: str,
    config_cls: type,
    *,
    metrics: dict[str, str],
    update_statistic: UpdateStatistic | None = None,
    config_metrics: Callable[[Any], dict[str, float]] | None = None,
    progress: tuple[tuple[str, str, str], ...] = (),
    last: tuple[str, ...] = (),
):
    """Decorator registering `fn` under `name` with its config class; `metrics` declares the
    reduction of every metric it returns; `progress` and `last` name some of them (`LossSpec`)."""
    for key, how in metrics.items():
        check_choice(f"reduction of metric {key!r}", how, Reduction)
    for key in [k for k, _, _ in progress] + list(last):
        if key not in metrics:
            raise ValueError(f"loss {name!r}: {key!r} is not one of its metrics")

    def wrap(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"loss {name!r} is already registered")
        _REGISTRY[name] = LossSpec(
            name,
            fn,
            config_cls,
            dict(metrics),
            update_statistic,
            config_metrics,
            tuple(progress),
            tuple(last),
        )
        return fn

    return wrap


def loss_names() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def get_loss(name: str) -> LossSpec:
    if name not in _REGISTRY:
        raise ValueError(f"loss must be one of {loss_names()}, got {name!r}")
    return _REGISTRY[name]


def make_loss_config(name: str, **fields: Any):
    """The config of loss `name` with `fields` overriding its defaults."""
    return get_loss(name).config_cls(**fields)
