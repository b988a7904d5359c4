"""A multi-seed study's tables, verdicts and figure, from its runs' measures.

`results` maps a run name "<cell>/<arm>/seed<k>" to its measures (`tasks.study.measures`).
Tables give mean and 95% bootstrap interval over seeds per (cell, arm); comparisons pair runs
by seed (`study_stats.paired_t_test`) and are Holm-corrected within their table; a claim
holds when its comparisons agree in sign and survive the correction at `ALPHA`, is
contradicted when one survives with the opposite sign, and cannot be told apart from noise
otherwise.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bapo_jax.tasks.study_stats import Interval, PairedTest, bootstrap_mean, holm, paired_t_test

ALPHA = 0.05
COLUMNS = (  # (measure, header, format)
    ("accuracy_last", "held-out acc (end)", "{:.3f}"),
    ("accuracy_best", "best acc", "{:.3f}"),
    ("entropy_last", "entropy (last quarter)", "{:.4f}"),
    ("rho_before", "rho before search", "{:.3f}"),
    ("rho_after", "rho", "{:.3f}"),
    ("c_low", "c_low", "{:.3f}"),
    ("c_high", "c_high", "{:.3f}"),
    ("clip_low_frac", "clip low", "{:.4f}"),
    ("clip_high_frac", "clip high", "{:.4f}"),
    ("grad_spikes", "grad spikes", "{:.1f}"),
    ("collapses", "collapses", "{:.1f}"),
)


def split_name(name: str) -> tuple[str, str, int]:
    cell, arm, seed = name.split("/")
    return cell, arm, int(seed.removeprefix("seed"))


def by_seed(results: Mapping[str, dict], cell: str, arm: str, measure: str) -> dict[int, float]:
    """seed -> the measure, for the runs of (cell, arm) that have it."""
    out = {}
    for name, m in results.items():
        c, a, seed = split_name(name)
        if c == cell and a == arm and m.get(measure) is not None:
            out[seed] = float(m[measure])
    return out


def interval(results: Mapping[str, dict], cell: str, arm: str, measure: str) -> Interval | None:
    values = list(by_seed(results, cell, arm, measure).values())
    return bootstrap_mean(values) if values else None


def summary_table(results: Mapping[str, dict], cell: str, arms: Sequence[str]) -> str:
    """Markdown: one row per arm, mean [95% bootstrap interval] over seeds per measure."""
    head = "| arm | seeds | " + " | ".join(h for _, h, _ in COLUMNS) + " |"
    lines = [head, "|---" * (len(COLUMNS) + 2) + "|"]
    for arm in arms:
        seeds = len(by_seed(results, cell, arm, "accuracy_last"))
        if not seeds:
            continue
        cells = []
        for measure, _, fmt in COLUMNS:
            iv = interval(results, cell, arm, measure)
            if iv is None:
                cells.append("-")
            elif seeds == 1 or iv.low == iv.high:
                cells.append(fmt.format(iv.mean))
            else:
                cells.append(f"{fmt.format(iv.mean)} [{fmt.format(iv.low)}, {fmt.format(iv.high)}]")
        lines.append(f"| {arm} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """`measure` of (cell_a, arm_a) minus (cell_b, arm_b), paired by seed; `holm_p` within its
    table."""

    measure: str
    cell_a: str
    arm_a: str
    cell_b: str
    arm_b: str
    test: PairedTest
    holm_p: float = float("nan")

    @property
    def label(self) -> str:
        left = f"{self.arm_a} @ {self.cell_a}"
        right = f"{self.arm_b}" if self.cell_a == self.cell_b else f"{self.arm_b} @ {self.cell_b}"
        return f"{left} - {right}"


def compare(
    results: Mapping[str, dict],
    pairs: Sequence[tuple[str, str, str, str]],
    measure: str,
) -> list[Comparison]:
    """Paired tests of `measure` for each (cell_a, arm_a, cell_b, arm_b), Holm-corrected
    together; pairs with fewer than 2 common seeds are left out."""
    found = []
    for cell_a, arm_a, cell_b, arm_b in pairs:
        a = by_seed(results, cell_a, arm_a, measure)
        b = by_seed(results, cell_b, arm_b, measure)
        seeds = sorted(set(a) & set(b))
        if len(seeds) < 2:
            continue
        test = paired_t_test([a[s] for s in seeds], [b[s] for s in seeds])
        found.append(Comparison(measure, cell_a, arm_a, cell_b, arm_b, test))
    adjusted = holm([c.test.p for c in found]) if found else []
    return [dataclasses.replace(c, holm_p=p) for c, p in zip(found, adjusted, strict=True)]


def comparison_table(comparisons: Sequence[Comparison]) -> str:
    lines = [
        "| comparison | measure | mean difference | t | p | Holm p |",
        "|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        t = c.test
        lines.append(
            f"| {c.label} | {c.measure} | {t.mean_diff:+.4f} | {t.t:.2f} | {t.p:.4f} | "
            f"{c.holm_p:.4f} |"
        )
    return "\n".join(lines)


def verdict(comparisons: Sequence[Comparison], expected_sign: int) -> str:
    """'holds' / 'does not hold' / 'cannot be told apart from noise' (module doc)."""
    if not comparisons:
        return "not measured"
    significant = [c for c in comparisons if c.holm_p < ALPHA]
    if any(np.sign(c.test.mean_diff) == -expected_sign for c in significant):
        return "does not hold"
    if len(significant) == len(comparisons):
        return "holds"
    if significant:
        return f"holds in {len(significant)} of {len(comparisons)} comparisons, noise in the rest"
    return "cannot be told apart from noise"


def figure(
    results: Mapping[str, dict],
    cells: Sequence[str],
    arms: Sequence[str],
    path: str,
    title: str,
) -> None:
    """Per cell (columns): held-out accuracy per evaluation, entropy, rho and grad norm per
    iteration (rows); one line per arm, the mean over its seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("accuracy", "held-out accuracy"), ("entropy", "entropy"), ("rho", "rho"))
    panels += (("grad_norm", "grad norm (max per iteration)"),)
    fig, axes = plt.subplots(
        len(panels), len(cells), figsize=(4.2 * len(cells), 2.5 * len(panels)), squeeze=False
    )
    for col, cell in enumerate(cells):
        for row, (key, name) in enumerate(panels):
            ax = axes[row][col]
            for arm in arms:
                runs = [m for n, m in results.items() if split_name(n)[:2] == (cell, arm)]
                if not runs:
                    continue
                if key == "accuracy":
                    steps = [s for s, _ in runs[0]["accuracy_curve"]]
                    curves = [[a for _, a in m["accuracy_curve"]] for m in runs]
                else:
                    curves = [m["series"][key] for m in runs]
                    steps = list(range(len(curves[0])))
                length = min(len(c) for c in curves)
                mean = np.mean([c[:length] for c in curves], axis=0)
                ax.plot(steps[:length], mean, label=arm, linewidth=1.2)
            if row == 0:
                ax.set_title(cell)
            if col == 0:
                ax.set_ylabel(name)
            if row == len(panels) - 1:
                ax.set_xlabel("RL iteration")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=80)
    plt.close(fig)
    os.replace(tmp, path)


def rounded(value: Any, digits: int = 6) -> Any:
    """`value` with every float rounded to `digits` significant digits (for recorded metrics)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value
