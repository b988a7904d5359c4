"""The off-policy study's plan, record check and report, on synthetic measures (the runs
themselves: `make study-check`, which runs --quick in CI)."""

import dataclasses
import json
import os

import numpy as np
import pytest

from bapo_jax.tasks import study_report
from experiments import offpolicy_report
from experiments import offpolicy_study as s


def test_the_study_grid():
    specs = s.STUDY.specs()
    names = [spec.name for spec in specs]
    assert len(names) == len(set(names)) == 4 * 5 * 5 + 5 * 5  # cells x arms x seeds + ablations
    for cell in s.STUDY.cells:
        for arm in s.ARMS:
            assert sorted(x.seed for x in specs if (x.cell, x.arm) == (cell, arm)) == [
                0,
                1,
                2,
                3,
                4,
            ]
    assert {x.cell.name for x in specs if x.arm in s.ABLATIONS} == {"collapse"}
    assert s.ARMS["bapo_code"].bapo.scope == "micro_batch"
    assert s.ABLATIONS["bapo_rho0_0.3"].bapo.rho0 == 0.3
    # only the scope ablation accumulates gradients (so its per-micro-batch search differs)
    assert {a for a, x in {**s.ARMS, **s.ABLATIONS}.items() if x.micro_batches > 1} == {
        "bapo_micro_batch_scope"
    }
    assert not s.QUICK.ablations and set(s.QUICK.arms) == set(s.ARMS)


def test_a_run_config_carries_its_cell_and_seed():
    cell = s.study.Cell("c", updates=16, staleness=2, learning_rate=3e-4)
    spec = s.study.RunSpec("clip", s.ARMS["clip"], cell, seed=3)
    config = s.STUDY.config(spec, "/warm/hf")
    t = config.trainer
    assert (t.algorithm.mini_batches, t.algorithm.epochs, t.algorithm.micro_batches) == (16, 1, 1)
    assert t.algorithm.loss == "ppo_clip" and t.offpolicy.staleness == 2
    assert t.rollout.seed == 3 and t.optimizer.learning_rate == 3e-4
    assert config.model.hf_dir == "/warm/hf"
    base = s.STUDY.config(dataclasses.replace(spec, cell=s.study.Cell("d", 1)), "/warm/hf")
    assert base.trainer.optimizer.learning_rate == s.STUDY_TRAINER.optimizer.learning_rate


def test_check_finds_a_changed_plan_and_changed_quick_metrics(tmp_path):
    quick = {"quick/clip/seed0": {"accuracy_last": 0.25, "entropy_last": 0.1}}
    other = {"quick/clip/seed0": {"accuracy_last": 0.5, "entropy_last": 0.2}}
    path = tmp_path / "record.json"
    records = {"x86_64-avx2": quick, "x86_64-avx512": other}
    path.write_text(json.dumps({"plan": s.plan_record(s.STUDY), "quick": records}))
    assert s.check(str(path), quick, "x86_64-avx2") == ([], [])
    # Each class against its own record.
    assert s.check(str(path), other, "x86_64-avx512") == ([], [])
    (problem,), _ = s.check(str(path), quick, "x86_64-avx512")
    assert "quick/clip/seed0 (x86_64-avx512)" in problem and "0.25" in problem
    moved = {"quick/clip/seed0": {"accuracy_last": 0.3125, "entropy_last": 0.1}}
    (problem,), _ = s.check(str(path), moved, "x86_64-avx2")
    assert "quick/clip/seed0" in problem and "0.3125" in problem
    missing, _ = s.check(str(path), {}, "x86_64-avx2")
    assert missing and "now None" in missing[0]
    # A class without a record: a note naming it and the command that records it, no problem.
    problems, (note,) = s.check(str(path), quick, "aarch64")
    assert problems == [] and "no quick-run record for CPU class 'aarch64'" in note
    assert "x86_64-avx2, x86_64-avx512" in note and "--quick --record" in note
    record = s.plan_record(s.STUDY)
    record["seeds"] = [0, 1]
    path.write_text(json.dumps({"plan": record, "quick": records}))
    changed = ["the study's configuration differs from the one the report was made with"]
    assert s.check(str(path), quick, "x86_64-avx2") == (changed, [])
    assert s.check(str(path), quick, "aarch64")[0] == changed  # checked without a record too


def test_record_quick_adds_a_class_and_keeps_the_others(tmp_path):
    quick = {"quick/clip/seed0": {"accuracy_last": 0.25}}
    path = tmp_path / "record.json"
    record = {"commit": "abc1234", "plan": s.plan_record(s.STUDY), "quick": {"x86_64-avx2": quick}}
    path.write_text(json.dumps(record))
    mine = {"quick/clip/seed0": {"accuracy_last": 0.5}}
    assert s.record_quick(str(path), mine, "x86_64-avx512") == []
    written = json.loads(path.read_text())
    assert written["quick"] == {"x86_64-avx2": quick, "x86_64-avx512": mine}
    assert written["commit"] == "abc1234" and written["plan"] == record["plan"]
    assert s.check(str(path), mine, "x86_64-avx512") == ([], [])
    # A changed study configuration is refused: its report would no longer be the record's.
    record["plan"] = {**record["plan"], "seeds": [0, 1]}
    path.write_text(json.dumps(record))
    assert s.record_quick(str(path), mine, "x86_64-avx512") == [
        "the study's configuration differs from the one the report was made with"
    ]
    assert json.loads(path.read_text()) == record


NOISE = np.random.default_rng(0).normal(scale=0.01, size=5)  # per seed, shared by the arms


def _synthetic(bapo_gain: float) -> dict[str, dict]:
    """5 seeds of every arm in three cells; BAPO's end accuracy `bapo_gain` above the
    baselines' off-policy (plus per-seed noise shared by every arm of a seed)."""
    results = {}
    noise = NOISE
    for cell, drop in (("on_policy", 0.0), ("moderate", 0.05), ("hard", 0.1)):
        for arm in s.ARMS:
            for seed in range(5):
                gain = bapo_gain if arm.startswith("bapo") and cell != "on_policy" else 0.0
                accuracy = 0.7 - drop + gain + noise[seed] + 0.001 * seed * (arm == "clip")
                results[f"{cell}/{arm}/seed{seed}"] = {
                    "accuracy_last": accuracy,
                    "accuracy_best": accuracy + 0.01,
                    "accuracy_curve": [(9, accuracy - 0.1), (19, accuracy)],
                    "rho_before": 0.45 if arm.startswith("bapo") else None,
                    "rho_after": 0.5,
                    "c_low": 0.65 if arm.startswith("bapo") else None,
                    "c_high": 1.5 if arm.startswith("bapo") else None,
                    "clip_low_frac": 0.01,
                    "clip_high_frac": 0.001,
                    "entropy_last": 0.05 + 0.1 * drop,
                    "grad_spikes": 0 if s._dual_clip(s.ARMS[arm]) else 2 + seed % 2,
                    "collapses": 0,
                    "wall_s": 60.0,
                    "series": {k: [0.1, 0.2] for k in ("entropy", "rho", "grad_norm")},
                }
    return results


def test_claims_follow_the_numbers():
    results = _synthetic(bapo_gain=0.08)
    table, sections, accuracy = offpolicy_report.claims(
        results, "on_policy", ["moderate", "hard"], "hard", s.BASELINES
    )
    assert len(accuracy) == 2 * 2 * 3  # cells x BAPO arms x baselines
    lines = table.splitlines()
    assert "degrades" in lines[2] and lines[2].endswith("| holds |")
    assert "more accurate" in lines[3] and lines[3].endswith("| holds |")
    # Equal entropies across arms in every run: nothing to tell apart.
    assert "entropy" in lines[4] and "noise" in lines[4]
    # accuracy, entropy, rho and spikes compare BAPO with each baseline
    assert sections.count("| bapo_paper @ hard - clip |") == 4
    none = offpolicy_report.claims(
        _synthetic(bapo_gain=0.0), "on_policy", ["moderate", "hard"], "hard", s.BASELINES
    )[0].splitlines()
    assert none[3].endswith("| cannot be told apart from noise |")


def test_report_renders_every_section(tmp_path):
    results = _synthetic(bapo_gain=0.05)
    results.update(
        {
            f"hard/{a}/seed{k}": results[f"hard/bapo_paper/seed{k}"]
            for a in s.ABLATIONS
            for k in range(5)
        }
    )
    text = offpolicy_report.render(
        plan_text=s.plan_text(s.STUDY),
        command="python -m experiments.offpolicy_study",
        commit="abc1234",
        date="2026-11-27",
        wall_s=3600.0,
        workers=2,
        warm_accuracy=0.438,
        results=results,
        cells=["on_policy", "moderate", "hard"],
        arms=list(s.ARMS),
        baselines=s.BASELINES,
        ablations=list(s.ABLATIONS),
        ablation_cell="hard",
        dual_clip_arms=["dual_clip", "bapo_code"],
        start_bounds=(0.6, 1.2),
        rho0=0.4,
        exploration=offpolicy_report.exploration_report(
            {"w600_E1/clip/seed0": results["hard/clip/seed0"]},
            {600: 0.438},
            command="python -m experiments.offpolicy_study --explore",
            commit="abc1234",
            date="2026-11-26",
            cpu="x86_64-avx2",
            wall_s=60.0,
            setup="- Task: ...",
        ),
        quick={"quick/clip/seed0": {"accuracy_last": 0.25}},
        cpu="x86_64-avx2",
        figure_name="offpolicy_study_v1.png",
    )
    for heading in ("## Setup", "## Claims", "## Cell `hard`", "## Ablations", "## How the hard"):
        assert heading in text
    assert "abc1234" in text and "3600 s" in text and '"accuracy_last": 0.25' in text
    assert "CPU class, `x86_64-avx2`" in text
    reading = text.split("## What the tables say\n\n")[1].split("\n\n")[0].splitlines()
    # Every number below is one the tables show: means over the 5 seeds of _synthetic.
    assert reading[0] == (
        f"- `clip` ends at {0.7 + np.mean(NOISE) + 0.002:.3f} on-policy, "
        f"{0.65 + np.mean(NOISE) + 0.002:.3f} at `moderate`, "
        f"{0.6 + np.mean(NOISE) + 0.002:.3f} at `hard`."
    )
    assert "Off-policy, 12 of the 12 BAPO-minus-baseline differences" in reading[3]
    assert "(`hard`: bapo_paper c_low 0.650, c_high 1.500; bapo_code c_low 0.650" in reading[4]
    assert reading[4].endswith("by at most 0.050 in any off-policy cell.")  # > 0.01: no reading
    assert "between 0.500 and 0.500" in reading[5] and "does not arise" in reading[5]
    assert "every arm's entropy (0.0600 to 0.0600) ends above the on-policy 0.0500" in reading[6]
    assert "(dual_clip, bapo_code) have no gradient-norm spike in any cell" in reading[7]
    assert "up to 2.4 per run" in reading[7] and "not with fixed or adaptive" in reading[7]
    assert reading[8].startswith("- Ablations: 0 of the 5 differ")
    study_report.figure(
        results, ["on_policy", "hard"], ["clip", "bapo_paper"], str(tmp_path / "f.png"), "t"
    )
    assert (tmp_path / "f.png").stat().st_size > 0


def test_workers_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        import sys

        argv = sys.argv
        sys.argv = ["offpolicy_study", "--workers", "0", "--out-dir", "/nonexistent/x"]
        try:
            s.main()
        finally:
            sys.argv = argv
    assert "--workers must be >= 1, got 0" in capsys.readouterr().err


def test_the_committed_report_was_made_with_this_plan():
    """`make study-quick` refuses a report made with another configuration; a change of a run
    config default shows here first, in the default suite: re-record the plan (when the change
    cannot move the study's numbers) or regenerate the report."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "docs", "offpolicy_study_v1.json"), encoding="utf-8") as f:
        recorded = json.load(f)
    assert recorded["plan"] == s.plan_record(s.STUDY)
