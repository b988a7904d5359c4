"""The study v2's statistics and verdicts, from every run's measures (`study.measures`).

Every comparison is arm - baseline paired by seed (same prompt order and sampling seed): the
mean difference, its paired t 95% interval, the two-sided paired t-test's p, Holm's adjustment
over the declared family, TOST within the pre-registered margin, and the effect the design
detects with 80% power. A claim's verdict comes from its one pre-registered primary:

    supported     Holm p < alpha and the difference in BAPO's favour
    refuted       Holm p < alpha against BAPO, or equivalent (TOST p < alpha) where the
                  precondition gate is met for the arm's rho0
    undetermined  otherwise, with the effect the seeds could have detected

Also: the factorial reading on `stale` (adaptive bounds x dual clip: main effects and the
interaction, per seed), staleness isolated (stale - fresh_control, per arm, and BAPO's minus
clip's), and collapses counted against the on-policy control of the same seed (an end accuracy
10 or more points below it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from bapo_jax.tasks import study_stats as stats

ALPHA = 0.05
COLLAPSE_DROP = 0.10  # points of end accuracy below the on-policy control, same seed


@dataclasses.dataclass(frozen=True)
class Primary:
    """One claim's pre-registered comparison: `arm` - `baseline` in `measure` on `cell`,
    higher is BAPO's favour; `margin`: the TOST equivalence margin; `rho0`: the gate it needs."""

    claim: str
    cell: str
    arm: str
    measure: str
    margin: float
    rho0: str = "paper"
    baseline: str = "clip"


def values(results: dict[str, dict], cell: str, arm: str, measure: str, seeds) -> np.ndarray:
    return np.asarray([results[f"{cell}/{arm}/seed{s}"][measure] for s in seeds], dtype=np.float64)


def compare(
    a: np.ndarray, b: np.ndarray, margin: float | None = None, alpha: float = ALPHA
) -> dict[str, Any]:
    """a - b paired: mean, interval, p, TOST p (with a margin), sd, and the effect detected
    with 80% power by a two-sided test at `alpha` (a family's: Holm's first step)."""
    interval = stats.paired_interval(a, b)
    test = stats.paired_t_test(a, b)
    sd = interval.sd
    out = {
        "diff": interval.mean_diff,
        "low": interval.low,
        "high": interval.high,
        "p": test.p,
        "sd": sd,
        "n": interval.n,
        "detectable": stats.detectable_effect(sd, interval.n, alpha) if sd > 0 else 0.0,
        "a": a.tolist(),
        "b": b.tolist(),
    }
    if margin is not None:
        out["tost_p"] = stats.tost(a, b, margin)
    return out


def primaries(
    results: dict[str, dict], declared: Sequence[Primary], seeds, gate_met: dict[str, dict]
) -> list[dict[str, Any]]:
    """Each primary's comparison, Holm over the primaries (the difference tests, and the TOST
    tests as a family of their own), and its verdict."""
    rows = []
    for p in declared:
        a = values(results, p.cell, p.arm, p.measure, seeds)
        b = values(results, p.cell, p.baseline, p.measure, seeds)
        rows.append({**dataclasses.asdict(p), **compare(a, b, p.margin, ALPHA / len(declared))})
    holm = stats.holm([r["p"] for r in rows])
    tost_holm = stats.holm([r["tost_p"] for r in rows])
    for row, adjusted, tost_adjusted in zip(rows, holm, tost_holm, strict=True):
        row["p_holm"] = adjusted
        row["tost_p_holm"] = tost_adjusted
        met = bool(gate_met.get(row["cell"], {}).get(row["rho0"], False))
        row["gate_met"] = met
        row["verdict"] = verdict(row, met)
    return rows


def verdict(row: dict[str, Any], gate_met: bool) -> str:
    if row["p_holm"] < ALPHA:
        return "supported" if row["diff"] > 0 else "refuted"
    if gate_met and row["tost_p_holm"] < ALPHA:
        return "refuted"
    return f"undetermined (detectable: {row['detectable']:.3f})"


def table(
    results: dict[str, dict], cell: str, arms: Sequence[str], measure: str, seeds, baseline="clip"
) -> dict[str, dict[str, Any]]:
    """Every arm of `cell` against the baseline in `measure`, Holm over the arms (a family)."""
    others = [arm for arm in arms if arm != baseline]
    out = {
        arm: compare(
            values(results, cell, arm, measure, seeds),
            values(results, cell, baseline, measure, seeds),
            alpha=ALPHA / len(others),
        )
        for arm in others
    }
    for arm, adjusted in zip(out, stats.holm([r["p"] for r in out.values()]), strict=True):
        out[arm]["p_holm"] = adjusted
    return out


def factorial(
    results: dict[str, dict], cell: str, measure: str, seeds, arms: dict[tuple[int, int], str]
) -> dict[str, dict[str, Any]]:
    """The 2 x 2 of adaptive bounds x dual clip, `arms[(adaptive, dual)]`: per seed the main
    effects (mean of the two simple effects) and the interaction (difference of them), each
    tested against 0."""
    v = {k: values(results, cell, arm, measure, seeds) for k, arm in arms.items()}
    effects = {
        "adaptive": ((v[1, 0] - v[0, 0]) + (v[1, 1] - v[0, 1])) / 2,
        "dual_clip": ((v[0, 1] - v[0, 0]) + (v[1, 1] - v[1, 0])) / 2,
        "interaction": (v[1, 1] - v[0, 1]) - (v[1, 0] - v[0, 0]),
    }
    zero = np.zeros(len(seeds))
    return {name: compare(e, zero) for name, e in effects.items()}


def staleness(
    results: dict[str, dict], stale: str, fresh: str, arms: Sequence[str], measure: str, seeds
) -> dict[str, dict[str, Any]]:
    """stale - fresh per arm (the cost of staleness at the same updates), and the difference of
    each arm's cost from the first arm's (the baseline's)."""
    cost = {
        a: values(results, stale, a, measure, seeds) - values(results, fresh, a, measure, seeds)
        for a in arms
    }
    zero = np.zeros(len(seeds))
    out = {f"{a}: stale - fresh": compare(c, zero) for a, c in cost.items()}
    for a in arms[1:]:
        out[f"{a} - {arms[0]}: cost difference"] = compare(cost[a], cost[arms[0]])
    return out


def collapses(
    results: dict[str, dict], control_cell: str, control_arm: str, seeds
) -> dict[str, int]:
    """Per cell/arm, the seeds whose end accuracy is COLLAPSE_DROP or more below the on-policy
    control's of the same seed."""
    control = {s: results[f"{control_cell}/{control_arm}/seed{s}"]["accuracy_last"] for s in seeds}
    counts: dict[str, int] = {}
    for name, m in results.items():
        cell, arm, seed = name.split("/")
        s = int(seed.removeprefix("seed"))
        if s in control and cell != control_cell:
            key = f"{cell}/{arm}"
            dropped = m["accuracy_last"] <= control[s] - COLLAPSE_DROP + 1e-12
            counts[key] = counts.get(key, 0) + int(dropped)
    return counts


# ---- the report's text --------------------------------------------------------------------------
def _row(name: str, c: dict[str, Any]) -> str:
    holm = f" | {c['p_holm']:.3f}" if "p_holm" in c else " |"
    return (
        f"| {name} | {c['diff']:+.3f} | [{c['low']:+.3f}, {c['high']:+.3f}] | {c['p']:.3f}"
        f"{holm} | {c['detectable']:.3f} |"
    )


COMPARISON_HEADER = [
    "| comparison | mean diff | 95% interval | p | Holm p | detectable (80%) |",
    "|---|---|---|---|---|---|",
]
MECHANISM = (
    "rho_r1",
    "rho_before",
    "rho_after",
    "reached",
    "c_low",
    "c_high",
    "clip_low_frac",
    "clip_high_frac",
    "length_pos",
    "length_neg",
    "lag_pos",
    "lag_neg",
    "grad_norm_median",
    "grad_norm_clipped",
    "grad_share_neg",
    "entropy_last",
)


def gate_lines(gates: dict[str, dict[str, Any]]) -> list[str]:
    """The gate's table: per cell the baseline's numbers (mean over seeds) and the verdicts."""
    lines = [
        "Baseline `clip`, mean over seeds: iteration 0 is the warm start's batch; the shares are "
        "of the run's updates whose rho at r = 1 is below 0.4 (the paper's rho0) and 1/2 (the "
        "recipe's P / N >= 1). A cell tests BAPO's mechanism at a rho0 where the share is >= 1/2.",
        "",
        "| cell | length ratio (it. 0) | rho r=1 (it. 0) | rho r=1, pi-weighted (it. 0) | "
        "zero-variance groups (it. 0) | length ratio | rho r=1 | updates < 0.4 | "
        "updates < 0.5 | met at 0.4 | met at 0.5 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for cell, g in gates.items():
        m, met = g["mean"], g["met"]
        lines.append(
            f"| `{cell}` | {m['length_ratio_0']:.2f} | {m['rho_r1_0']:.3f} | "
            f"{m['rho_r1_pi_0']:.3f} | {m['zero_variance_0']:.2f} | {m['length_ratio']:.2f} | "
            f"{m['rho_r1']:.3f} | {m['below_paper']:.2f} | {m['below_recipe']:.2f} | "
            f"{'yes' if met['paper'] else 'no'} | {'yes' if met['recipe'] else 'no'} |"
        )
    return lines


def by_cell_arm(results: dict[str, dict]) -> dict[str, list[dict]]:
    """Per "cell/arm": its runs' measures (every seed), in key order."""
    groups: dict[str, list[dict]] = {}
    for name, m in results.items():
        cell, arm, _ = name.split("/")
        groups.setdefault(f"{cell}/{arm}", []).append(m)
    return dict(sorted(groups.items()))


def curves(
    results: dict[str, dict], start: tuple[float, float | None]
) -> dict[str, list[tuple[int, float, float | None]]]:
    """Per cell/arm the learning curve from iteration 0 (the warm start, `start` = (greedy,
    pass@8)): (iterations done, mean greedy accuracy, mean pass@8 or None) over seeds at
    each evaluation."""
    out = {}
    for key, runs in by_cell_arm(results).items():
        steps = [s for s, _ in runs[0]["accuracy_curve"]]
        greedy = np.mean([[a for _, a in r["accuracy_curve"]] for r in runs], axis=0)
        passes = [[a for _, a in r.get("pass_at_8_curve", [])] for r in runs]
        known = all(len(p) == len(steps) for p in passes)
        pass_k = np.mean(passes, axis=0) if known else [None] * len(steps)
        out[key] = [(0, *start)] + [
            (s + 1, float(g), None if p is None else float(p))
            for s, g, p in zip(steps, greedy, pass_k, strict=True)
        ]
    return out


def curve_lines(curve_by_run: dict[str, list[tuple[int, float, float | None]]]) -> list[str]:
    """One table per cell: its arms' curves, "greedy / pass@8" per evaluated iteration."""
    lines: list[str] = []
    cells: dict[str, list[str]] = {}
    for key in curve_by_run:
        cells.setdefault(key.split("/")[0], []).append(key)
    for cell, keys in cells.items():
        iterations = [i for i, _, _ in curve_by_run[keys[0]]]
        lines += ["", "| `" + cell + "` | " + " | ".join(f"it. {i}" for i in iterations) + " |"]
        lines += ["|---|" + "---|" * len(iterations)]
        for key in keys:
            points = [
                f"{g:.3f}" + ("" if p is None else f" / {p:.3f}") for _, g, p in curve_by_run[key]
            ]
            lines.append(f"| {key.split('/')[1]} | " + " | ".join(points) + " |")
    return lines


def reading(
    claims: list[dict[str, Any]], gates: dict[str, dict[str, Any]], rho0: dict[str, float]
) -> list[str]:
    """The claims in words, each from its primary's row and its cell's gate."""
    lines = []
    for c in claims:
        share = gates[c["cell"]]["mean"]["below_paper" if c["rho0"] == "paper" else "below_recipe"]
        lines.append(
            f"- **{c['claim']}**: {c['verdict']}. `{c['arm']}` - `{c['baseline']}` in "
            f"{c['measure']} on `{c['cell']}`: {c['diff']:+.3f} (95% interval [{c['low']:+.3f}, "
            f"{c['high']:+.3f}], {c['n']} seeds, Holm p {c['p_holm']:.3f}, TOST Holm p "
            f"{c['tost_p_holm']:.3f} at +-{c['margin']:g}). Its precondition (rho at r = 1 below "
            f"{rho0[c['rho0']]:g} in at least half of the baseline's updates) "
            + ("holds" if c["gate_met"] else "does not hold")
            + f": {share:.0%} of them."
        )
    return lines


def render(
    *,
    header: str,
    setup: str,
    gates: dict[str, dict[str, Any]],
    claims: list[dict[str, Any]],
    tables: dict[str, dict[str, dict[str, Any]]],
    extra: dict[str, dict[str, dict[str, Any]]],
    collapse_counts: dict[str, int],
    mechanism: dict[str, dict[str, float | None]],
    seeds: Sequence[int],
    curve_by_run: dict[str, list[tuple[int, float, float | None]]],
    rho0: dict[str, float],
    figure_name: str | None = None,
    tried: Sequence[dict[str, Any]] = (),
) -> str:
    """The report: the gate (and the pilots `tried` before it: records with a command and a
    gate), the claims in words and as a table, every comparison, the learning curves, the
    collapses, the mechanism."""
    lines = [header, "", "## Setup", "", setup, "", "## The precondition gate", ""]
    lines += gate_lines(gates)
    for pilot in tried:
        lines += ["", f"Tried before, in a pilot (`{pilot['command']}`, 3 seeds):", ""]
        lines += gate_lines(pilot["gate"])[2:]  # the table, without the explanation
    lines += ["", "## What the study says", "", *reading(claims, gates, rho0)]
    lines += ["", "## The claims (one pre-registered primary each, Holm over the claims)", ""]
    lines += [
        "| claim | primary | mean diff | 95% interval | Holm p | TOST Holm p (margin) | gate | "
        "verdict |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in claims:
        lines.append(
            f"| {c['claim']} | `{c['cell']}` {c['arm']} - {c['baseline']}, {c['measure']} | "
            f"{c['diff']:+.3f} | [{c['low']:+.3f}, {c['high']:+.3f}] | {c['p_holm']:.3f} | "
            f"{c['tost_p_holm']:.3f} (+-{c['margin']:g}) | {c['rho0']}: "
            f"{'met' if c['gate_met'] else 'not met'} | {c['verdict']} |"
        )
    for title, rows in {**tables, **extra}.items():
        lines += ["", f"## {title}", "", *COMPARISON_HEADER]
        lines += [_row(name, c) for name, c in rows.items()]
    lines += ["", "## Learning curves (mean over seeds; greedy / pass@8; it. 0: the warm start)"]
    lines += curve_lines(curve_by_run)
    if figure_name is not None:
        lines += ["", f"![accuracy, entropy, rho and grad norm per cell and arm]({figure_name})"]
    lines += ["", "## Collapses against the on-policy control", ""]
    lines += [
        f"Seeds (of {len(seeds)}) whose end accuracy is {100 * COLLAPSE_DROP:g} or more points "
        "below the on-policy control's of the same seed:",
        "",
        "| cell / arm | collapses |",
        "|---|---|",
        *(f"| `{k}` | {v} |" for k, v in sorted(collapse_counts.items())),
    ]
    lines += ["", "## The mechanism (mean over seeds of each run's mean over iterations)", ""]
    lines += ["| cell / arm | " + " | ".join(MECHANISM) + " |"]
    lines += ["|---|" + "---|" * len(MECHANISM)]
    for key, m in mechanism.items():
        cells = ["-" if m.get(k) is None else f"{m[k]:.3f}" for k in MECHANISM]
        lines.append(f"| `{key}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def mechanism_means(results: dict[str, dict], seeds) -> dict[str, dict[str, float | None]]:
    """Per cell/arm, the mean over seeds of each MECHANISM measure (None where not logged)."""
    out = {}
    for key, runs in by_cell_arm(results).items():
        out[key] = {}
        for k in MECHANISM:
            known = [r[k] for r in runs if r.get(k) is not None]
            out[key][k] = float(np.mean(known)) if known else None
    return out
