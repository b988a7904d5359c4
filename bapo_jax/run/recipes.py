"""Published BAPO settings a run switches to by name (`--recipe paper|authors`).

    python -m experiments.aime_7b --recipe paper  [key.sub=value ...]
    python -m experiments.aime_7b --recipe authors [key.sub=value ...]

A recipe is a named list of `key.sub=value` overrides (`bapo_jax.overrides`), applied to the
experiment's config before the command line's own settings, so those still win. It sets the
hyperparameters the two sources disagree on (learning rate, rollout temperature and every field
of BAPO's bound search); the rest of the run (data, model, batch shape, steps, evaluation) stays
the experiment's (docs/pod.md, "What the run trains on", tables all three side by side).

paper: arXiv 2510.18927, Sec. 5.1: lr 2e-6, temperature 0.6, rho0 0.4 as P / (P + N), c_low
  0.6..0.9 step 0.02, c_high 1.2..3.0 step 0.05, c_high first, one search per optimizer update,
  no dual clip (`BAPOConfig()`'s defaults).
authors: the authors' verl recipe, `recipe/bapo/config/bapo_trainer.yaml`: target P / N >= 1
  (`adv_ratio_target: 1`), c_low 0.6..0.8 step 0.05, c_high 1.2..2.0 step 0.05, c_low first, one
  search per micro-batch, dual clip 3.0; with their `run_bapo_example.sh`'s temperature 1.0 and
  lr 1e-6.

The BAPO settings are declared once here: `experiments.offpolicy_study`'s `bapo_paper` arm is
`PAPER_BAPO`, its `bapo_code` arm `AUTHORS_SEARCH` (the authors' search on the paper's grids,
as that study ran it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.algorithms.losses import LossTerms
from bapo_jax.overrides import apply_overrides
from bapo_jax.run.config import RunConfig, RunConfigError

# The paper's search (Sec. 5.1): BAPOConfig's defaults.
PAPER_BAPO = BAPOConfig()
# The authors' code's search: c_low first, target P / N >= 1.0 (their yaml), dual clip 3.0, one
# search per micro-batch; on the paper's grids.
AUTHORS_SEARCH = BAPOConfig(
    rho0=1.0, order="lower_first", target="pos_neg_ratio", dual_clip=3.0, scope="micro_batch"
)
# ... and on the grids of their recipe's yaml: c_low 0.6..0.8 step 0.05, c_high 1.2..2.0 step 0.05.
AUTHORS_BAPO = dataclasses.replace(
    AUTHORS_SEARCH,
    c_low_start=0.6,
    c_low_max=0.8,
    c_low_step=0.05,
    c_high_start=1.2,
    c_high_max=2.0,
    c_high_step=0.05,
)

BAPO_KEY = "trainer.algorithm.bapo"
# The bound search's own fields; the loss terms every loss shares (aggregation, KL, entropy,
# IS weights) are no recipe's business.
SEARCH_FIELDS = tuple(
    f.name for f in dataclasses.fields(BAPOConfig) if f.name not in LossTerms.__dataclass_fields__
)


def _text(value: object) -> str:
    """`value` as override text (`bapo_jax.overrides` parses it back by the field's type)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)


def bapo_overrides(config: BAPOConfig) -> tuple[str, ...]:
    """Every search field of `config` as an override of the run's BAPO section."""
    return tuple(f"{BAPO_KEY}.{name}={_text(getattr(config, name))}" for name in SEARCH_FIELDS)


@dataclasses.dataclass(frozen=True)
class Recipe:
    """name: what `--recipe` takes; source: where the values come from (printed by the run);
    overrides: `key.sub=value` settings, applied before the command line's."""

    name: str
    source: str
    overrides: tuple[str, ...]


def _recipe(name: str, source: str, lr: float, temperature: float, bapo: BAPOConfig) -> Recipe:
    return Recipe(
        name,
        source,
        (
            "trainer.algorithm.loss=bapo",
            f"trainer.optimizer.learning_rate={_text(lr)}",
            f"trainer.rollout.temperature={_text(temperature)}",
            *bapo_overrides(bapo),
        ),
    )


RECIPES = {
    recipe.name: recipe
    for recipe in (
        _recipe(
            "paper",
            "the paper (arXiv 2510.18927, Sec. 5.1)",
            lr=2e-6,
            temperature=0.6,
            bapo=PAPER_BAPO,
        ),
        _recipe(
            "authors",
            "the authors' verl recipe (bapo_trainer.yaml; temperature and lr of "
            "run_bapo_example.sh)",
            lr=1e-6,
            temperature=1.0,
            bapo=AUTHORS_BAPO,
        ),
    )
}


def get_recipe(name: str) -> Recipe:
    """The recipe called `name`; RunConfigError naming the value and the choices otherwise."""
    if name not in RECIPES:
        raise RunConfigError(
            f"--recipe: unknown recipe {name!r}; choose one of {', '.join(sorted(RECIPES))} "
            "(or leave --recipe out for the experiment's own settings)"
        )
    return RECIPES[name]


def apply_recipe(config: RunConfig, name: str | None, overrides: Sequence[str] = ()) -> RunConfig:
    """`config` with recipe `name` (None: none) and then `overrides` applied, in one pass: a
    key both set takes the override's value."""
    recipe = () if name is None else get_recipe(name).overrides
    return apply_overrides(config, [*recipe, *overrides])


def describe(name: str | None) -> str:
    """One line for the run's log: which recipe was applied, and what it set."""
    if name is None:
        return (
            "recipe: none (the experiment's own settings; --recipe "
            f"{'|'.join(sorted(RECIPES))} switches to a published one)"
        )
    recipe = get_recipe(name)
    return (
        f"recipe: {recipe.name}, {recipe.source}; set before the command line's settings: "
        + " ".join(recipe.overrides)
    )
