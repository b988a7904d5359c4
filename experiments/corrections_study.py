"""The off-policy corrections and losses compared on the CPU task, in a stale partial-rollout
regime, paired by seed against fixed clipping.

    python -m experiments.corrections_study --out-dir runs/corrections [--workers 2]

The off-policy study's machinery (`experiments.offpolicy_study`: one warm start, each run a
single-threaded child pinned to a core, finished runs read back) on one regime: E = 8 updates
per rollout batch, rollouts k = 2 versions behind, partial rollouts of 8-token rounds (a
response's early tokens can be older still), the main job's learning rate, 30 iterations,
held-out greedy evaluation every 10. Arms (the loss section, plus the off-policy setting an arm
needs):

    clip           PPO clip [0.8, 1.2]: fixed clipping, the baseline of every comparison
    bapo           BAPO as the paper configures it (rho0 0.4, c_low 0.6-0.9, c_high 1.2-3.0)
    bapo_lags4     staleness-aware BAPO: one search per lag bucket (lags 0, 1, 2, >= 3; at
                   k = 2 no token is fresher than lag 2, so the buckets that hold tokens are
                   2 and >= 3)
    bapo_gap3      BAPO, tokens more than 3 versions old out of the loss (max_version_gap 3;
                   at k = 2 a gap below 2 would mask every token)
    bapo_is_mask   BAPO on a recomputed pi_old, tokens whose pi_old / pi_behaviour leaves
                   [0.5, 2] masked (token-level masked importance sampling)
    gspo, cispo, kl_cov   the baselines at their papers' defaults (docs/algorithms.md)

For each arm and measure (held-out accuracy at the end, the best, entropy over the last quarter
of iterations): the mean over seeds of (arm - clip), its paired-t 95% interval, the paired
t-test's p and Holm's adjustment over the arms (the table's family). Writes <out>/report.md and
<out>/corrections.json (every seed's values, to recompute each interval).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

import numpy as np

from bapo_jax.algorithms.losses import PPOClipConfig
from bapo_jax.tasks import study
from bapo_jax.tasks import study_stats as stats
from bapo_jax.train.config import AlgorithmConfig
from experiments import offpolicy_study as base
from experiments.records import commit

ARMS = {
    "clip": AlgorithmConfig(loss="ppo_clip", ppo_clip=PPOClipConfig(epsilon=0.2)),
    "bapo": AlgorithmConfig(loss="bapo", bapo=base.PAPER_BAPO),
    "bapo_lags4": AlgorithmConfig(
        loss="bapo", bapo=dataclasses.replace(base.PAPER_BAPO, lag_buckets=4)
    ),
    "bapo_gap3": AlgorithmConfig(loss="bapo", bapo=base.PAPER_BAPO),
    "bapo_is_mask": AlgorithmConfig(
        loss="bapo",
        ratio_base="recomputed",
        bapo=dataclasses.replace(base.PAPER_BAPO, is_mode="token_mask"),
    ),
    "gspo": AlgorithmConfig(loss="gspo"),
    "cispo": AlgorithmConfig(loss="cispo"),
    "kl_cov": AlgorithmConfig(loss="kl_cov"),
}
ARM_OFFPOLICY = {"bapo_gap3": {"max_version_gap": 3}}
BASELINE = "clip"
PARTIAL_BUDGET = 8
MEASURES = ("accuracy_last", "accuracy_best", "entropy_last")


@dataclasses.dataclass(frozen=True)
class CorrectionsPlan(base.Plan):
    """The off-policy study's plan with partial rollouts and per-arm off-policy settings."""

    partial_budget: int = PARTIAL_BUDGET
    arm_offpolicy: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def config(self, spec: study.RunSpec, hf_dir: str):
        config = super().config(spec, hf_dir)
        offpolicy = dataclasses.replace(
            config.trainer.offpolicy,
            partial_budget=self.partial_budget,
            **self.arm_offpolicy.get(spec.arm, {}),
        )
        trainer = dataclasses.replace(config.trainer, offpolicy=offpolicy)
        return dataclasses.replace(config, trainer=trainer)


PLAN = CorrectionsPlan(
    task=base.STUDY.task,
    warm_start=base.STUDY.warm_start,
    run=dataclasses.replace(
        base.STUDY_RUN, trainer=dataclasses.replace(base.STUDY_TRAINER, steps=30, eval_every=10)
    ),
    arms=ARMS,
    cells=(study.Cell("stale_partial", updates=8, staleness=2),),
    seeds=(0, 1, 2, 3, 4),
    ablations={},
    ablation_cell=None,
    collapse=base.STUDY.collapse,
    minibatch=base.STUDY.minibatch,  # as docs/corrections_study.json was made
    arm_offpolicy=ARM_OFFPOLICY,
)


def compare(results: dict[str, dict], plan: CorrectionsPlan) -> dict[str, dict[str, dict]]:
    """measure -> arm -> {mean, diff, low, high, p, p_holm, values}, arm - clip by seed."""
    cell = plan.cells[0].name
    table: dict[str, dict[str, dict]] = {}
    for key in MEASURES:

        def values(arm: str, key=key) -> np.ndarray:
            return np.asarray([results[f"{cell}/{arm}/seed{s}"][key] for s in plan.seeds])

        rows = {}
        for arm in plan.arms:
            row: dict[str, Any] = {"mean": float(values(arm).mean()), "values": values(arm)}
            if arm != BASELINE:
                diffs = values(arm) - values(BASELINE)
                test = stats.paired_t_test(values(arm), values(BASELINE))
                interval = stats.paired_interval(values(arm), values(BASELINE))
                low, high = interval.low, interval.high
                row.update(diff=float(diffs.mean()), low=low, high=high, p=test.p)
            rows[arm] = row
        others = [a for a in plan.arms if a != BASELINE]
        for arm, adjusted in zip(others, stats.holm([rows[a]["p"] for a in others]), strict=True):
            rows[arm]["p_holm"] = adjusted
        table[key] = rows
    return table


def report_text(table, plan: CorrectionsPlan, *, command: str, wall_s: float) -> str:
    t = plan.run.trainer
    cell = plan.cells[0]
    lines = [
        "# Off-policy corrections compared (CPU task, stale partial rollouts)",
        "",
        f"Produced by `{command}` at commit {commit()} on a `{study.cpu_class()}` CPU in "
        f"{wall_s:.0f} s of wall time ({len(plan.specs())} runs, 2 at a time).",
        "",
        f"Regime: E = {cell.updates} updates per rollout batch, rollouts k = {cell.staleness} "
        f"versions behind, partial rollouts of {plan.partial_budget}-token rounds; {t.steps} "
        f"iterations of {t.rollout.prompts_per_step} prompts x {t.rollout.samples_per_prompt} "
        f"samples, lr {t.optimizer.learning_rate:g}; seeds {list(plan.seeds)}. Differences are "
        f"arm - `{BASELINE}` paired by seed; 95% paired-t intervals; p: two-sided paired t; "
        "Holm over the arms of each table.",
    ]
    for key in MEASURES:
        lines += ["", f"## {key}", "", "| arm | mean | arm - clip | 95% interval | p | Holm p |",
                  "|---|---|---|---|---|---|"]  # fmt: skip
        for arm, row in table[key].items():
            if arm == BASELINE:
                lines.append(f"| `{arm}` | {row['mean']:.3f} | (baseline) | | | |")
                continue
            lines.append(
                f"| `{arm}` | {row['mean']:.3f} | {row['diff']:+.3f} | "
                f"[{row['low']:+.3f}, {row['high']:+.3f}] | {row['p']:.3f} | {row['p_holm']:.3f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", required=True)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    start = time.perf_counter()
    results = base.run_plan(PLAN, args.out_dir, args.workers)
    table = compare(results, PLAN)
    command = "python -m experiments.corrections_study " + " ".join(sys.argv[1:])
    wall = study.add_wall_time(args.out_dir, time.perf_counter() - start)
    text = report_text(table, PLAN, command=command, wall_s=wall)
    with open(os.path.join(args.out_dir, "report.md"), "w", encoding="utf-8") as f:
        f.write(text)
    record = {
        key: {arm: {k: (v.tolist() if isinstance(v, np.ndarray) else v) for k, v in row.items()}
              for arm, row in rows.items()}
        for key, rows in table.items()
    }  # fmt: skip
    study.write_json(os.path.join(args.out_dir, "corrections.json"), record)
    print(text)


if __name__ == "__main__":
    main()
