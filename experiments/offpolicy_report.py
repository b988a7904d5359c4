"""The off-policy study's report: setup, per-cell tables, paired comparisons, claims.

Every number in the prose this module writes comes from the tables next to it; verdicts are
computed (`tasks.study_report.verdict`), not written by hand.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from bapo_jax.tasks import study_report as report

PAPER_ARMS = ("bapo_paper", "bapo_code")


def _pairs(cells: Sequence[str], arms: Sequence[str], baselines: Sequence[str]):
    return [(c, a, c, b) for c in cells for a in arms for b in baselines]


def exploration_table(results: Mapping[str, dict]) -> str:
    """Per explored regime and arm: mean over seeds of the end accuracy, entropy and spikes."""
    keys = sorted({report.split_name(n)[:2] for n in results})
    lines = [
        "| regime | arm | seeds | held-out acc (end) | best acc | entropy (last quarter) | "
        "grad spikes | collapses |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for cell, arm in keys:
        runs = [m for n, m in results.items() if report.split_name(n)[:2] == (cell, arm)]

        def mean(key, runs=runs):
            return sum(m[key] for m in runs) / len(runs)

        lines.append(
            f"| {cell} | {arm} | {len(runs)} | {mean('accuracy_last'):.3f} | "
            f"{mean('accuracy_best'):.3f} | {mean('entropy_last'):.4f} | "
            f"{mean('grad_spikes'):.1f} | {mean('collapses'):.1f} |"
        )
    return "\n".join(lines)


def exploration_report(
    results: Mapping[str, dict],
    warm_accuracy: Mapping[int, float],
    *,
    command: str,
    commit: str,
    wall_s: float,
    setup: str,
) -> str:
    """The search for the hard regime: what was run and its table. A regime's name says its
    warm-start steps (w), updates per batch (E), staleness (k) and learning rate."""
    warm = ", ".join(f"{steps} steps: {acc:.3f}" for steps, acc in sorted(warm_accuracy.items()))
    return (
        "## How the hard regime was found\n\n"
        f"`{command}` at commit {commit} on this 2-core CPU: {len(results)} runs of "
        f"{sum(m['wall_s'] for m in results.values()) / 60:.0f} minutes in all, 2 at a time "
        f"(the last invocation took {wall_s:.0f} s; finished runs are not run again). Each "
        "regime is run with fixed clip and BAPO (paper configuration), 2 seeds; a "
        "regime's name gives the warm start's supervised steps (w: fewer steps, a weaker "
        "start), E, k and the learning rate. Warm-start held-out accuracy by steps: "
        f"{warm}. Otherwise as the study (the warm start and learning rate as the regime says):"
        f"\n\n{setup}\n\n" + exploration_table(results) + "\n"
    )


def claims(
    results: Mapping[str, dict], control: str, off_policy: Sequence[str], hardest: str, baselines
) -> tuple[str, str]:
    """The paper's claims as paired tests here: (claims table, comparisons section)."""
    degrade = report.compare(
        results, [(hardest, b, control, b) for b in baselines], "accuracy_last"
    )
    accuracy = report.compare(results, _pairs(off_policy, PAPER_ARMS, baselines), "accuracy_last")
    entropy = report.compare(results, _pairs(off_policy, PAPER_ARMS, baselines), "entropy_last")
    spikes = report.compare(results, _pairs(off_policy, PAPER_ARMS, baselines), "grad_spikes")
    rho = report.compare(results, _pairs(off_policy, PAPER_ARMS, baselines), "rho_after")
    rows = [
        (
            "Fixed clipping degrades as the data gets staler (end accuracy, hardest cell minus "
            "on-policy, per baseline)",
            report.verdict(degrade, -1),
            degrade,
        ),
        (
            "BAPO ends more accurate than fixed-clip baselines off-policy",
            report.verdict(accuracy, +1),
            accuracy,
        ),
        (
            "BAPO keeps entropy higher (no entropy collapse) off-policy",
            report.verdict(entropy, +1),
            entropy,
        ),
        (
            "BAPO raises the positive tokens' contribution rho above the baselines'",
            report.verdict(rho, +1),
            rho,
        ),
        ("BAPO has fewer gradient-norm spikes", report.verdict(spikes, -1), spikes),
    ]
    table = ["| claim (paper) | comparisons | verdict here |", "|---|---|---|"]
    table += [f"| {claim} | {len(c)} | {v} |" for claim, v, c in rows]
    sections = []
    for claim, _, found in rows:
        sections.append(f"**{claim}** (Holm across these {len(found)}):\n\n")
        sections.append(report.comparison_table(found) + "\n\n")
    return "\n".join(table), "".join(sections)


def render(
    *,
    plan_text: str,
    command: str,
    commit: str,
    wall_s: float,
    workers: int,
    warm_accuracy: float,
    results: Mapping[str, dict],
    cells: Sequence[str],
    arms: Sequence[str],
    baselines: Sequence[str],
    ablations: Sequence[str],
    ablation_cell: str,
    exploration: str | None,
    quick: Mapping[str, dict],
    figure_name: str,
) -> str:
    control, off_policy, hardest = cells[0], list(cells[1:]), cells[-1]
    claims_table, comparisons = claims(results, control, off_policy, hardest, baselines)
    parts = [
        "# Off-policy study: fixed clipping vs BAPO on the CPU arithmetic task\n\n",
        f"Produced by `{command}` at commit {commit} on this 2-core CPU in {wall_s:.0f} s of "
        "wall time (every invocation's, the quick runs' included) "
        f"({len(results)} runs, {workers} at a time, each on one core). Warm start held-out "
        f"greedy accuracy {warm_accuracy:.3f}.\n\n",
        "## Setup\n\n",
        plan_text,
        "\n\n## Claims\n\n",
        claims_table,
        "\n\n",
        f"![accuracy, entropy, rho and grad norm per cell]({figure_name})\n\n",
    ]
    for cell in cells:
        parts += [f"## Cell `{cell}`\n\n", report.summary_table(results, cell, arms), "\n\n"]
    parts += ["## Comparisons (paired by seed)\n\n", comparisons]
    if ablations:
        ablation = report.compare(
            results,
            [(ablation_cell, a, ablation_cell, "bapo_paper") for a in ablations],
            "accuracy_last",
        )
        parts += [
            f"## Ablations of BAPO (paper configuration) on `{ablation_cell}`\n\n",
            report.summary_table(results, ablation_cell, ["bapo_paper", *ablations]),
            "\n\n",
            report.comparison_table(ablation),
            "\n\n",
        ]
    if exploration:
        parts += [exploration, "\n"]
    parts += [
        "## Quick-mode metrics (CI compares them and the configuration with this code)\n\n",
        "```json\n",
        json.dumps(quick, indent=1, sort_keys=True),
        "\n```\n",
    ]
    return "".join(parts)
