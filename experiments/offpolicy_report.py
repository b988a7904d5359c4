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
    date: str,
    cpu: str,
    wall_s: float,
    setup: str,
) -> str:
    """The search for the hard regime: what was run and its table. A regime's name says its
    warm-start steps (w), updates per batch (E), staleness (k) and learning rate."""
    warm = ", ".join(f"{steps} steps: {acc:.3f}" for steps, acc in sorted(warm_accuracy.items()))
    return (
        "## How the hard regime was found\n\n"
        f"`{command}` at commit {commit} on {date}, on a 2-core `{cpu}` CPU: {len(results)} "
        "runs of "
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
    """The paper's claims as paired tests here: (claims table, comparisons section, the
    BAPO-vs-baseline end-accuracy comparisons)."""
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
    return "\n".join(table), "".join(sections), accuracy


def _mean(results: Mapping[str, dict], cell: str, arm: str, measure: str) -> float | None:
    iv = report.interval(results, cell, arm, measure)
    return None if iv is None else iv.mean


def _passed(comparisons: Sequence[report.Comparison]):
    """(the comparisons with Holm p < ALPHA, the one with the smallest Holm p)."""
    passed = [c for c in comparisons if c.holm_p < report.ALPHA]
    return passed, min(comparisons, key=lambda c: c.holm_p)


def findings(
    results: Mapping[str, dict],
    *,
    cells: Sequence[str],
    arms: Sequence[str],
    baselines: Sequence[str],
    dual_clip_arms: Sequence[str],
    start_bounds: tuple[float, float],
    rho0: float,
    accuracy: Sequence[report.Comparison],
    ablation: Sequence[report.Comparison],
) -> str:
    """What the tables say, as bullets: every number is a mean (or a Holm p) that a table of
    the report shows with the same rounding, and each reading is written only when the numbers
    it rests on hold."""
    control, off_policy, hardest = cells[0], list(cells[1:]), cells[-1]
    bapo = [a for a in PAPER_ARMS if a in arms]

    def m(cell, arm, measure):
        return _mean(results, cell, arm, measure)

    out = []
    for arm in baselines:
        ends = ", ".join(f"{m(c, arm, 'accuracy_last'):.3f} at `{c}`" for c in off_policy)
        out.append(f"`{arm}` ends at {m(control, arm, 'accuracy_last'):.3f} on-policy, {ends}.")
    if accuracy:
        passed, best = _passed(accuracy)
        out.append(
            f"Off-policy, {len(passed)} of the {len(accuracy)} BAPO-minus-baseline differences "
            f"in end accuracy pass Holm p < {report.ALPHA:g}"
            + (
                ": " + ", ".join(f"{c.label} ({c.test.mean_diff:+.4f})" for c in passed) + "."
                if passed
                else f"; the smallest Holm p is {best.holm_p:.4f} ({best.label}, "
                f"{best.test.mean_diff:+.4f})."
            )
        )
    moved = {
        (c, a): (m(c, a, "c_low"), m(c, a, "c_high"), m(c, a, "rho_before"), m(c, a, "rho_after"))
        for c in off_policy
        for a in bapo
    }
    if moved and all(None not in v for v in moved.values()):
        shift = max(abs(v[3] - v[2]) for v in moved.values())
        low, high = start_bounds
        bounds = "; ".join(
            f"{a} c_low {moved[hardest, a][0]:.3f}, c_high {moved[hardest, a][1]:.3f}" for a in bapo
        )
        outside = max(
            m(c, a, "clip_low_frac") + m(c, a, "clip_high_frac") for c in cells for a in arms
        )
        text = (
            f"BAPO's search moves the bounds off their start ({low:g}, {high:g}) on average "
            f"(`{hardest}`: {bounds}); its mean rho after the search differs from before it by "
            f"at most {shift:.3f} in any off-policy cell."
        )
        if shift < 0.01:
            text += (
                f" At most {outside:.2%} of the tokens (clip low + clip high) lie beyond the "
                "bounds of any arm in any cell, so moving the bounds shifts little weight "
                "between P and N."
            )
        out.append(text)
    fixed = [m(c, a, "rho_after") for c in cells for a in baselines]
    if None not in fixed:
        lowest = min(cells, key=lambda c: min(m(c, a, "rho_after") for a in baselines))
        out.append(
            f"The fixed-clip arms' rho lies between {min(fixed):.3f} and {max(fixed):.3f} "
            f"(lowest at `{lowest}`): GRPO's advantages sum to zero within each group and the "
            "responses have near-equal lengths, so P and N stay close. The regime BAPO is built "
            f"for, negative tokens outweighing positive ones (rho below the paper's rho0 "
            f"{rho0:g}), "
            + ("does not arise on average here." if min(fixed) >= rho0 else "arises.")
        )
    entropy_hard = [m(hardest, a, "entropy_last") for a in arms]
    entropy_control = max(m(control, a, "entropy_last") for a in arms)
    accuracy_drops = all(
        m(hardest, a, "accuracy_last") < m(control, a, "accuracy_last") for a in arms
    )
    if min(entropy_hard) > entropy_control and accuracy_drops:
        out.append(
            f"At `{hardest}` every arm's entropy ({min(entropy_hard):.4f} to "
            f"{max(entropy_hard):.4f}) ends above the on-policy {entropy_control:.4f}: the "
            "failure here is a loss of accuracy with rising entropy, not the paper's entropy "
            "collapse."
        )
    spikes = {a: max(m(c, a, "grad_spikes") for c in cells) for a in arms}
    others = [a for a in arms if a not in dual_clip_arms]
    if dual_clip_arms and max(spikes[a] for a in dual_clip_arms) == 0 and others:
        worst = max(others, key=spikes.get)
        text = (
            f"The arms with a dual clip ({', '.join(dual_clip_arms)}) have no gradient-norm "
            f"spike in any cell; the others up to {spikes[worst]:.1f} per run ({worst})"
        )
        if spikes.get("bapo_paper", 0) > 0:
            if worst != "bapo_paper":
                text += f", `bapo_paper` up to {spikes['bapo_paper']:.1f}"
            text += (
                ": the spikes go with the absence of a dual clip, not with fixed or adaptive "
                "bounds."
            )
        else:
            text += "; `bapo_paper` has none either."
        out.append(text)
    if ablation:
        passed, best = _passed(ablation)
        out.append(
            f"Ablations: {len(passed)} of the {len(ablation)} differ from the paper "
            f"configuration in end accuracy at Holm p < {report.ALPHA:g} (smallest Holm p "
            f"{best.holm_p:.4f}, {best.label}, {best.test.mean_diff:+.4f})."
        )
    return "\n".join(f"- {line}" for line in out)


def render(
    *,
    plan_text: str,
    command: str,
    commit: str,
    date: str,
    wall_s: float,
    workers: int,
    warm_accuracy: float,
    results: Mapping[str, dict],
    cells: Sequence[str],
    arms: Sequence[str],
    baselines: Sequence[str],
    ablations: Sequence[str],
    ablation_cell: str,
    dual_clip_arms: Sequence[str],
    start_bounds: tuple[float, float],
    rho0: float,
    exploration: str | None,
    quick: Mapping[str, dict],
    cpu: str,
    figure_name: str,
) -> str:
    control, off_policy, hardest = cells[0], list(cells[1:]), cells[-1]
    claims_table, comparisons, accuracy = claims(results, control, off_policy, hardest, baselines)
    ablation = report.compare(
        results,
        [(ablation_cell, a, ablation_cell, "bapo_paper") for a in ablations],
        "accuracy_last",
    )
    reading = findings(
        results,
        cells=cells,
        arms=arms,
        baselines=baselines,
        dual_clip_arms=dual_clip_arms,
        start_bounds=start_bounds,
        rho0=rho0,
        accuracy=accuracy,
        ablation=ablation,
    )
    parts = [
        "# Off-policy study: fixed clipping vs BAPO on the CPU arithmetic task\n\n",
        f"Produced by `{command}` at commit {commit} on {date}, on a 2-core `{cpu}` CPU, in "
        f"{wall_s:.0f} s of "
        "wall time (every invocation's, the quick runs' included) "
        f"({len(results)} runs, {workers} at a time, each on one core). Warm start held-out "
        f"greedy accuracy {warm_accuracy:.3f}.\n\n",
        "## Setup\n\n",
        plan_text,
        "\n\n## Claims\n\n",
        claims_table,
        "\n\n## What the tables say\n\n",
        reading,
        "\n\n",
        f"![accuracy, entropy, rho and grad norm per cell]({figure_name})\n\n",
    ]
    for cell in cells:
        parts += [f"## Cell `{cell}`\n\n", report.summary_table(results, cell, arms), "\n\n"]
    parts += ["## Comparisons (paired by seed)\n\n", comparisons]
    if ablations:
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
        f"On this host's CPU class, `{cpu}` (`study.cpu_class`: XLA's CPU kernels, and so the\n"
        "fp32 trajectories, differ between instruction sets); offpolicy_study_v1.json keeps one\n"
        "record per class and CI compares its host's.\n\n",
        "```json\n",
        json.dumps(quick, indent=1, sort_keys=True),
        "\n```\n",
    ]
    return "".join(parts)
