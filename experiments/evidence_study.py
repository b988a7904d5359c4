"""The off-policy study v2: BAPO tested where its precondition holds, with the power to tell.

    python -m experiments.evidence_study --out-dir runs/evidence [--workers 2] [--docs docs]
        [--finished-only]   # run nothing: an interim report of the cells that have finished
    python -m experiments.evidence_study --quick --out-dir runs/evidence_quick \
        [--check docs/offpolicy_study.json | --record docs/offpolicy_study.json]
    python -m experiments.evidence_study --pilot --out-dir runs/evidence_pilot [--cap 64] \
        [--cells stale,partial,stale_rows]

BAPO widens its clip bounds while the positive-advantage tokens carry less than rho0 of the
objective. With GRPO advantages and whole-group mini-batches (`algorithm.minibatch="groups"`),
that happens at r = 1 only where a group's wrong responses are longer than its right ones
(`train.balance`); the arithmetic task's are not (length ratio 0.99 in the main job). This
study runs on the countdown task (`tasks.countdown`): a search whose failures run to the
response cap, and whose prompts can have several correct answers.

Cells (`study.Cell`; 30 iterations of 32 prompts x 8 samples, <= 64 response tokens):

    on_policy      E = 1, k = 0: the control every collapse is measured against (one arm:
                   at r = 1 no bound clips, so every arm is the same policy gradient)
    stale          E = 8 (2 epochs x 4 mini-batches of whole groups), rollouts k = 1 behind
    partial        stale, with partial rollouts of 16-token rounds (the paper's Figure 12)
    fresh_control  the stale cell's 240 updates of 8 groups, each on a fresh on-policy batch
                   (8 prompts, 240 iterations): staleness isolated from update count and size

Arms: fixed clip, clip-higher, dual clip; BAPO as the paper writes it (rho0 0.4, its grids,
c_high first, P / (P + N), update-wide, Eq. 8's pi_rollout weighting of the statistic) with
and without the dual clip (the factorial adaptive bounds x dual clip with `clip` and
`dual_clip`); BAPO as the authors' recipe runs it (their grids, c_low first, P / N >= 1, dual
clip 3, per micro-batch); BAPO with the gradient statistic. Every arm runs `stale`; the
partial-rollout cell and the fresh control run clip and the paper's BAPO.

The precondition gate (`--pilot`): the baseline (`clip`) and `bapo_paper` on `stale` and
`partial`, 3 seeds. From the baseline's rows: at iteration 0 (the warm start's batch) the
wrong / right length ratio within groups, rho at r = 1 unweighted and pi_rollout-weighted and
the share of zero-variance groups; over the run, the share of updates whose rho at r = 1 is
below 0.4 (the paper's rho0) and below 1/2 (the recipe's P / N >= 1). A cell tests BAPO's
mechanism at a rho0 only where that share is >= 1/2. From the pairs bapo_paper - clip: the sd
of the paired differences of the primary measure, the effect 5 seeds detect at 80% power
(Holm's first step over the primaries) and the seeds that detect 5 points.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import signal
import sys
import time
from typing import Any

import numpy as np

from bapo_jax.run import recipes
from bapo_jax.tasks import study, study_report
from bapo_jax.tasks import study_stats as stats
from bapo_jax.tasks.arithmetic_job import TaskConfig, WarmStartConfig
from bapo_jax.tasks.job_report import read_rows
from bapo_jax.train.config import AlgorithmConfig
from experiments import evidence_report as report
from experiments import offpolicy_study as base
from experiments.evidence_report import Primary
from experiments.records import commit

CAP = 64  # response tokens: about 5 attempts of the 8 sign patterns, then the cap
TASK = TaskConfig(
    kind="countdown", size=4, n_basic=1000, n_target_sft=1000, n_eval=200, eval_samples=8
)
# Demonstrations run up to ~100 tokens (8 attempts); 600 steps give 0.255 greedy accuracy at
# the cap (docs/evidence_pilot.md; the issue's warm start: 0.2-0.35).
WARM_START = WarmStartConfig(steps=600, batch_size=64, length=112, learning_rate=1e-3)
TRAINER = dataclasses.replace(
    base.STUDY_TRAINER,
    steps=30,
    eval_every=10,
    rollout=dataclasses.replace(base.STUDY_TRAINER.rollout, max_response_tokens=CAP),
    # ||g_+||, ||g_-|| on every 8th update (one of each stale batch's E = 8; the split costs
    # another backward pass): the negative tokens' share of the gradient norm
    logging=dataclasses.replace(base.STUDY_TRAINER.logging, gradient_by_sign_every=8),
)
RUN = dataclasses.replace(
    base.STUDY_RUN,
    trainer=TRAINER,
    eval=dataclasses.replace(base.STUDY_RUN.eval, max_tokens=CAP),
)

PAPER = dataclasses.replace(recipes.PAPER_BAPO, weight_by_behavior_prob=True)  # Eq. 8
ARMS = {
    **{arm: base.ARMS[arm] for arm in base.BASELINES},  # clip, clip-higher, dual clip
    "bapo_paper": AlgorithmConfig(loss="bapo", bapo=PAPER),
    "bapo_paper_dual": AlgorithmConfig(loss="bapo", bapo=dataclasses.replace(PAPER, dual_clip=3.0)),
    "bapo_recipe": AlgorithmConfig(loss="bapo", bapo=recipes.AUTHORS_BAPO),
    "bapo_gradient": AlgorithmConfig(
        loss="bapo", bapo=dataclasses.replace(PAPER, statistic="gradient")
    ),
}
BASELINE = "clip"
STALE = study.Cell("stale", updates=8, epochs=2, staleness=1)
CELLS = (
    study.Cell("on_policy", updates=1),
    STALE,
    dataclasses.replace(STALE, name="partial", partial_budget=16),
    study.Cell("fresh_control", updates=1, prompts_per_step=8, steps=240, eval_every=80),
)
# The paper's claims, each with one pre-registered primary comparison (arm - clip by seed;
# TOST margins: 3 points of accuracy, 0.02 nats of entropy; the gate each needs).
PRIMARIES = (
    Primary("BAPO trains better under staleness", "stale", "bapo_paper", "accuracy_last", 0.03),
    Primary(
        "BAPO trains better with partial rollouts",
        "partial",
        "bapo_paper",
        "accuracy_last",
        0.03,
    ),
    Primary("BAPO keeps entropy up under staleness", "stale", "bapo_paper", "entropy_last", 0.02),
    Primary(
        "the authors' recipe trains better under staleness",
        "stale",
        "bapo_recipe",
        "accuracy_last",
        0.03,
        rho0="recipe",
    ),
)
ALPHA = 0.05
EFFECT = 0.05  # 5 points of held-out accuracy
PLAN = base.Plan(
    task=TASK,
    warm_start=WARM_START,
    run=RUN,
    arms=ARMS,
    cells=CELLS,
    # The pilot (docs/evidence_pilot.md): sd of the paired accuracy differences 0.05 on
    # `stale` and 0.015 on `partial` over 3 seeds each, pooled ~0.037: 10 seeds detect 5
    # points at 80% power at Holm's first-step level (10 seeds: 4.7 points). 10 fit the 3-hour
    # budget with the partial cell's recipe arm left out (no primary reads it): the 120 runs
    # two at a time, by the pilot's and a probe's times (pairs of ~100 s on_policy, ~130 s
    # stale, ~210 s partial, ~195 s fresh_control), take ~2.6 h plus the warm start's 4 min.
    seeds=tuple(range(10)),
    ablations={},
    ablation_cell=None,
    collapse=base.STUDY.collapse,
    # On policy (E = 1, k = 0) every ratio is 1 at its one update, so no bound clips and every
    # arm trains the same policy gradient: one run per seed is the control.
    cell_arms={
        "on_policy": (BASELINE,),
        "partial": (BASELINE, "bapo_paper"),
        "fresh_control": (BASELINE, "bapo_paper"),
    },
)
PILOT = dataclasses.replace(
    PLAN,
    arms={a: ARMS[a] for a in (BASELINE, "bapo_paper")},
    # and the stale cell cut into mini-batches of single rows, as the loop did before (the
    # baseline only: what the gate reads), to show what whole groups change
    cells=(
        *(c for c in CELLS if c.name in ("stale", "partial")),
        dataclasses.replace(STALE, name="stale_rows", minibatch="rows"),
    ),
    cell_arms={"stale_rows": (BASELINE,)},
    seeds=(0, 1, 2),
)
GATE_RHO0 = {"paper": 0.4, "recipe": 0.5}
# Every arm once at toy size (CI: the machinery runs, its numbers match the record for this
# host's CPU class): three numbers (demonstrations fit 64 tokens), 150 supervised steps (some
# rewards are 1), 3 iterations of 8 prompts x 4 samples, E = 4 as 2 epochs x 2 mini-batches
# of whole groups, k = 1. While the warm start trains on one core, the first arm runs from a
# random model on the other to fill the compilation cache (`base.child_compile_warmup`).
QUICK = dataclasses.replace(
    PLAN,
    task=dataclasses.replace(TASK, size=3, n_basic=40, n_target_sft=300, n_eval=32, eval_samples=4),
    warm_start=dataclasses.replace(WARM_START, steps=150, length=64),
    run=base.toy_run(RUN),
    cells=(study.Cell("quick", updates=4, epochs=2, staleness=1),),
    cell_arms={},
    seeds=(0,),
)
# The study's record: the plan and the primaries as pre-registered, each CPU class's quick
# metrics and, once the full study has run, every run's measures and every comparison.
# The pilots' records (the gate at response caps of 64 and 96 tokens; docs/evidence_pilot.md)
PILOT_RECORDS = tuple(
    os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", name)
    for name in ("evidence_pilot.json", "evidence_pilot_cap96.json")
)
FIGURE = "offpolicy_study.png"  # accuracy, entropy, rho and grad norm per cell and arm
RECORD = os.path.join(os.path.dirname(os.path.dirname(__file__)), "docs", "offpolicy_study.json")


def with_cap(plan: base.Plan, cap: int) -> base.Plan:
    """`plan` with responses (and evaluation) capped at `cap` tokens: a longer cap leaves a
    failing search longer to run (a pilot variant for the gate)."""
    t = plan.run.trainer
    trainer = dataclasses.replace(
        t, rollout=dataclasses.replace(t.rollout, max_response_tokens=cap)
    )
    run = dataclasses.replace(
        plan.run, trainer=trainer, eval=dataclasses.replace(plan.run.eval, max_tokens=cap)
    )
    return dataclasses.replace(plan, run=run)


# ---- the gate --------------------------------------------------------------------------------
def gate_numbers(rows: list[dict[str, Any]]) -> dict[str, float]:
    """One run's precondition numbers: iteration 0's batch, and the run's shares of updates
    with rho at r = 1 below each GATE_RHO0 (every iteration takes the same number of updates)."""

    def first(key: str) -> float:
        value = rows[0].get(key)
        return float("nan") if value is None else float(value)

    def mean(key: str) -> float:
        values = [r[key] for r in rows if r.get(key) is not None]
        return float(np.mean(values)) if values else float("nan")

    return {
        "length_ratio_0": first("balance/length_ratio"),
        "rho_r1_0": first("balance/rho_r1"),
        "rho_r1_pi_0": first("balance/rho_r1_pi"),
        "zero_variance_0": first("balance/zero_variance_groups"),
        "length_ratio": mean("balance/length_ratio"),
        "rho_r1": mean("balance/rho_r1"),
        "below_paper": mean("balance/rho_r1_below"),  # a baseline counts against the paper's 0.4
        "below_recipe": mean("balance/rho_r1_below_half"),
        "below_paper_pi": mean("balance/rho_r1_pi_below"),
        "below_recipe_pi": mean("balance/rho_r1_pi_below_half"),
    }


def gate(plan: base.Plan, out_dir: str) -> dict[str, dict[str, Any]]:
    """Per cell: the baseline's gate numbers (mean and every seed's) and whether the
    precondition holds at each GATE_RHO0 (the share of updates below it >= 1/2)."""
    out = {}
    for cell in plan.cells:
        per_seed = [
            gate_numbers(read_rows(os.path.join(out_dir, f"{cell.name}/{BASELINE}/seed{s}")))
            for s in plan.seeds
        ]
        mean = {k: float(np.mean([g[k] for g in per_seed])) for k in per_seed[0]}
        out[cell.name] = {
            "mean": mean,
            "seeds": per_seed,
            "met": {name: mean[f"below_{name}"] >= 0.5 for name in GATE_RHO0},
        }
    return out


def power(plan: base.Plan, results: dict[str, dict]) -> dict[str, dict[str, Any]]:
    """Per cell the pilot's sd of bapo_paper - clip in each primary measure, the effect its
    seeds (and 5) detect at 80% power at Holm's first-step level, and the seeds for EFFECT."""
    alpha = ALPHA / len(PRIMARIES)
    out: dict[str, dict[str, Any]] = {}
    for cell in plan.cells:
        if "bapo_paper" not in plan.arms_of(cell):
            continue
        for measure in sorted({p.measure for p in PRIMARIES}):

            def values(arm: str, cell=cell, measure=measure) -> np.ndarray:
                return np.asarray(
                    [results[f"{cell.name}/{arm}/seed{s}"][measure] for s in plan.seeds]
                )

            interval = stats.paired_interval(values("bapo_paper"), values(BASELINE))
            sd = max(interval.sd, 1e-6)
            out[f"{cell.name}/{measure}"] = {
                "diff": interval.mean_diff,
                "sd": interval.sd,
                "detectable_pilot": stats.detectable_effect(sd, interval.n, alpha),
                "detectable_5": stats.detectable_effect(sd, 5, alpha),
                "seeds_for_effect": stats.seeds_needed(sd, EFFECT, alpha, most=50),
            }
    return out


def pilot_text(gates, powers, *, command: str, wall_s: float, warm: dict) -> str:
    lines = [
        "# Evidence v2: the pilot (precondition gate and power)",
        "",
        f"Produced by `{command}` at commit {commit()} on a `{study.cpu_class()}` CPU in "
        f"{wall_s:.0f} s. Warm start: greedy {warm['accuracy']:.3f}"
        + (
            f", pass@8 {warm['start_eval']['pass@8']:.3f}, distinct correct answers "
            f"{warm['start_eval']['distinct_correct']:.2f} per problem"
            if "start_eval" in warm
            else ""
        )
        + ".",
        "",
        "## The gate",
        "",
    ]
    lines += report.gate_lines(gates)
    lines += [
        "",
        f"## Power (bapo_paper - clip, paired by seed; two-sided, alpha {ALPHA:g} / "
        f"{len(PRIMARIES)} primaries)",
        "",
        "| cell / measure | pilot mean diff | sd of diffs | detectable (pilot seeds) | "
        "detectable (5 seeds) | seeds for 5 points |",
        "|---|---|---|---|---|---|",
    ]
    for key, p in powers.items():
        seeds = p["seeds_for_effect"] if p["seeds_for_effect"] is not None else "> 50"
        lines.append(
            f"| `{key}` | {p['diff']:+.3f} | {p['sd']:.3f} | {p['detectable_pilot']:.3f} | "
            f"{p['detectable_5']:.3f} | {seeds} |"
        )
    return "\n".join(lines) + "\n"


MEASURES = ("accuracy_last", "pass_at_8_last", "distinct_correct_last", "entropy_last")
FACTORIAL = {(0, 0): "clip", (0, 1): "dual_clip", (1, 0): "bapo_paper", (1, 1): "bapo_paper_dual"}


def setup_text(plan: base.Plan) -> str:
    t, task = plan.run.trainer, plan.task
    cells = "; ".join(
        f"`{c.name}` E = {c.updates} ({c.epochs} epoch(s)), k = {c.staleness}"
        + (f", {c.prompts_per_step} prompts x {c.steps} iterations" if c.steps else "")
        + (f", partial rounds of {c.partial_budget} tokens" if c.partial_budget else "")
        + f": {', '.join(plan.arms_of(c))}"
        for c in plan.cells
    )
    return (
        f"Countdown with {task.size} numbers in 1-{task.max_operand} (`tasks.countdown`), "
        f"{task.n_eval} held-out problems: greedy accuracy and pass@{task.eval_samples}; the "
        f"main job's model warm-started by {plan.warm_start.steps} supervised steps. Each run: "
        f"{t.steps} iterations of {t.rollout.prompts_per_step} prompts x "
        f"{t.rollout.samples_per_prompt} samples (<= {t.rollout.max_response_tokens} tokens), "
        f"GRPO, mini-batches of whole groups, AdamW lr {t.optimizer.learning_rate:g}, "
        f"evaluation every {t.eval_every}; seeds {list(plan.seeds)}. Cells: {cells}."
    )


def _exit_on_term(signum, frame):
    raise SystemExit(128 + signum)


def _finished(out_dir: str, spec: study.RunSpec) -> bool:
    """The run has written its DONE marker (`study.run_all` skips it)."""
    return os.path.exists(os.path.join(out_dir, spec.name, study.DONE))


def timed_runs(plan: base.Plan, out_dir: str, workers: int) -> dict[str, dict]:
    """`run_plan`, its wall time added to the study's total (wall.json) with the commit it
    started at, even when it is interrupted (Ctrl-C or SIGTERM; the next invocation resumes):
    the report states the time every invocation spent, runs killed in flight included. An
    invocation that finds every run finished (a report redone) runs nothing and adds nothing."""
    made_at, start = commit(), time.perf_counter()
    pending = not all(_finished(out_dir, spec) for spec in plan.specs())
    previous = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        return base.run_plan(plan, out_dir, workers)
    finally:
        signal.signal(signal.SIGTERM, previous)
        if pending:
            study.add_wall_time(out_dir, time.perf_counter() - start, made_at)


def finished_part(plan: base.Plan, out_dir: str) -> tuple[base.Plan, list[str]]:
    """`plan` cut to the cells whose every run has finished in `out_dir`, and the names of the
    runs still pending (an interim report: `--finished-only`)."""
    specs = plan.specs()
    pending = [s.name for s in specs if not _finished(out_dir, s)]
    cells = tuple(
        c for c in plan.cells if all(_finished(out_dir, s) for s in specs if s.cell.name == c.name)
    )
    arms = {k: v for k, v in plan.cell_arms.items() if k in {c.name for c in cells}}
    return dataclasses.replace(plan, cells=cells, cell_arms=arms), pending


def full_study(
    plan: base.Plan,
    out_dir: str,
    workers: int,
    command: str,
    docs: str | None = None,
    finished_only: bool = False,
) -> str:
    """Runs `plan` and writes report.md and evidence.json (every run's measures, the
    primaries as declared, every comparison, the quick metrics RECORD holds) in `out_dir`,
    and with `docs` also as docs/offpolicy_study.md and .json; returns the report.
    `finished_only`: runs nothing, and reports the cells whose runs have all finished (an
    interim report, which names the runs still pending; the record keeps the whole plan)."""
    declared, pending = plan, []
    if finished_only:
        plan, pending = finished_part(plan, out_dir)
        cells = {c.name for c in plan.cells}
        missing = sorted({p.cell for p in PRIMARIES} - cells)
        if missing:
            raise SystemExit(f"--finished-only: the primaries' cells {missing} have not finished")
        warm = base.ensure_warm_start(plan, out_dir)
        results = {
            s.name: base.measure(plan, s, os.path.join(out_dir, s.name), warm) for s in plan.specs()
        }
    else:
        results = timed_runs(plan, out_dir, workers)
    gates = gate(plan, out_dir)
    claims = report.primaries(
        results, PRIMARIES, plan.seeds, {c: g["met"] for c, g in gates.items()}
    )
    tables = {
        f"`{cell.name}`: {measure}, arm - clip": report.table(
            results, cell.name, list(plan.arms_of(cell)), measure, plan.seeds
        )
        for cell in plan.cells
        if len(plan.arms_of(cell)) > 1
        for measure in MEASURES
    }
    extra = {
        "Adaptive bounds x dual clip on `stale` (accuracy_last)": report.factorial(
            results, "stale", "accuracy_last", plan.seeds, FACTORIAL
        ),
    }
    if "fresh_control" in {c.name for c in plan.cells}:
        extra["Staleness isolated: `stale` - `fresh_control` (accuracy_last)"] = report.staleness(
            results, "stale", "fresh_control", [BASELINE, "bapo_paper"], "accuracy_last", plan.seeds
        )
    warm = base.ensure_warm_start(plan, out_dir)
    study_report.figure(
        results,
        [c.name for c in plan.cells],
        list(plan.arms),
        os.path.join(out_dir, FIGURE),
        "mean over seeds per arm",
    )
    wall = study.read_json(os.path.join(out_dir, "wall.json"))
    made_at = sorted({i["commit"] for i in wall.get("invocations", [])})
    header = (
        f"# The off-policy study: BAPO where its precondition holds\n\nProduced by `{command}` "
        f"on a `{study.cpu_class()}` CPU in {wall['seconds']:.0f} s over "
        f"{max(1, len(wall.get('invocations', [])))} invocation(s) ({len(results)} runs, "
        f"{workers} at a time; runs made at commit {', '.join(made_at) or 'unrecorded'}, "
        f"report at {commit()}). Warm start: greedy {warm['accuracy']:.3f}, "
        + ", ".join(
            f"{k} {v:.3f}" for k, v in warm.get("start_eval", {}).items() if k != "accuracy"
        )
        + "."
    )
    if pending:
        left = sorted({name.split("/")[0] for name in pending})
        header += (
            f"\n\n**An interim report**: {len(results)} of {len(declared.specs())} runs; the "
            f"{len(pending)} runs of {', '.join(f'`{c}`' for c in left)} have not finished, so "
            "the tables that need them are left out. The claims' primaries are all here."
        )
    text = report.render(
        header=header,
        setup=setup_text(declared),
        gates=gates,
        claims=claims,
        tables=tables,
        extra=extra,
        collapse_counts=report.collapses(results, "on_policy", BASELINE, plan.seeds),
        mechanism=report.mechanism_means(results, plan.seeds),
        seeds=plan.seeds,
        curve_by_run=report.curves(
            results, (warm["accuracy"], warm.get("start_eval", {}).get("pass@8"))
        ),
        rho0=GATE_RHO0,
        figure_name=FIGURE,
        tried=[study.read_json(p) for p in PILOT_RECORDS if os.path.exists(p)],
    )
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    record = {
        "commit": commit(),
        "command": command,
        "wall_s": round(wall["seconds"]),
        "invocations": wall.get("invocations", []),
        "plan": base.plan_record(declared),
        "pending": pending,
        "primaries": [dataclasses.asdict(p) for p in PRIMARIES],
        "claims": claims,
        "gate": gates,
        "comparisons": {**tables, **extra},
        "runs": {k: {m: v for m, v in r.items() if m != "series"} for k, r in results.items()},
        "quick": study.read_json(RECORD)["quick"] if os.path.exists(RECORD) else {},
    }
    study.write_json(os.path.join(out_dir, "evidence.json"), record)
    if docs is not None:
        with open(os.path.join(docs, "offpolicy_study.md"), "w", encoding="utf-8") as f:
            f.write(text)
        study.write_json(os.path.join(docs, "offpolicy_study.json"), record)
        shutil.copyfile(os.path.join(out_dir, FIGURE), os.path.join(docs, FIGURE))
    return text


def quick(args: argparse.Namespace) -> int:
    """Every arm once at toy size; with --check, 1 when the plan or the metrics differ from
    the record; with --record, this CPU class's metrics into it (refused on a changed plan)."""
    results = base.run_plan(QUICK, args.out_dir, args.workers, compile_warmup=True)
    metrics, cpu = base.quick_metrics(results), study.cpu_class()
    for name, m in metrics.items():
        print(name, m)
    problems, notes = [], []
    if args.check:
        problems, notes = base.check(args.check, metrics, cpu, PLAN, "experiments.evidence_study")
    if args.record and not problems:
        problems += base.record_quick(args.record, metrics, cpu, PLAN)
    for line in notes:
        print(f"note: {line}", file=sys.stderr)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    return 1 if problems else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--pilot", action="store_true", help="the gate and power pilot")
    ap.add_argument("--cap", type=int, default=CAP, help="response cap (a pilot variant)")
    ap.add_argument("--cells", default=None, help="with --pilot: only these cells (a,b)")
    ap.add_argument("--docs", default=None, help="also write the report and record there")
    ap.add_argument(
        "--finished-only",
        action="store_true",
        help="run nothing: an interim report of the cells whose runs have all finished",
    )
    ap.add_argument("--quick", action="store_true", help="every arm once at toy size (CI)")
    ap.add_argument("--check", default=None, help="with --quick: the record to compare with")
    ap.add_argument("--record", default=None, help="with --quick: add this CPU class's metrics")
    args = ap.parse_args()
    start = time.perf_counter()
    command = "python -m experiments.evidence_study " + " ".join(sys.argv[1:])
    if args.quick:
        raise SystemExit(quick(args))
    if not args.pilot:
        plan = with_cap(PLAN, args.cap)
        print(full_study(plan, args.out_dir, args.workers, command, args.docs, args.finished_only))
        return
    pilot = with_cap(PILOT, args.cap)
    if args.cells:
        names = args.cells.split(",")
        unknown = set(names) - {c.name for c in pilot.cells}
        if unknown:
            ap.error(f"--cells: unknown cells {sorted(unknown)}")
        cells = tuple(c for c in pilot.cells if c.name in names)
        arms = {k: v for k, v in pilot.cell_arms.items() if k in names}
        pilot = dataclasses.replace(pilot, cells=cells, cell_arms=arms)
    results = base.run_plan(pilot, args.out_dir, args.workers)
    gates, powers = gate(pilot, args.out_dir), power(pilot, results)
    warm = base.ensure_warm_start(pilot, args.out_dir)
    wall = study.add_wall_time(args.out_dir, time.perf_counter() - start)
    text = pilot_text(gates, powers, command=command, wall_s=wall, warm=warm)
    with open(os.path.join(args.out_dir, "pilot.md"), "w", encoding="utf-8") as f:
        f.write(text)
    record = {"commit": commit(), "command": command, "gate": gates, "power": powers}
    record["runs"] = {k: {m: v for m, v in r.items() if m != "series"} for k, r in results.items()}
    study.write_json(os.path.join(args.out_dir, "pilot.json"), record)
    print(text)


if __name__ == "__main__":
    main()
