"""Records of the deterministic runs whose numbers README and docs quote.

    docs/records/main_job.json     the main job (`experiments.cpu_arithmetic`) per engine and
                                   CPU class: {engine: {cpu class: entry}} ("embedded+lora":
                                   the job with `--lora`)
    docs/records/memory_plan.json  the experiments' real train steps as the dry run compiles
                                   them (`experiments.aime_7b --dry-run`): {experiment: entry}

An entry holds the command, the commit and date it ran at, the host's CPU class
(`study.cpu_class`: XLA:CPU's kernels, and with them the fp32 trajectory, differ between
instruction sets, each deterministic) and the numbers at the precision the text quotes them
(`quoted`). Three things read them:

* a run asked to (`--check-record` of `experiments.cpu_arithmetic`, the dry-run tests) compares
  what it measured, rounded alike, with the entry for this host's class and fails on any
  difference; a class without an entry is a note (its numbers are recorded on such a host with
  `--record`);
* `tests/test_records.py` checks that README and docs quote every entry as recorded
  (`main_job_fragments`, `memory_plan_fragments`) and that every "X% -> Y%" they quote is a
  recorded one, so a number changed by hand fails `make test`;
* people: the text says which record it quotes.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from typing import Any

from bapo_jax.tasks.study import read_json as read
from bapo_jax.tasks.study import write_json as write  # temp file + rename

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS_DIR = os.path.join(ROOT, "docs", "records")
MAIN_JOB = os.path.join(RECORDS_DIR, "main_job.json")
MEMORY_PLAN = os.path.join(RECORDS_DIR, "memory_plan.json")


def commit() -> str:
    """HEAD's short hash, marked when tracked files differ from it; "unknown" without git."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
        return done.stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + (" with uncommitted changes" if dirty else "")


def exponent(x: float) -> str:
    """`x` as the text quotes small numbers: two significant digits, e.g. 3.2e-7."""
    mantissa, power = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(power)}"


# ---- the main job -----------------------------------------------------------------------------
def main_job_quoted(summary: dict[str, Any]) -> dict[str, Any]:
    """The numbers of a main-job summary that README and docs quote, as they quote them."""
    bounds = summary["bapo_bounds"]
    out: dict[str, Any] = {
        "accuracy_before": f"{100 * summary['accuracy_before']:.1f}",
        "accuracy_after": f"{100 * summary['accuracy_after']:.1f}",
        "c_low": f"{bounds['c_low_min']:.2f}-{bounds['c_low_max']:.2f}",
        "c_high": f"{bounds['c_high_min']:.2f}-{bounds['c_high_max']:.2f}",
    }
    if "control" in summary:
        out["control"] = f"{100 * summary['control']['accuracy']:.1f}"
    behaviour = summary.get("behaviour") or {}
    if summary["engine"] == "vllm" and "logprob_abs_diff_mean" in behaviour:
        out["accuracy_after_embedded"] = f"{100 * summary['accuracy_after_embedded']:.1f}"
        out["logprob_diff_mean"] = exponent(behaviour["logprob_abs_diff_mean"])
        out["logprob_diff_max"] = exponent(behaviour["logprob_abs_diff_max"])
        out["trained_tokens"] = f"{behaviour['trained_tokens']:,}"
        out["version_mismatch_tokens"] = str(behaviour["version_mismatch_tokens"])
    return out


def check_main_job(
    summary: dict[str, Any], cpu: str, path: str = MAIN_JOB, key: str | None = None
) -> tuple[list[str], list[str]]:
    """(problems, notes): where this run's quoted numbers differ from the record of its engine
    (`key`: another variant's, e.g. "embedded+lora") on CPU class `cpu`. Numbers the run did
    not measure (e.g. no control) are not compared."""
    engine = key or summary["engine"]
    entry = read(path).get(engine, {}).get(cpu)
    if entry is None:
        note = (
            f"no {engine} main-job record for CPU class {cpu!r} in {os.path.relpath(path, ROOT)}: "
            "not compared (record it on such a host with --record)"
        )
        return [], [note]
    mine = main_job_quoted(summary)
    problems = [
        f"{engine} main job on {cpu}: {key} is {mine[key]}, the record (commit "
        f"{entry['commit']}) says {value}"
        for key, value in entry["quoted"].items()
        if key in mine and mine[key] != value
    ]
    return problems, []


def record_main_job(
    summary: dict[str, Any], cpu: str, command: str, path: str = MAIN_JOB, key: str | None = None
) -> dict[str, Any]:
    """Add (or replace) this run's entry for its engine (or variant `key`) and CPU class;
    returns it."""
    records = read(path) if os.path.exists(path) else {}
    key = key or summary["engine"]
    previous = records.get(key, {}).get(cpu, {})
    entry = {
        "command": command,
        "commit": commit(),
        "date": datetime.date.today().isoformat(),
        "cpu_class": cpu,
        "wall_time_s": round(summary["wall_time_s"]),
        "quoted": main_job_quoted(summary),
        "quoted_in": previous.get("quoted_in", []),  # the texts quoting it (tests/test_records)
    }
    records.setdefault(key, {})[cpu] = entry
    write(path, records)
    return entry


def main_job_fragments(engine: str, entry: dict[str, Any]) -> list[str]:
    """What the text says of a main-job entry (whitespace-normalized)."""
    q = entry["quoted"]
    out = [f"{q['accuracy_before']}% -> {q['accuracy_after']}%"]
    if engine.startswith("embedded"):
        out.append(f"c_low within {q['c_low']} and c_high within {q['c_high']}")
    if "control" in q:
        out.append(f"(control: {q['control']}%)")
    if "logprob_diff_mean" in q:
        out.append(f"log-prob {q['logprob_diff_mean']} on average (max {q['logprob_diff_max']})")
        out.append(f"over all {q['trained_tokens']} trained tokens")
        out.append(f"final params: {q['accuracy_after_embedded']}%")
    return out


# ---- the memory plan ---------------------------------------------------------------------------
def memory_plan_quoted(real_step: dict[str, Any]) -> dict[str, str]:
    """The dry run's real-step numbers the text quotes (GB per device, two decimals)."""
    keys = ("arguments_gb", "temporaries_gb", "peak_gb_per_device")
    return {k: f"{real_step[k]:.2f}" for k in keys}


def check_memory_plan(
    experiment: str, real_step: dict[str, Any], path: str = MEMORY_PLAN
) -> list[str]:
    """Where the dry run's compiled step differs from the record (XLA's buffer assignment does
    not depend on the CPU's instruction set: one entry per experiment)."""
    entry = read(path)[experiment]
    mine = memory_plan_quoted(real_step)
    return [
        f"{experiment} real step: {key} is {mine[key]}, the record (commit {entry['commit']}) "
        f"says {value}"
        for key, value in entry["quoted"].items()
        if mine.get(key) != value
    ]


def memory_plan_fragments(entry: dict[str, Any]) -> dict[str, list[str]]:
    """File -> what it says of a memory-plan entry (whitespace-normalized)."""
    q = entry["quoted"]
    peak = q["peak_gb_per_device"]
    row = f"| {q['arguments_gb']} GB | {q['temporaries_gb']} GB | {peak} GB |"
    return {
        "README.md": [f"{float(peak):.1f} GB per GPU"],
        "docs/sharding.md": [row],
        "docs/pod.md": [f"| {peak} GB |"],
    }
