"""README and docs quote the records (experiments.records): every recorded number where the
text says it is, and no accuracy pair the records do not hold."""

from __future__ import annotations

import os
import re

from experiments import records

TEXTS = ["README.md"] + [
    os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(records.ROOT, "docs")))
]
TEXTS = [t for t in TEXTS if t.endswith(".md")]
ACCURACY_PAIR = re.compile(r"(\d+\.\d) ?% -> (\d+\.\d) ?%")


def _text(path: str) -> str:
    with open(os.path.join(records.ROOT, path), encoding="utf-8") as f:
        return " ".join(f.read().split())  # line breaks and runs of spaces as one space


def _main_job_entries():
    for engine, by_cpu in records.read(records.MAIN_JOB).items():
        for cpu, entry in by_cpu.items():
            yield engine, cpu, entry


def _problems(texts: dict[str, str]) -> list[str]:
    """What the texts (path -> normalized text) say unlike the records."""
    out = []
    for engine, cpu, entry in _main_job_entries():
        if not entry["quoted_in"]:
            out.append(f"{engine}/{cpu}: the record names no text quoting it")
        for path in entry["quoted_in"]:
            for fragment in records.main_job_fragments(engine, entry):
                if fragment not in texts[path]:
                    out.append(f"{path} does not say {fragment!r} ({engine}, {cpu})")
    for experiment, entry in records.read(records.MEMORY_PLAN).items():
        for path, fragments in records.memory_plan_fragments(entry).items():
            for fragment in fragments:
                if fragment not in texts[path]:
                    out.append(f"{path} does not say {fragment!r} ({experiment})")
    recorded = {
        (e["quoted"]["accuracy_before"], e["quoted"]["accuracy_after"])
        for _, _, e in _main_job_entries()
    }
    for path, text in texts.items():
        for before, after in ACCURACY_PAIR.findall(text):
            if (before, after) not in recorded:
                out.append(
                    f"{path} quotes {before}% -> {after}%, which no record in "
                    "docs/records/main_job.json holds (re-run and --record, or fix the text)"
                )
    return out


def test_readme_and_docs_quote_the_records_and_nothing_else():
    assert _problems({path: _text(path) for path in TEXTS}) == []


def test_a_quoted_number_changed_by_hand_fails():
    """README with the first recorded accuracy moved by 0.1 point."""
    texts = {path: _text(path) for path in TEXTS}
    engine, cpu, entry = next(_main_job_entries())
    after = entry["quoted"]["accuracy_after"]
    moved = f"{float(after) + 0.1:.1f}"
    fragment = records.main_job_fragments(engine, entry)[0]
    path = entry["quoted_in"][0]
    texts[path] = texts[path].replace(fragment, fragment.replace(f"{after}%", f"{moved}%"))
    problems = _problems(texts)
    assert f"{path} does not say {fragment!r} ({engine}, {cpu})" in problems
    assert any(f"quotes {entry['quoted']['accuracy_before']}% -> {moved}%" in p for p in problems)


def test_a_run_that_differs_from_the_record_is_refused(tmp_path):
    """`check_main_job` against a record: equal numbers pass, one moved fails naming it, a
    CPU class without a record is a note."""
    summary = {
        "engine": "embedded",
        "accuracy_before": 0.504,
        "accuracy_after": 0.728,
        "bapo_bounds": {"c_low_min": 0.675, "c_low_max": 0.825, "c_high_min": 1.65},
        "control": {"accuracy": 0.588},
        "wall_time_s": 100.0,
    }
    summary["bapo_bounds"]["c_high_max"] = 2.55
    path = str(tmp_path / "main_job.json")
    records.write(path, {})
    records.record_main_job(summary, "x86_64-avx512", "python -m x", path=path)
    assert records.check_main_job(summary, "x86_64-avx512", path=path) == ([], [])
    moved = {**summary, "accuracy_after": 0.730}
    problems, _ = records.check_main_job(moved, "x86_64-avx512", path=path)
    assert problems == [
        f"embedded main job on x86_64-avx512: accuracy_after is 73.0, the record (commit "
        f"{records.commit()}) says 72.8"
    ]
    problems, notes = records.check_main_job(summary, "x86_64-avx2", path=path)
    assert problems == [] and "no embedded main-job record for CPU class 'x86_64-avx2'" in notes[0]
