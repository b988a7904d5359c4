"""Published BAPO settings a run switches to by name (`--recipe paper|authors`).

    python -m experiments.aime_7b --recipe paper  [key.sub=value ...]
    python -m experiments.aime_7b --recipe authors [key.sub=value ...]

A recipe is a named list of `key.sub=value` overrides (`bapo_jax.overrides`), applied to the
experiment's config before the command line's own settings, so those still win. It sets what
the two sources disagree on: the learning rate, the rollout temperature and every field of
BAPO's bound search; docs/pod.md ("--recipe paper|authors") tables the values and their
sources (the paper, arXiv 2510.18927, Sec. 5.1; the authors' verl recipe, `recipe/bapo/config/
bapo_trainer.yaml` with `run_bapo_example.sh`'s temperature and lr).

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


@dataclasses.dataclass(frozen=True)
class Recipe:
    """name: what `--recipe` takes; source: where the values come from (printed by the run);
    overrides: `key.sub=value` settings, applied before the command line's."""

    name: str
    source: str
    overrides: tuple[str, ...]


def _recipe(name: str, source: str, lr: float, temperature: float, bapo: BAPOConfig) -> Recipe:
    """The loss, lr and temperature, and every search field of `bapo`."""
    search = [f"trainer.algorithm.bapo.{f}={_text(getattr(bapo, f))}" for f in SEARCH_FIELDS]
    return Recipe(
        name,
        source,
        (
            "trainer.algorithm.loss=bapo",
            f"trainer.optimizer.learning_rate={_text(lr)}",
            f"trainer.rollout.temperature={_text(temperature)}",
            *search,
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
