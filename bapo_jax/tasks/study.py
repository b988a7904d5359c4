"""Side-by-side RL runs from one warm start, and their figure + markdown report.

`run_grid` trains every (loss, E) cell from the same warm-start weights with the same seeds
(only the loss and the updates per rollout batch differ) and reads each run's metrics.jsonl;
`figure` draws reward, entropy, positive contribution (rho) and grad norm per E with one line
per loss; `report` writes what was measured, as a table of first/last values.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from bapo_jax.run.config import RunConfig
from bapo_jax.tasks import arithmetic_job as job
from bapo_jax.train.config import AlgorithmConfig

PANELS = (
    ("reward/mean", "reward (train batch)"),
    ("entropy", "entropy"),
    ("rho", "positive contribution rho"),
    ("grad_norm", "grad norm (max over updates)"),
)


@dataclasses.dataclass(frozen=True)
class Cell:
    """One run: a label, the algorithm section (loss + its config) and E."""

    label: str
    algorithm: AlgorithmConfig
    updates: int


def cells(algorithms: Mapping[str, AlgorithmConfig], updates: Sequence[int]) -> list[Cell]:
    return [
        Cell(label, dataclasses.replace(algo, mini_batches=e, epochs=1), e)
        for e in updates
        for label, algo in algorithms.items()
    ]


def run_grid(
    prepared: job.Prepared, base: RunConfig, grid: Sequence[Cell], out_dir: str
) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """Every cell from the warm start `prepared` (its HF directory), with `base`'s settings."""
    results = {}
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, hf_dir=prepared.hf_dir))
    for cell in grid:
        run_dir = os.path.join(out_dir, f"{cell.label}_E{cell.updates}")
        os.makedirs(run_dir, exist_ok=True)
        config = dataclasses.replace(
            base, trainer=dataclasses.replace(base.trainer, algorithm=cell.algorithm)
        )
        job.run_rl(prepared, config, run_dir)
        results[(cell.label, cell.updates)] = job.read_rows(run_dir)
        print(f"{cell.label} E={cell.updates}: done", flush=True)
    return results


def figure(results: Mapping[tuple[str, int], list[dict]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = sorted({k[0] for k in results}, key=lambda x: [k[0] for k in results].index(x))
    updates = sorted({k[1] for k in results})
    fig, axes = plt.subplots(
        len(PANELS), len(updates), figsize=(4.2 * len(updates), 2.6 * len(PANELS)), squeeze=False
    )
    for col, e in enumerate(updates):
        for row, (key, name) in enumerate(PANELS):
            ax = axes[row][col]
            for label in labels:
                rows = results.get((label, e), [])
                steps = [r["step"] for r in rows if key in r]
                ax.plot(steps, [r[key] for r in rows if key in r], label=label, linewidth=1.2)
            if row == 0:
                ax.set_title(f"E = {e} updates / rollout batch")
            if col == 0:
                ax.set_ylabel(name)
            if row == len(PANELS) - 1:
                ax.set_xlabel("RL iteration")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path + ".tmp.png"
    fig.savefig(tmp, dpi=90)
    plt.close(fig)
    os.replace(tmp, path)


def _mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if values else float("nan")


def table(results: Mapping[tuple[str, int], list[dict]]) -> str:
    """Markdown: per run, held-out accuracy (last eval), mean reward / entropy / rho over the
    first and last quarter of the run, grad-norm max, BAPO bounds."""
    lines = [
        "| run | E | held-out acc (last) | reward first->last quarter | entropy first->last | "
        "rho first->last | grad norm max | c_low range | c_high range |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (label, e), rows in results.items():
        q = max(1, len(rows) // 4)
        first, last = rows[:q], rows[-q:]

        def span(key, first=first, last=last):
            return f"{_mean([r[key] for r in first]):.3f} -> {_mean([r[key] for r in last]):.3f}"

        evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
        lo = [r["c_low"] for r in rows]
        hi = [r["c_high"] for r in rows]
        lines.append(
            f"| {label} | {e} | {evals[-1] if evals else float('nan'):.3f} | "
            f"{span('reward/mean')} | {span('entropy')} | {span('rho')} | "
            f"{max(r['grad_norm'] for r in rows):.2f} | {min(lo):.2f}-{max(lo):.2f} | "
            f"{min(hi):.2f}-{max(hi):.2f} |"
        )
    return "\n".join(lines)
