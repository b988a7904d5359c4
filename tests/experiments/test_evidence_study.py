"""The study v2's plan, gate and power (by hand, on synthetic rows and results)."""

import dataclasses

import numpy as np
import pytest

from bapo_jax.tasks import study
from bapo_jax.tasks import study_stats as stats
from experiments import evidence_study as e


def test_every_run_of_the_plan_is_a_valid_config_with_its_cell():
    for spec in e.PLAN.specs():
        t = e.PLAN.config(spec, "/warm/hf").trainer
        assert t.algorithm.minibatch == "groups"
        assert t.algorithm.updates_per_batch == spec.cell.updates
    control = e.PLAN.config(study.RunSpec("clip", e.ARMS["clip"], e.CELLS[3], 0), "/w").trainer
    stale = e.PLAN.config(study.RunSpec("clip", e.ARMS["clip"], e.STALE, 0), "/w").trainer
    # the fresh control takes the stale cell's updates: as many, of the same size
    assert control.steps * control.algorithm.updates_per_batch == stale.steps * 8
    assert control.rows_per_batch == stale.rows_per_batch // stale.algorithm.mini_batches
    assert control.offpolicy.staleness == 0 and stale.offpolicy.staleness == 1
    assert e.ARMS["bapo_paper"].bapo.weight_by_behavior_prob  # Eq. 8
    assert e.ARMS["bapo_recipe"].bapo.c_low_max == 0.8 and e.ARMS["bapo_recipe"].bapo.dual_clip
    assert {p.cell for p in e.PRIMARIES} <= {c.name for c in e.CELLS}
    for p in e.PRIMARIES:  # every primary's arms run in its cell
        assert {p.arm, p.baseline} <= {s.arm for s in e.PLAN.specs() if s.cell.name == p.cell}


def _row(length_ratio, rho, below, below_half, **extra):
    return {
        "balance/length_ratio": length_ratio,
        "balance/rho_r1": rho,
        "balance/rho_r1_pi": None if rho is None else rho + 0.05,
        "balance/zero_variance_groups": 0.25,
        "balance/rho_r1_below": below,
        "balance/rho_r1_below_half": below_half,
        "balance/rho_r1_pi_below": 0.0,
        "balance/rho_r1_pi_below_half": below_half / 2,
        **extra,
    }


def test_gate_numbers_read_iteration_zero_and_the_shares_over_the_run():
    rows = [_row(1.6, 0.38, 0.75, 1.0), _row(1.2, 0.46, 0.25, 0.5), _row(None, None, 0.0, 1.0)]
    g = e.gate_numbers(rows)
    assert (g["length_ratio_0"], g["rho_r1_0"], g["zero_variance_0"]) == (1.6, 0.38, 0.25)
    assert g["rho_r1_pi_0"] == pytest.approx(0.43)
    assert g["length_ratio"] == pytest.approx(1.4)  # the iteration without one is skipped
    assert g["below_paper"] == pytest.approx(1 / 3) and g["below_recipe"] == pytest.approx(5 / 6)


def test_power_from_the_pilot_pairs():
    plan = dataclasses.replace(e.PILOT, cells=(e.STALE,), cell_arms={}, seeds=(0, 1, 2))
    clip = [0.30, 0.32, 0.34]
    bapo = [0.35, 0.36, 0.41]  # diffs 0.05, 0.04, 0.07
    results = {
        f"stale/{arm}/seed{s}": {"accuracy_last": v[s], "entropy_last": 0.2 + 0.01 * s}
        for arm, v in (("clip", clip), ("bapo_paper", bapo))
        for s in range(3)
    }
    out = e.power(plan, results)["stale/accuracy_last"]
    sd = np.std([0.05, 0.04, 0.07], ddof=1)
    alpha = e.ALPHA / len(e.PRIMARIES)
    assert out["diff"] == pytest.approx(0.16 / 3) and out["sd"] == pytest.approx(sd)
    assert out["detectable_5"] == pytest.approx(stats.detectable_effect(sd, 5, alpha))
    assert out["seeds_for_effect"] == stats.seeds_needed(sd, e.EFFECT, alpha, most=50)
    assert e.power(plan, results)["stale/entropy_last"]["sd"] == 0.0  # identical diffs


def test_cells_run_their_arms_and_a_wrong_cell_arm_is_refused():
    per_seed = [s for s in e.PLAN.specs() if s.seed == 0]
    by_cell = {c.name: sorted(s.arm for s in per_seed if s.cell.name == c.name) for c in e.CELLS}
    assert by_cell["on_policy"] == ["clip"] and by_cell["stale"] == sorted(e.ARMS)
    assert by_cell["fresh_control"] == ["bapo_paper", "clip"]
    with pytest.raises(ValueError, match="cell_arms"):
        dataclasses.replace(e.PLAN, cell_arms={"stale": ("no_such_arm",)})


def test_the_quick_plan_runs_every_arm_once_with_whole_groups():
    specs = e.QUICK.specs()
    assert sorted(s.arm for s in specs) == sorted(e.ARMS) and {s.seed for s in specs} == {0}
    for spec in specs:
        t = e.QUICK.config(spec, "/warm/hf").trainer
        assert (t.steps, t.rollout.prompts_per_step, t.algorithm.mini_batches) == (3, 8, 2)
        assert t.algorithm.minibatch == "groups" and t.offpolicy.staleness == 1


def test_the_record_was_made_with_this_plan():
    recorded = study.read_json(e.RECORD)
    assert recorded["plan"] == e.base.plan_record(e.PLAN)
    assert recorded["primaries"] == [dataclasses.asdict(p) for p in e.PRIMARIES]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_an_interrupted_study_still_counts_its_time(tmp_path, monkeypatch, stop):
    """Ctrl-C or SIGTERM (SystemExit from the handler): the invocation's seconds are added to
    wall.json before it stops, on top of the earlier invocations'."""
    study.write_json(str(tmp_path / "wall.json"), {"seconds": 100.0})

    def interrupted(plan, out_dir, workers):
        raise stop()

    monkeypatch.setattr(e.base, "run_plan", interrupted)
    with pytest.raises(stop):
        e.timed_runs(e.PLAN, str(tmp_path), 1)
    seconds = study.read_json(str(tmp_path / "wall.json"))["seconds"]
    assert 100.0 < seconds < 110.0


def test_a_redone_report_adds_no_invocation_and_runs_keep_their_start_commit(tmp_path, monkeypatch):
    """An invocation that finds every run finished runs nothing: wall.json is untouched. One
    that runs records the commit it started at, though HEAD may move while it runs."""
    plan = dataclasses.replace(
        e.PLAN, seeds=(0,), cells=e.PLAN.cells[:1], cell_arms={"on_policy": (e.BASELINE,)}
    )
    study.write_json(str(tmp_path / "wall.json"), {"seconds": 100.0})
    heads = iter(["aaaaaaa", "bbbbbbb"])
    monkeypatch.setattr(e, "commit", lambda: next(heads))
    monkeypatch.setattr(e.base, "run_plan", lambda plan, out_dir, workers: {})
    e.timed_runs(plan, str(tmp_path), 1)  # the run is pending: this invocation counts
    wall = study.read_json(str(tmp_path / "wall.json"))
    assert [i["commit"] for i in wall["invocations"]] == ["aaaaaaa"]
    for spec in plan.specs():
        (tmp_path / spec.name).mkdir(parents=True)
        study.write_json(str(tmp_path / spec.name / study.DONE), {"wall_s": 1.0})
    e.timed_runs(plan, str(tmp_path), 1)  # every run finished: nothing added
    assert study.read_json(str(tmp_path / "wall.json")) == wall


def test_an_interim_report_takes_the_cells_whose_runs_all_finished(tmp_path):
    """`--finished-only`: a cell with one run pending is left out, and that run is named."""
    specs = e.PLAN.specs()
    for spec in specs:
        if spec.name != "fresh_control/clip/seed3":
            (tmp_path / spec.name).mkdir(parents=True)
            study.write_json(str(tmp_path / spec.name / study.DONE), {"wall_s": 1.0})
    part, pending = e.finished_part(e.PLAN, str(tmp_path))
    assert pending == ["fresh_control/clip/seed3"]
    assert [c.name for c in part.cells] == ["on_policy", "stale", "partial"]
    assert len(part.specs()) == len(specs) - 20
    assert {p.cell for p in e.PRIMARIES} <= {c.name for c in part.cells}
