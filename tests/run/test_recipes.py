"""`--recipe paper|authors` (`run.recipes`): each recipe sets the published values, the command
line's own settings win over it, an unknown name is refused naming it and the choices, and
`cli.resolve` (what `main` runs for both GPU experiments) applies it. No run: the resolution
only."""

from __future__ import annotations

import pytest

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.run import recipes
from bapo_jax.run.cli import build_parser, resolve
from bapo_jax.run.config import RunConfigError
from experiments import aime_7b, aime_32b, offpolicy_study

PAPER = {
    "learning_rate": 2e-6,
    "temperature": 0.6,
    "bapo": dict(
        rho0=0.4, target="fraction", order="upper_first", scope="update", dual_clip=None,
        c_low_start=0.6, c_low_max=0.9, c_low_step=0.02,
        c_high_start=1.2, c_high_max=3.0, c_high_step=0.05,
        statistic="value", weight_by_behavior_prob=False,
    ),
}  # fmt: skip
AUTHORS = {
    "learning_rate": 1e-6,
    "temperature": 1.0,
    "bapo": dict(
        rho0=1.0, target="pos_neg_ratio", order="lower_first", scope="micro_batch", dual_clip=3.0,
        c_low_start=0.6, c_low_max=0.8, c_low_step=0.05,
        c_high_start=1.2, c_high_max=2.0, c_high_step=0.05,
        statistic="value", weight_by_behavior_prob=False,
    ),
}  # fmt: skip


def _check(config, expected):
    t = config.trainer
    assert t.algorithm.loss == "bapo"
    assert t.optimizer.learning_rate == expected["learning_rate"]
    assert t.rollout.temperature == expected["temperature"]
    bapo = t.algorithm.bapo
    assert {k: getattr(bapo, k) for k in expected["bapo"]} == expected["bapo"]


@pytest.mark.parametrize("experiment", [aime_7b, aime_32b], ids=["aime_7b", "aime_32b"])
@pytest.mark.parametrize("name, expected", [("paper", PAPER), ("authors", AUTHORS)])
def test_each_recipe_sets_its_published_values(experiment, name, expected):
    config = recipes.apply_recipe(experiment.CONFIG, name)
    _check(config, expected)
    # ... and nothing but those: the data, model, batch shape, steps and eval stay the run's.
    t, base = config.trainer, experiment.CONFIG.trainer
    assert (config.data, config.model, config.eval, config.mesh) == (
        experiment.CONFIG.data, experiment.CONFIG.model, experiment.CONFIG.eval,
        experiment.CONFIG.mesh,
    )  # fmt: skip
    assert (t.steps, t.rollout.prompts_per_step, t.rollout.samples_per_prompt) == (
        base.steps, base.rollout.prompts_per_step, base.rollout.samples_per_prompt,
    )  # fmt: skip
    assert (t.algorithm.mini_batches, t.algorithm.epochs, t.algorithm.ratio_base) == (
        base.algorithm.mini_batches, base.algorithm.epochs, base.algorithm.ratio_base,
    )  # fmt: skip
    assert t.optimizer.warmup_steps == base.optimizer.warmup_steps


def test_the_grids_are_the_stated_ones():
    paper, authors = recipes.PAPER_BAPO, recipes.AUTHORS_BAPO
    assert [round(x, 6) for x in paper.low_grid] == [round(0.6 + 0.02 * i, 6) for i in range(16)]
    assert len(paper.high_grid) == 37 and paper.high_grid[-1] == pytest.approx(3.0)
    assert [round(x, 6) for x in authors.low_grid] == [0.6, 0.65, 0.7, 0.75, 0.8]
    assert [round(x, 6) for x in authors.high_grid] == [round(1.2 + 0.05 * i, 6) for i in range(17)]


def test_no_recipe_keeps_the_experiment_config():
    assert recipes.apply_recipe(aime_7b.CONFIG, None) == aime_7b.CONFIG
    args = build_parser("aime_7b").parse_intermixed_args([])
    assert args.recipe is None and resolve(aime_7b.CONFIG, args) == aime_7b.CONFIG


def test_the_command_lines_settings_win_over_the_recipe():
    config = recipes.apply_recipe(
        aime_7b.CONFIG,
        "authors",
        ["trainer.rollout.temperature=0.6", "trainer.algorithm.bapo.c_high_max=3.0"],
    )
    assert config.trainer.rollout.temperature == 0.6
    assert config.trainer.algorithm.bapo.c_high_max == 3.0
    assert config.trainer.algorithm.bapo.scope == "micro_batch"  # the rest is the recipe's
    # Through the experiments' command line: the recipe, then overrides and flags.
    args = build_parser("aime_7b").parse_intermixed_args(
        ["--recipe", "paper", "trainer.optimizer.learning_rate=3e-6", "--mesh", "32b"]
    )
    config = resolve(aime_7b.CONFIG, args)
    assert config.trainer.optimizer.learning_rate == 3e-6
    assert config.mesh == "32b"
    assert config.trainer.algorithm.bapo == BAPOConfig()  # the paper's search


def test_an_unknown_recipe_is_refused_naming_it_and_the_choices():
    with pytest.raises(RunConfigError) as error:
        recipes.apply_recipe(aime_7b.CONFIG, "verl")
    message = str(error.value)
    assert "--recipe" in message and "'verl'" in message
    assert "authors, paper" in message
    args = build_parser("aime_7b").parse_intermixed_args(["--recipe", "Paper"])
    with pytest.raises(RunConfigError, match="unknown recipe 'Paper'; choose one of authors"):
        resolve(aime_7b.CONFIG, args)


def test_the_run_says_which_recipe_it_applied():
    assert recipes.describe(None).startswith("recipe: none")
    line = recipes.describe("authors")
    assert line.startswith("recipe: authors, the authors' verl recipe")
    assert "trainer.algorithm.bapo.dual_clip=3.0" in line
    assert "trainer.rollout.temperature=1.0" in line


def test_the_study_arms_share_the_recipes_definitions():
    # One declaration: the study's bapo_code arm is the authors' search on the paper's grids
    # (how the committed study ran), --recipe authors the same search on the yaml's grids.
    assert offpolicy_study.ARMS["bapo_paper"].bapo is recipes.PAPER_BAPO
    code = offpolicy_study.ARMS["bapo_code"].bapo
    assert code is recipes.AUTHORS_SEARCH
    assert (code.c_low_max, code.c_high_max) == (0.9, 3.0)
    grids = ("c_low_max", "c_low_step", "c_high_max")
    assert {
        k: getattr(recipes.AUTHORS_BAPO, k) for k in recipes.SEARCH_FIELDS if k not in grids
    } == {k: getattr(code, k) for k in recipes.SEARCH_FIELDS if k not in grids}
