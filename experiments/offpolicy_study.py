"""The first off-policy study (v1): does BAPO keep RL stable where fixed clipping does not?

Kept for its record (docs/offpolicy_study_v1.md, which says why it cannot tell) and as the
machinery the study v2 (`experiments.evidence_study`, docs/evidence_study.md) runs on: the
`Plan`, the single-threaded children, the warm start and the quick drift check.

    python -m experiments.offpolicy_study --out-dir runs/offpolicy_study [--workers 2]
    python -m experiments.offpolicy_study --quick --out-dir runs/offpolicy_study_quick
    python -m experiments.offpolicy_study --explore --out-dir runs/offpolicy_explore

Every run starts from one warm start of the CPU arithmetic task (the main job's recipe,
`experiments.cpu_arithmetic`) and differs only in its arm (the loss), its cell (E updates per
rollout batch, rollout staleness k) and its seed (prompt order and sampling). Arms: fixed clip
[0.8, 1.2], clip-higher [0.8, 1.28], dual-clip PPO (c = 3), BAPO as the paper configures it and
BAPO as the authors' code does; cells: on-policy (E = 1, k = 0, the control), moderate (E = 8)
and the hardest regime `--explore` found; ablations of BAPO on the hardest regime (rho0, search
order, search scope). Each run is a child process on one core with one XLA thread
(`bapo_jax.tasks.study`); `--workers` run at once.

Writes <out>/report.md (tables, statistics, claims) and figures; `docs/offpolicy_study_v1.md`
is that report as committed, with the command and commit that produced it. `--quick`: every arm
once at toy size (CI), not a result; `--check RECORD` compares its metrics with those RECORD
holds for this host's CPU class (`study.cpu_class`; a class without a record is noted, not
compared), `--record RECORD` adds them for the class.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import shutil
import sys
import time

from bapo_jax.algorithms.losses import ClipHigherConfig, PPOClipConfig
from bapo_jax.run import recipes
from bapo_jax.run.config import RunConfig
from bapo_jax.tasks import study
from bapo_jax.tasks import study_report as report
from bapo_jax.tasks import study_stats as stats
from bapo_jax.tasks.arithmetic_job import TaskConfig, WarmStartConfig
from bapo_jax.tasks.job_report import read_rows
from bapo_jax.train.config import (
    AlgorithmConfig,
    CheckpointConfig,
    LoggingConfig,
    Minibatch,
    OffPolicyConfig,
)
from experiments import cpu_arithmetic as main_job
from experiments import offpolicy_report
from experiments.records import commit

MODULE = "experiments.offpolicy_study"

# ---- the arms ------------------------------------------------------------------------------------
# Declared once in `run.recipes` (the `--recipe` settings of the GPU experiments).
PAPER_BAPO = recipes.PAPER_BAPO  # rho0 0.4, upper-first, P / (P + N), update-wide (Sec. 5.1)
# The authors' verl recipe's search: c_low first, target P / N >= 1.0 (their yaml), dual clip
# 3.0, the search per micro-batch; on the paper's grids (c_low 0.6-0.9, c_high 1.2-3.0), as this
# study ran it (`--recipe authors` also takes their yaml's grids, `recipes.AUTHORS_BAPO`).
CODE_BAPO = recipes.AUTHORS_SEARCH
ARMS = {
    "clip": AlgorithmConfig(loss="ppo_clip", ppo_clip=PPOClipConfig(epsilon=0.2)),
    "clip_higher": AlgorithmConfig(
        loss="clip_higher", clip_higher=ClipHigherConfig(eps_low=0.2, eps_high=0.28)
    ),
    "dual_clip": AlgorithmConfig(
        loss="ppo_clip", ppo_clip=PPOClipConfig(epsilon=0.2, dual_clip=3.0)
    ),
    "bapo_paper": AlgorithmConfig(loss="bapo", bapo=PAPER_BAPO),
    "bapo_code": AlgorithmConfig(loss="bapo", bapo=CODE_BAPO),
}
BASELINES = ("clip", "clip_higher", "dual_clip")


def _dual_clip(arm: AlgorithmConfig) -> float | None:
    return getattr(arm, arm.loss).dual_clip


# ---- the runs ------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    """A study: the task and warm start every run shares, the base run (iterations, batch,
    learning rate), the arms x cells x seeds grid, and the ablations (run on `ablation_cell`);
    minibatch: how every run cuts its E mini-batches (`AlgorithmConfig.minibatch`);
    cell_arms: the arms a cell runs, when not all of them."""

    task: TaskConfig
    warm_start: WarmStartConfig
    run: RunConfig
    arms: dict[str, AlgorithmConfig]
    cells: tuple[study.Cell, ...]
    seeds: tuple[int, ...]
    ablations: dict[str, AlgorithmConfig]
    ablation_cell: str | None
    collapse: study.CollapseRule
    minibatch: Minibatch = "groups"
    cell_arms: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        for cell, arms in self.cell_arms.items():
            unknown = set(arms) - set(self.arms)
            if cell not in {c.name for c in self.cells} or unknown:
                raise ValueError(f"Plan.cell_arms[{cell!r}]: unknown cell or arms {unknown}")

    def arms_of(self, cell: study.Cell) -> dict[str, AlgorithmConfig]:
        names = self.cell_arms.get(cell.name, tuple(self.arms))
        return {a: self.arms[a] for a in names}

    def arm_config(self, algorithm: AlgorithmConfig, cell: study.Cell) -> AlgorithmConfig:
        """An arm's loss as a run takes it: the cell's E updates, the plan's cut."""
        return dataclasses.replace(
            algorithm,
            mini_batches=cell.mini_batches,
            epochs=cell.epochs,
            minibatch=cell.minibatch or self.minibatch,
        )

    def specs(self) -> list[study.RunSpec]:
        grid = [
            study.RunSpec(arm, algorithm, cell, seed)
            for cell in self.cells
            for seed in self.seeds
            for arm, algorithm in self.arms_of(cell).items()
        ]
        cell = {c.name: c for c in self.cells}.get(self.ablation_cell)
        grid += (
            [
                study.RunSpec(arm, algorithm, cell, seed)
                for seed in self.seeds
                for arm, algorithm in self.ablations.items()
            ]
            if cell is not None
            else []
        )
        return grid

    def config(self, spec: study.RunSpec, hf_dir: str) -> RunConfig:
        """The run of `spec`: the base run with its loss, E, k and seed."""
        t, cell = self.run.trainer, spec.cell
        algorithm = self.arm_config(spec.algorithm, cell)
        optimizer = t.optimizer
        if cell.learning_rate is not None:
            optimizer = dataclasses.replace(optimizer, learning_rate=cell.learning_rate)
        trainer = dataclasses.replace(
            t,
            steps=cell.steps or t.steps,
            eval_every=cell.eval_every or t.eval_every,
            algorithm=algorithm,
            optimizer=optimizer,
            offpolicy=OffPolicyConfig(staleness=cell.staleness, partial_budget=cell.partial_budget),
            rollout=dataclasses.replace(
                t.rollout,
                seed=spec.seed,
                prompts_per_step=cell.prompts_per_step or t.rollout.prompts_per_step,
            ),
        )
        model = dataclasses.replace(self.run.model, hf_dir=hf_dir)
        return dataclasses.replace(self.run, trainer=trainer, model=model)


STUDY_TRAINER = dataclasses.replace(
    main_job.TRAINER,
    steps=40,
    eval_every=10,
    checkpoint=CheckpointConfig(every=0, keep=1),
    logging=LoggingConfig(tensorboard=False, plots=False, progress=False),
)
# The study decodes with XLA's ops, as its published numbers were made (chosen when the CPU
# kernels were slow on this AVX2 host; since fixed: docs/rollout.md).
STUDY_RUN = dataclasses.replace(
    main_job.RUN,
    trainer=STUDY_TRAINER,
    engine=dataclasses.replace(main_job.RUN.engine, cpu_kernels=False),
)


# ---- children: the warm start and each run, in their own single-threaded process ---------------
def warm_dir(out_dir: str, warm: WarmStartConfig) -> str:
    return os.path.join(out_dir, f"warm_start_{warm.steps}")


def _prepared(spec: dict):
    """The task and warm start a child's spec names (computed once, then read back)."""
    from bapo_jax.tasks import arithmetic_job as job

    return job.prepare(
        TaskConfig(**spec["task"]),
        main_job.SHAPE,
        WarmStartConfig(**spec["warm_start"]),
        spec["rl_prompts"],
        spec["warm_dir"],
        eval_max_tokens=spec["eval_max_tokens"],
    )


def child_warm_start(directory: str) -> None:
    """Computes (or reads back) the warm start the spec in `directory` describes; with the
    task's `eval_samples`, its full evaluation too (`start_eval`: pass@k at iteration 0)."""
    from flax import nnx

    from bapo_jax.models.hf import load_pretrained
    from bapo_jax.tasks import arithmetic_job as job

    spec = study.read_json(os.path.join(directory, "spec.json"))
    prepared = _prepared(spec)
    record = {"accuracy": prepared.accuracy, "loss": prepared.loss, "hf_dir": prepared.hf_dir}
    task = prepared.task
    if task.eval_samples:
        graphdef, params = nnx.split(load_pretrained(prepared.hf_dir))
        engine = job.engine_for(task, graphdef, params)
        record["start_eval"] = job.evaluate(engine, task, spec["eval_max_tokens"])
    study.write_json(os.path.join(directory, study.DONE), record)


def child_run(directory: str) -> None:
    """Trains the run the spec in `directory` describes (metrics.jsonl there), then marks it
    done with its wall time; the parent reads its measures from the metrics."""
    from bapo_jax.overrides import config_from_dict
    from bapo_jax.tasks import arithmetic_job as job

    spec = study.read_json(os.path.join(directory, "spec.json"))
    config = config_from_dict(RunConfig, spec["config"])
    prepared = _prepared(spec)
    start = time.perf_counter()
    job.run_rl(prepared, config, directory)
    study.write_json(os.path.join(directory, study.DONE), {"wall_s": time.perf_counter() - start})


# ---- the parent: warm starts, then every run --------------------------------------------------
def _spec_common(plan: Plan, warm: WarmStartConfig, out_dir: str) -> dict:
    rollout = plan.run.trainer.rollout
    return {
        "task": dataclasses.asdict(plan.task),
        "warm_start": dataclasses.asdict(warm),
        "warm_dir": os.path.abspath(warm_dir(out_dir, warm)),
        # every cell's batches without repeats (the iterator reshuffles for another epoch)
        "rl_prompts": max(
            (c.steps or plan.run.trainer.steps) * (c.prompts_per_step or rollout.prompts_per_step)
            for c in plan.cells
        ),
        "eval_max_tokens": rollout.max_response_tokens,
    }


def child_compile_warmup(directory: str) -> None:
    """Runs the run its spec describes from a randomly initialised model of the warm start's
    shape, beside the warm start (`ensure_warm_start`). Its output is thrown away: what it
    leaves is the shared compilation cache holding the programs of the runs (sampling,
    log-probs, the update, evaluation), which depend on shapes and settings, not on weights.
    A run that finds a program there loads the executable its own compile would have made,
    so no run's numbers change."""
    from bapo_jax.models import init_model, save_pretrained
    from bapo_jax.overrides import config_from_dict
    from bapo_jax.tasks import arithmetic_job as job

    spec = study.read_json(os.path.join(directory, "spec.json"))
    task_config = TaskConfig(**spec["task"])
    task = job.build_task(task_config, main_job.SHAPE, spec["rl_prompts"])
    config = config_from_dict(RunConfig, spec["config"])
    save_pretrained(init_model(task.model_config), config.model.hf_dir)
    job.write_hf_tokenizer(task, config.model.hf_dir)
    prepared = job.Prepared(task, config.model.hf_dir, float("nan"), 0.0, task_config.seed)
    job.run_rl(prepared, config, os.path.join(directory, "run"))
    study.write_json(os.path.join(directory, study.DONE), {})


def ensure_warm_start(plan: Plan, out_dir: str, warmup: study.RunSpec | None = None) -> dict:
    """The plan's warm start, computed in a single-threaded child once; its record. With
    `warmup` (a run of the plan), that run goes from a random model in a second child at the
    same time (`child_compile_warmup`), on the core the warm start leaves idle."""
    from bapo_jax.overrides import config_to_dict

    directory = warm_dir(out_dir, plan.warm_start) + ".job"
    record = os.path.join(directory, study.DONE)
    if not os.path.exists(record):
        common = _spec_common(plan, plan.warm_start, out_dir)
        os.makedirs(directory, exist_ok=True)
        study.write_json(os.path.join(directory, "spec.json"), common)
        jobs = [("warm start", directory)]
        if warmup is not None:
            compile_dir = os.path.join(out_dir, "compile_warmup")
            shutil.rmtree(compile_dir, ignore_errors=True)
            os.makedirs(compile_dir)
            config = plan.config(warmup, os.path.join(compile_dir, "hf"))
            spec = {**common, "config": config_to_dict(config)}
            study.write_json(os.path.join(compile_dir, "spec.json"), spec)
            jobs.append(("compile warm-up", compile_dir))
        study.run_all(
            jobs,
            lambda d: [
                sys.executable,
                "-m",
                MODULE,
                "--child-warm-start" if d == directory else "--child-compile-warmup",
                d,
            ],
            workers=len(jobs),
            compile_cache=os.path.join(out_dir, "jax_cache"),
            log=lambda line: print(line, flush=True),
        )
    return study.read_json(record)


def run_plan(
    plan: Plan, out_dir: str, workers: int, compile_warmup: bool = False
) -> dict[str, dict]:
    """Every run of `plan` (the finished ones read back); name -> its measures. With
    `compile_warmup` and two workers or more, the first run also goes from a random model
    beside the warm start (`child_compile_warmup`: quick plans, where compiling is most of a
    run's time)."""
    from bapo_jax.overrides import config_to_dict

    specs = plan.specs()
    warm = ensure_warm_start(plan, out_dir, specs[0] if compile_warmup and workers > 1 else None)
    common = _spec_common(plan, plan.warm_start, out_dir)
    for spec in specs:
        directory = os.path.join(out_dir, spec.name)
        os.makedirs(directory, exist_ok=True)
        config = config_to_dict(plan.config(spec, warm["hf_dir"]))
        study.write_json(os.path.join(directory, "spec.json"), {**common, "config": config})
    study.run_all(
        [(s.name, os.path.join(out_dir, s.name)) for s in specs],
        lambda d: [sys.executable, "-m", MODULE, "--child", d],
        workers=workers,
        compile_cache=os.path.join(out_dir, "jax_cache"),
        log=lambda line: print(line, flush=True),
    )
    return {s.name: measure(plan, s, os.path.join(out_dir, s.name), warm) for s in specs}


def measure(plan: Plan, spec: study.RunSpec, directory: str, warm: dict) -> dict:
    """A finished run's measures (`study.measures`), from its metrics rows."""
    result = study.measures(read_rows(directory), plan.collapse, start_accuracy=warm["accuracy"])
    result["wall_s"] = study.read_json(os.path.join(directory, study.DONE))["wall_s"]
    return result


# ---- finding the hard regime --------------------------------------------------------------------
EXPLORE_ARMS = ("clip", "bapo_paper")
EXPLORE_SEEDS = (0, 1)
# (warm-start steps, cell): lower warm-start accuracy (fewer supervised steps), more updates
# per batch, staler rollouts, larger learning rates.
EXPLORE = (
    (600, study.Cell("w600_E1_lr1e-4", updates=1)),
    (600, study.Cell("w600_E16_k2_lr1e-4", updates=16, staleness=2)),
    (600, study.Cell("w600_E16_k2_lr3e-4", updates=16, staleness=2, learning_rate=3e-4)),
    (600, study.Cell("w600_E1_lr3e-4", updates=1, learning_rate=3e-4)),
    (600, study.Cell("w600_E8_lr1e-4", updates=8)),
    (600, study.Cell("w600_E16_k2_lr2e-4", updates=16, staleness=2, learning_rate=2e-4)),
    (200, study.Cell("w200_E1_lr1e-4", updates=1)),
    (200, study.Cell("w200_E16_k2_lr1e-4", updates=16, staleness=2)),
    (200, study.Cell("w200_E16_k2_lr3e-4", updates=16, staleness=2, learning_rate=3e-4)),
    (200, study.Cell("w200_E1_lr3e-4", updates=1, learning_rate=3e-4)),
)


def explore(base: Plan, out_dir: str, workers: int) -> tuple[dict[str, dict], dict[int, float]]:
    """EXPLORE_ARMS x EXPLORE x EXPLORE_SEEDS from `base`: the runs' measures, and each warm
    start's held-out accuracy by its supervised steps."""
    results, warm_accuracy = {}, {}
    for steps in sorted({w for w, _ in EXPLORE}, reverse=True):
        plan = dataclasses.replace(
            base,
            warm_start=dataclasses.replace(base.warm_start, steps=steps),
            arms={a: base.arms[a] for a in EXPLORE_ARMS},
            cells=tuple(c for w, c in EXPLORE if w == steps),
            seeds=EXPLORE_SEEDS,
            ablations={},
        )
        results.update(run_plan(plan, out_dir, workers))
        warm_accuracy[steps] = ensure_warm_start(plan, out_dir)["accuracy"]
    return results, warm_accuracy


ABLATIONS = {  # BAPO as the paper configures it, one setting changed (on the hardest cell)
    **{
        f"bapo_rho0_{rho0}": dataclasses.replace(
            ARMS["bapo_paper"], bapo=dataclasses.replace(PAPER_BAPO, rho0=rho0)
        )
        for rho0 in (0.3, 0.5, 0.6)  # 0.4 is the paper arm itself
    },
    "bapo_lower_first": dataclasses.replace(
        ARMS["bapo_paper"], bapo=dataclasses.replace(PAPER_BAPO, order="lower_first")
    ),
    # Two micro-batches per update (one for every other run), so that a search per micro-batch
    # differs from the update-wide one (which does not depend on the micro-batching).
    "bapo_micro_batch_scope": dataclasses.replace(
        ARMS["bapo_paper"],
        bapo=dataclasses.replace(PAPER_BAPO, scope="micro_batch"),
        micro_batches=2,
    ),
}
STUDY = Plan(
    task=main_job.TASK,
    warm_start=main_job.WARM_START,
    run=STUDY_RUN,
    arms=ARMS,
    # From --explore (docs/offpolicy_study_v1.md): at E = 16, k = 2 fixed clipping loses ~13 points
    # at the main job's learning rate and collapses at 2e-4 (so does BAPO); E = 8 barely hurts.
    cells=(
        study.Cell("on_policy", updates=1),
        study.Cell("moderate", updates=8),
        study.Cell("hard", updates=16, staleness=2),
        study.Cell("collapse", updates=16, staleness=2, learning_rate=2e-4),
    ),
    seeds=(0, 1, 2, 3, 4),
    ablations=ABLATIONS,
    ablation_cell="collapse",
    collapse=study.CollapseRule(entropy_below=0.02),
    # The committed report was made when the loop shuffled single rows into the mini-batches.
    minibatch="rows",
)


def toy_run(run: RunConfig) -> RunConfig:
    """A quick mode's run: 3 iterations of 8 prompts x 4 samples, evaluated after the last."""
    t = run.trainer
    rollout = dataclasses.replace(t.rollout, prompts_per_step=8, samples_per_prompt=4)
    trainer = dataclasses.replace(t, steps=3, eval_every=3, rollout=rollout)
    return dataclasses.replace(run, trainer=trainer)


# Every arm once at toy size: the main job's quick task with a warm start long enough that
# some rewards are 1, 8 prompts x 4 samples, 3 iterations, E = 4 with k = 1. Its first arm
# also runs from a random model beside the warm start (`child_compile_warmup`).
QUICK = dataclasses.replace(
    STUDY,
    task=main_job.QUICK_TASK,
    warm_start=dataclasses.replace(main_job.QUICK_WARM_START, steps=150),
    run=toy_run(STUDY_RUN),
    cells=(study.Cell("quick", updates=4, staleness=1),),
    seeds=(0,),
    ablations={},
    ablation_cell=None,
)


def plan_record(plan: Plan) -> dict:
    """The plan as JSON values (what the committed report records and CI compares)."""
    from bapo_jax.overrides import config_to_dict

    record = {
        "task": dataclasses.asdict(plan.task),
        "warm_start": dataclasses.asdict(plan.warm_start),
        "run": config_to_dict(plan.run),
        "arms": {k: config_to_dict(v) for k, v in plan.arms.items()},
        "cells": [dataclasses.asdict(c) for c in plan.cells],
        "seeds": list(plan.seeds),
        "ablations": {k: config_to_dict(v) for k, v in plan.ablations.items()},
        "ablation_cell": plan.ablation_cell,
        "collapse": dataclasses.asdict(plan.collapse),
        "minibatch": plan.minibatch,
        "cell_arms": {k: list(v) for k, v in plan.cell_arms.items()},
    }
    return json.loads(json.dumps(record))


QUICK_KEYS = ("accuracy_last", "entropy_last", "rho_after", "clip_low_frac", "clip_high_frac")


def quick_metrics(results: dict[str, dict]) -> dict[str, dict]:
    """The recorded part of a quick run's measures (deterministic: single-threaded children)."""
    return {
        name: report.rounded({k: m[k] for k in QUICK_KEYS}, digits=5)
        for name, m in sorted(results.items())
    }


def check(
    record_path: str,
    quick: dict[str, dict],
    cpu: str,
    plan: Plan | None = None,
    module: str = MODULE,
) -> tuple[list[str], list[str]]:
    """(problems, notes): what differs between the committed record and this code -- the
    study's plan (default STUDY), and the quick runs' metrics as recorded for this host's CPU
    class `cpu` (`study.cpu_class`: fp32 trajectories differ between instruction sets, each
    deterministic). A class without a record can only be recorded on such a host: that is a
    note, not a problem (the plan is still checked)."""
    recorded = study.read_json(record_path)
    problems = []
    if recorded["plan"] != plan_record(plan or STUDY):
        problems.append("the study's configuration differs from the one the report was made with")
    if cpu not in recorded["quick"]:
        note = (
            f"no quick-run record for CPU class {cpu!r} (recorded: "
            f"{', '.join(sorted(recorded['quick']))}): the metrics were not compared; at a "
            f"commit whose recorded classes pass, add them: python -m {module} --quick "
            f"--record {record_path}"
        )
        return problems, [note]
    mine = recorded["quick"][cpu]
    for name in sorted(set(mine) | set(quick)):
        if mine.get(name) != quick.get(name):
            problems.append(
                f"quick run {name} ({cpu}): recorded {mine.get(name)}, now {quick.get(name)}"
            )
    return problems, []


def record_quick(
    record_path: str, quick: dict[str, dict], cpu: str, plan: Plan | None = None
) -> list[str]:
    """Adds (or replaces) CPU class `cpu`'s quick-run metrics in the record; refused, with the
    problem returned, when the study's configuration (default STUDY) is not the recorded one."""
    recorded = study.read_json(record_path)
    if recorded["plan"] != plan_record(plan or STUDY):
        return ["the study's configuration differs from the one the report was made with"]
    recorded["quick"] = {**recorded["quick"], cpu: quick}
    study.write_json(record_path, recorded)
    return []


def plan_text(plan: Plan) -> str:
    """The setup in words, from the plan's values."""
    t = plan.run.trainer
    r, o = t.rollout, t.optimizer
    cells = "; ".join(
        f"`{c.name}`: E = {c.updates}, k = {c.staleness}"
        + (f", lr {c.learning_rate:g}" if c.learning_rate else "")
        for c in plan.cells
    )
    return (
        f"- Task: 3-operation arithmetic, operands 0-{plan.task.max_operand}, "
        f"{plan.task.n_eval} held-out problems (greedy accuracy); model: the main job's "
        f"Qwen2 ({main_job.SHAPE.layers} layers, width {main_job.SHAPE.hidden}), warm-started "
        f"by {plan.warm_start.steps} supervised steps.\n"
        f"- Each run: {t.steps} RL iterations of {r.prompts_per_step} prompts x "
        f"{r.samples_per_prompt} samples (<= {r.max_response_tokens} tokens), GRPO advantages, "
        f"AdamW lr {o.learning_rate:g}, one micro-batch per update, held-out "
        f"evaluation every {t.eval_every} iterations; seeds {list(plan.seeds)} (prompt order "
        "and sampling: the same seed gives every arm the same first batch).\n"
        f"- Cells: {cells}. E = updates per rollout batch (the batch cut into E mini-batches); "
        "k = rollouts come from the policy k versions back.\n"
        "- Arms: `clip` [0.8, 1.2]; `clip_higher` [0.8, 1.28]; `dual_clip` [0.8, 1.2] with "
        "A < 0 ratios capped at 3; `bapo_paper` rho0 0.4, c_low 0.6-0.9, c_high 1.2-3.0, "
        "c_high first, P / (P + N), update-wide; `bapo_code` (the authors' verl recipe) c_low "
        "first, P / N >= 1.0, dual clip 3, per micro-batch (with one micro-batch per update, "
        "the same as update-wide; the ablation `bapo_micro_batch_scope` uses two).\n"
        "- Measures: held-out accuracy at the end and the best; entropy over the last quarter "
        "of iterations; rho = P / (P + N) at the bounds used, P and N the |A|-weighted "
        "clipped ratios of the positive and the negative tokens (BAPO: also at its start "
        "bounds, before its search; `bapo_code` searches on P / N, reported here as the "
        "fraction too); c_low, c_high: the bounds used, mean over updates (BAPO's search "
        "starts at 0.6, 1.2 every update); "
        f"clip fractions; grad spikes = iterations whose max grad norm exceeds "
        f"{study.SPIKE_FACTOR:g}x the run's median; collapses = iterations with entropy below "
        f"{plan.collapse.entropy_below:g} plus evaluations >= "
        f"{100 * plan.collapse.accuracy_drop:g} points below the run's best so far.\n"
        f"- Intervals: 95% percentile bootstrap of the mean over seeds "
        f"({stats.BOOTSTRAP_RESAMPLES:,} resamples); tests: two-sided paired t-test by seed, "
        f"Holm-corrected within each table; a claim holds when its comparisons agree in sign at "
        f"Holm p < {report.ALPHA:g}."
    )


def write_report(
    plan: Plan,
    results: dict[str, dict],
    out_dir: str,
    *,
    command: str,
    wall_s: float,
    workers: int,
    exploration: str | None,
    quick: dict[str, dict],
    cpu: str,
) -> str:
    """offpolicy_study_v1.md, its figure and offpolicy_study_v1.json (the record CI compares) in
    `out_dir`; returns the report's text. `quick` is recorded as CPU class `cpu`'s."""
    cells = [c.name for c in plan.cells]
    figure = "offpolicy_study_v1.png"
    report.figure(
        results, cells, list(plan.arms), os.path.join(out_dir, figure), "mean over seeds per arm"
    )
    warm = study.read_json(os.path.join(warm_dir(out_dir, plan.warm_start) + ".job", study.DONE))
    today = datetime.date.today().isoformat()
    text = offpolicy_report.render(
        plan_text=plan_text(plan),
        command=command,
        commit=commit(),
        date=today,
        wall_s=wall_s,
        workers=workers,
        warm_accuracy=warm["accuracy"],
        results=results,
        cells=cells,
        arms=list(plan.arms),
        baselines=BASELINES,
        ablations=list(plan.ablations),
        ablation_cell=plan.ablation_cell,
        dual_clip_arms=[a for a, arm in plan.arms.items() if _dual_clip(arm) is not None],
        start_bounds=(PAPER_BAPO.c_low_start, PAPER_BAPO.c_high_start),
        rho0=PAPER_BAPO.rho0,
        exploration=exploration,
        quick=quick,
        cpu=cpu,
        figure_name=figure,
    )
    with open(os.path.join(out_dir, "offpolicy_study_v1.md"), "w", encoding="utf-8") as f:
        f.write(text)
    record = {"commit": commit(), "date": today, "command": command, "wall_s": round(wall_s)}
    record.update({"plan": plan_record(STUDY), "quick": {cpu: quick}})
    study.write_json(os.path.join(out_dir, "offpolicy_study_v1.json"), record)
    return text


def missing_rows(plan: Plan, text: str) -> list[str]:
    """The arms and ablations without a row in their cell's table of the report `text`."""
    missing = []
    for cell in plan.cells:
        arms = list(plan.arms) + (list(plan.ablations) if cell.name == plan.ablation_cell else [])
        table = text.split(f"## Cell `{cell.name}`")[-1]
        missing += [
            f"{cell.name}/{a}" for a in arms if f"\n| {a} | {len(plan.seeds)} |" not in table
        ]
    return missing


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="runs/offpolicy_study")
    ap.add_argument("--workers", type=int, default=2, help="runs at once, one core each")
    ap.add_argument("--quick", action="store_true", help="every arm once at toy size (CI)")
    ap.add_argument("--check", default=None, help="with --quick: the record to compare with")
    ap.add_argument(
        "--record",
        default=None,
        help="with --quick: add this host's CPU class's quick metrics to the record",
    )
    ap.add_argument("--explore", action="store_true", help="the search for the hard regime")
    ap.add_argument("--explore-dir", default=None, help="an --explore output to report")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-warm-start", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-compile-warmup", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    children = {
        child_run: args.child,
        child_warm_start: args.child_warm_start,
        child_compile_warmup: args.child_compile_warmup,
    }
    for child, directory in children.items():
        if directory:
            study.pin_to_core()
            child(directory)
            return
    for flag, value in (("--check", args.check), ("--record", args.record)):
        if value and not args.quick:
            ap.error(f"{flag}: needs --quick")
    if args.workers < 1:
        ap.error(f"--workers must be >= 1, got {args.workers}")
    os.makedirs(args.out_dir, exist_ok=True)
    command = " ".join(["python -m", MODULE, *sys.argv[1:]])
    cpu = study.cpu_class()
    start = time.perf_counter()
    if args.explore:
        results, warm_accuracy = explore(STUDY, args.out_dir, args.workers)
        study.write_json(os.path.join(args.out_dir, "explore.json"), results)
        text = offpolicy_report.exploration_report(
            results,
            warm_accuracy,
            command=command,
            commit=commit(),
            date=datetime.date.today().isoformat(),
            cpu=study.cpu_class(),
            wall_s=time.perf_counter() - start,
            setup=plan_text(dataclasses.replace(STUDY, seeds=EXPLORE_SEEDS)).split("\n- Cells")[0],
        )
        with open(os.path.join(args.out_dir, "explore.md"), "w", encoding="utf-8") as f:
            f.write(text)
        print(text)
    elif args.quick:
        results = run_plan(QUICK, args.out_dir, args.workers, compile_warmup=True)
        quick = quick_metrics(results)
        text = write_report(
            QUICK,
            results,
            args.out_dir,
            command=command,
            wall_s=time.perf_counter() - start,
            workers=args.workers,
            exploration=None,
            quick=quick,
            cpu=cpu,
        )
        problems = [f"no report row for {name}" for name in missing_rows(QUICK, text)]
        if args.check:
            found, notes = check(args.check, quick, cpu)
            problems += found
            for line in notes:
                print(f"note: {line}", file=sys.stderr)
        if args.record and not problems:  # only a complete, consistent quick run is recorded
            problems += record_quick(args.record, quick, cpu)
        for line in problems:
            print(f"error: {line}", file=sys.stderr)
        if problems:
            print(f"error: regenerate the report: python -m {MODULE}", file=sys.stderr)
            raise SystemExit(1)
    else:
        results = run_plan(STUDY, args.out_dir, args.workers)
        quick = quick_metrics(
            run_plan(QUICK, os.path.join(args.out_dir, "quick"), args.workers, compile_warmup=True)
        )
        exploration = None
        if args.explore_dir:
            with open(os.path.join(args.explore_dir, "explore.md"), encoding="utf-8") as f:
                exploration = f.read()
        write_report(
            STUDY,
            results,
            args.out_dir,
            command=command,
            wall_s=study.add_wall_time(args.out_dir, time.perf_counter() - start),
            workers=args.workers,
            exploration=exploration,
            quick=quick,
            cpu=cpu,
        )
    print(f"done in {time.perf_counter() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
