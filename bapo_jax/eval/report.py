"""The evaluation report: one dict, written as `eval.json` and `eval.md`.

Layout of the dict (and of `eval.json`):

    config:    what was run (benchmark, model, engine, sampling, prompt style, seed, ...)
    summary:   `metrics.summarize`: num_problems, samples_per_problem, metrics (avg@n, pass@k,
               maj@n, run-accuracy spread), lengths (token statistics, truncated and
               answer-less fractions)
    problems:  one row per problem (in benchmark order): index, id, gold answer, the
               `metrics.problem_rows` fields, and per sample: extracted answer, correct (0/1),
               score (the reward), length in tokens, finish reason
    rewards:   counters of the reward pool over the run (timeouts, worker restarts, ...)
    wall_s:    wall time of generation and scoring (run metadata, not a benchmark)

`samples.jsonl` (optional) holds the decoded response texts, one line per sample.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bapo_jax.eval import metrics as metrics_lib

__all__ = [
    "ProblemResult",
    "build_report",
    "render_markdown",
    "write_report",
    "write_samples",
]


@dataclasses.dataclass(frozen=True)
class ProblemResult:
    """The n scored samples of one problem (lists in sample order).

    answers: the extracted final answer (content of the last `\\boxed{}`; None: no box).
    correct: whether each sample is correct (1.0 / 0.0): its reward > 0.5.
    scores: each sample's reward (`--reward`; None: the same as `correct`, as math-verify's).
    lengths: response length in tokens (stop token included).
    finish_reasons: "stop" | "length".
    """

    problem_id: str
    gold: str
    responses: tuple[str, ...]
    answers: tuple[str | None, ...]
    correct: tuple[float, ...]
    lengths: tuple[int, ...]
    finish_reasons: tuple[str, ...]
    scores: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        n = len(self.responses)
        if n < 1:
            raise ValueError(f"ProblemResult {self.problem_id!r}: responses must be non-empty")
        for name in ("answers", "correct", "lengths", "finish_reasons", "scores"):
            if getattr(self, name) is not None and len(getattr(self, name)) != n:
                raise ValueError(
                    f"ProblemResult {self.problem_id!r}: {name} has {len(getattr(self, name))} "
                    f"entries, responses has {n}"
                )
        if any(c not in (0.0, 1.0) for c in self.correct):
            raise ValueError(
                f"ProblemResult {self.problem_id!r}: correct must be 0/1, got {self.correct}"
            )


def build_report(
    results: Sequence[ProblemResult],
    config: Mapping[str, Any],
    *,
    rewards: Mapping[str, Any] | None = None,
    wall_s: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """The report dict (see the module doc) of `results`, all with the same number of samples."""
    if not results:
        raise ValueError("results must hold at least one problem, got none")
    n = len(results[0].responses)
    for r in results:
        if len(r.responses) != n:
            raise ValueError(
                f"every problem needs the same number of samples: {results[0].problem_id!r} has "
                f"{n}, {r.problem_id!r} has {len(r.responses)}"
            )
    correct = np.asarray([r.correct for r in results]) > 0.5  # [P, N]
    lengths = np.asarray([r.lengths for r in results], np.int64)  # [P, N]
    truncated = np.asarray([[f == "length" for f in r.finish_reasons] for r in results])  # [P, N]
    answers = [list(r.answers) for r in results]
    rows = metrics_lib.problem_rows(correct, answers, lengths, truncated)
    problems = []
    for index, (r, row) in enumerate(zip(results, rows, strict=True)):
        problems.append(
            {
                "index": index,
                "id": r.problem_id,
                "gold": r.gold,
                **row,
                "samples": {
                    "answers": list(r.answers),
                    "correct": [int(c) for c in r.correct],
                    "scores": [float(c) for c in r.scores or r.correct],
                    "lengths": [int(x) for x in r.lengths],
                    "finish_reasons": list(r.finish_reasons),
                },
            }
        )
    return {
        "config": json.loads(json.dumps(dict(config))),  # JSON-native, as in eval.json
        "summary": metrics_lib.summarize(correct, answers, lengths, truncated),
        "problems": problems,
        "rewards": dict(rewards or {}),
        "wall_s": dict(wall_s or {}),
    }


# ---- markdown --------------------------------------------------------------------------------


def _cell(value: Any, width: int = 40) -> str:
    """A markdown table cell: pipes escaped, newlines flattened, long text shortened."""
    if value is None:
        return "-"
    text = " ".join(str(value).split()).replace("|", "\\|")
    return text if len(text) <= width else text[: width - 1] + "…"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}"


def _num(x: float | int | None) -> str:
    if x is None:
        return "-"
    return str(x) if isinstance(x, int) else f"{x:.1f}"


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as markdown: run config, metrics (in %), length statistics, per-problem table."""
    config, summary = report["config"], report["summary"]
    n = summary["samples_per_problem"]
    lines = [f"# Evaluation: {config.get('benchmark', '?')}", ""]
    lines += [
        f"- {key}: `{json.dumps(value, ensure_ascii=False)}`" for key, value in config.items()
    ]
    lines += ["", f"## Metrics (% over {summary['num_problems']} problems, {n} samples each)", ""]
    lines += ["| metric | value |", "| --- | --- |"]
    lines += [f"| {name} | {_pct(value)} |" for name, value in summary["metrics"].items()]
    lines += ["", "## Response length (tokens)", ""]
    lines += ["| samples | count | mean | std | min | p50 | p90 | max |"]
    lines += ["| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for group in ("all", "correct", "incorrect"):
        s = summary["lengths"][group]
        cells = [_num(s[key]) for key in ("count", "mean", "std", "min", "p50", "p90", "max")]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Truncated (hit max tokens): {_pct(summary['lengths']['truncated_fraction'])}%; "
        f"no boxed answer: {_pct(summary['lengths']['no_answer_fraction'])}%.",
        "",
        "## Problems",
        "",
        f"| # | id | gold | correct / {n} | pass@{n} | majority answer (votes) | maj ok "
        "| no answer | truncated | mean length |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in report["problems"]:
        vote = (
            "-"
            if row["majority_answer"] is None
            else f"{_cell(row['majority_answer'], 30)} ({row['majority_count']})"
        )
        lines.append(
            f"| {row['index']} | {_cell(row['id'])} | {_cell(row['gold'], 30)} | "
            f"{row['num_correct']} | {_pct(row['pass'][f'pass@{n}'])} | {vote} | "
            f"{'yes' if row['majority_correct'] else 'no'} | {row['no_answer']} | "
            f"{row['truncated']} | {row['mean_length']:.1f} |"
        )
    rewards = report.get("rewards") or {}
    if rewards:
        lines += ["", "Reward checks: " + ", ".join(f"{k} {v}" for k, v in rewards.items()) + "."]
    return "\n".join(lines) + "\n"


# ---- files -----------------------------------------------------------------------------------


def write_report(report: Mapping[str, Any], out_dir: str | Path) -> tuple[Path, Path]:
    """Write `eval.json` and `eval.md` into `out_dir` (created); returns both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "eval.json", out / "eval.md"
    json_path.write_text(
        json.dumps(report, indent=2, ensure_ascii=False, allow_nan=False) + "\n", encoding="utf-8"
    )
    md_path.write_text(render_markdown(report), encoding="utf-8")
    return json_path, md_path


def write_samples(results: Sequence[ProblemResult], path: str | Path) -> Path:
    """One JSON line per sample: problem index and id, sample index, response text, answer,
    correct, score (the reward), length, finish reason."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for index, r in enumerate(results):
            for j, text in enumerate(r.responses):
                record = {
                    "problem_index": index,
                    "id": r.problem_id,
                    "sample_index": j,
                    "response": text,
                    "answer": r.answers[j],
                    "correct": int(r.correct[j]),
                    "score": float((r.scores or r.correct)[j]),
                    "length": int(r.lengths[j]),
                    "finish_reason": r.finish_reasons[j],
                }
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path
