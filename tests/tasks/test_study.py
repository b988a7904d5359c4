"""A study run's measures from hand-made metrics rows; the child-process scheduler (pinning,
one XLA thread, resume, failure) with plain Python children."""

import json
import os
import sys

import chex
import pytest

from bapo_jax.tasks import study

RULE = study.CollapseRule(entropy_below=0.05, accuracy_drop=0.10)


def _rows(entropy, grad, evals):
    rows = []
    for i, (h, g) in enumerate(zip(entropy, grad, strict=True)):
        row = {"step": i, "entropy": h, "grad_norm": g, "rho": 0.5, "reward/mean": 0.1 * i}
        row.update({"clip_low_frac": 0.01 * i, "clip_high_frac": 0.0})
        if i in evals:
            row["eval/accuracy"] = evals[i]
        rows.append(row)
    return rows


def test_measures_hand_case():
    # grad norms: median 1.0, so 5.0 is not a spike (not above 5x) and 5.5 is.
    rows = _rows(
        entropy=[0.10, 0.09, 0.08, 0.04, 0.03, 0.06, 0.07, 0.02],
        grad=[1.0, 1.0, 5.0, 5.5, 0.9, 1.0, 1.1, 1.0],
        evals={1: 0.50, 3: 0.62, 5: 0.52, 7: 0.51},
    )
    m = study.measures(rows, RULE)
    assert m["accuracy_curve"] == [(1, 0.50), (3, 0.62), (5, 0.52), (7, 0.51)]
    assert m["pass_at_8_curve"] == []  # not evaluated
    rows[3]["eval/pass@8"], rows[7]["eval/pass@8"] = 0.8, 0.9
    assert study.measures(rows, RULE)["pass_at_8_curve"] == [(3, 0.8), (7, 0.9)]
    assert (m["accuracy_last"], m["accuracy_best"]) == (0.51, 0.62)
    assert m["grad_spikes"] == 1
    assert m["collapse_entropy"] == 3  # 0.04, 0.03, 0.02 < 0.05
    assert m["collapse_accuracy"] == 2  # 0.52 and 0.51 are >= 10 points below 0.62
    assert m["collapses"] == 5
    chex.assert_trees_all_close(
        (m["entropy_first"], m["entropy_last"], m["entropy_min"]), (0.095, 0.045, 0.02)
    )
    chex.assert_trees_all_close(m["clip_low_frac"], 0.035)
    assert m["rho_before"] is None  # a fixed-clip run logs no search
    assert m["iterations"] == 8 and m["series"]["entropy"][3] == 0.04
    # From a start at 0.70 every evaluation is a drop of >= 10 points but 0.62 (8 points).
    assert study.measures(rows, RULE, start_accuracy=0.70)["collapse_accuracy"] == 3


def test_measures_read_the_last_sampled_evaluation_and_the_balance_means():
    rows = _rows([0.1, 0.1, 0.1], [1.0, 1.0, 1.0], {1: 0.5, 2: 0.6})
    rows[1].update({"eval/pass@8": 0.7, "eval/distinct_correct": 1.2})
    rows[2].update({"eval/pass@8": 0.8, "eval/distinct_correct": None})  # NaN, stored as null
    for row, ratio in zip(rows, (1.5, 1.3, None), strict=True):
        row["balance/length_ratio"] = ratio
    m = study.measures(rows, RULE)
    assert (m["pass_at_8_last"], m["distinct_correct_last"]) == (0.8, 1.2)
    assert m["sampled_accuracy_last"] is None and m["reached"] is None
    assert m["length_ratio"] == pytest.approx(1.4)


def test_measures_reads_bapo_rho_before_and_refuses_no_rows():
    rows = _rows([0.1, 0.1], [1.0, 1.0], {1: 0.5})
    rows[0]["rho_before"], rows[1]["rho_before"] = 0.3, 0.5
    chex.assert_trees_all_close(study.measures(rows, RULE)["rho_before"], 0.4)
    with pytest.raises(ValueError, match="no metrics rows"):
        study.measures([], RULE)


def test_cell_and_collapse_rule_name_bad_fields():
    with pytest.raises(ValueError, match="updates must be an int >= 1, got 0"):
        study.Cell("x", updates=0)
    with pytest.raises(ValueError, match="staleness must be an int >= 0, got -1"):
        study.Cell("x", updates=1, staleness=-1)
    with pytest.raises(ValueError, match="learning_rate must be None or a finite number > 0"):
        study.Cell("x", updates=1, learning_rate=0.0)
    with pytest.raises(ValueError, match="epochs must be an int >= 1 dividing updates = 8"):
        study.Cell("x", updates=8, epochs=3)
    with pytest.raises(ValueError, match="prompts_per_step must be None or an int >= 1"):
        study.Cell("x", updates=1, prompts_per_step=0)
    assert study.Cell("x", updates=8, epochs=2).mini_batches == 4
    with pytest.raises(ValueError, match=r"accuracy_drop must be in \(0, 1\], got 0"):
        study.CollapseRule(entropy_below=0.1, accuracy_drop=0)


# A child that records what it ran with: its CPU affinity and XLA flags.
CHILD = """
import json, os, sys
directory = sys.argv[1]
if os.path.exists(os.path.join(directory, "fail")):
    print("the child failed on purpose")
    sys.exit(3)
record = {
    "cores": sorted(os.sched_getaffinity(0)),
    "xla_flags": os.environ["XLA_FLAGS"],
    "cache": os.environ.get("JAX_COMPILATION_CACHE_DIR"),
}
with open(os.path.join(directory, "done.json"), "w") as f:
    json.dump(record, f)
"""


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_run_all_pins_each_child_to_one_core_and_thread(tmp_path):
    # A study's child calls pin_to_core first thing.
    pinned = "from bapo_jax.tasks import study\nstudy.pin_to_core()\n" + CHILD

    def command(directory):
        return [sys.executable, "-c", pinned, directory]

    jobs = [(f"run{i}", str(tmp_path / f"run{i}")) for i in range(3)]
    cache = str(tmp_path / "cache")
    seconds = study.run_all(jobs, command, workers=2, compile_cache=cache, log=lambda _: None)
    assert sorted(seconds) == ["run0", "run1", "run2"]
    cores = sorted(os.sched_getaffinity(0))
    for _, directory in jobs:
        with open(os.path.join(directory, study.DONE)) as f:
            record = json.load(f)
        assert len(record["cores"]) == 1 and record["cores"][0] in cores
        assert "--xla_cpu_multi_thread_eigen=false" in record["xla_flags"]
        assert record["cache"] == cache
    # Finished runs are not run again: a resumed study.
    again = study.run_all(jobs, command, workers=2, log=lambda _: None)
    assert again == {"run0": 0.0, "run1": 0.0, "run2": 0.0}


def test_run_all_stops_on_a_failed_child_with_its_log(tmp_path):
    failing = tmp_path / "bad"
    failing.mkdir()
    (failing / "fail").write_text("")
    jobs = [("bad", str(failing)), ("good", str(tmp_path / "good"))]

    def command(directory):
        return [sys.executable, "-c", CHILD, directory]

    with pytest.raises(RuntimeError, match=r"(?s)study run bad failed.*failed on purpose"):
        study.run_all(jobs, command, workers=1, log=lambda _: None)
    assert not (failing / study.DONE).exists()
    with pytest.raises(ValueError, match="workers must be an int >= 1, got 0"):
        study.run_all(jobs, command, workers=0)


def test_measures_prefers_bapo_rho_fraction_over_its_target_units():
    rows = _rows([0.1, 0.1], [1.0, 1.0], {1: 0.5})
    rows[0]["rho"], rows[1]["rho"] = 1.0, 9.0  # a P / N target: not averaged as a fraction
    rows[0]["rho_fraction"], rows[1]["rho_fraction"] = 0.5, 0.75
    rows[0]["rho_fraction_before"], rows[1]["rho_fraction_before"] = 0.25, 0.75
    rows[0]["rho_before"], rows[1]["rho_before"] = 1 / 3, 3.0
    rows[0]["c_low"], rows[1]["c_low"] = 0.6, 0.7
    m = study.measures(rows, RULE)
    chex.assert_trees_all_close((m["rho_after"], m["rho_before"]), (0.625, 0.5))
    chex.assert_trees_all_close(m["c_low"], 0.65)
    assert m["c_high"] is None
    assert m["series"]["rho"] == [0.5, 0.75]
    rows[1]["rho_fraction"] = None  # a NaN, as the metrics writer stores it: not counted
    chex.assert_trees_all_close(study.measures(rows, RULE)["rho_after"], 0.5)
    for row in rows:
        del row["rho"], row["rho_fraction"]
    assert study.measures(rows, RULE)["rho_after"] is None


def test_wall_time_adds_up_over_invocations(tmp_path):
    assert study.add_wall_time(str(tmp_path), 100.0) == 100.0
    assert study.add_wall_time(str(tmp_path), 20.5) == 120.5
    assert study.add_wall_time(str(tmp_path), 9.5, commit="abc1234") == 130.0
    record = study.read_json(str(tmp_path / "wall.json"))
    assert record["invocations"] == [{"commit": "abc1234", "seconds": 9.5}]


@pytest.mark.parametrize(
    "flags, expected",
    [
        ("fpu sse2 avx fma avx2 avx512f avx512dq avx512_bf16", "x86_64-avx512"),
        ("fpu sse2 avx fma avx2", "x86_64-avx2"),
        ("fpu sse2 sse4_2", "x86_64"),
    ],
)
def test_cpu_class_reads_the_widest_vector_set(monkeypatch, flags, expected):
    monkeypatch.setattr(study.platform, "machine", lambda: "x86_64")
    cpuinfo = (
        f"processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC\n"
        f"flags\t\t: {flags}\n\nprocessor\t: 1\n"
    )
    assert study.cpu_class(cpuinfo) == expected
    # an Intel AVX-512 host computes other trajectories: a class of its own
    intel = cpuinfo.replace("AuthenticAMD", "GenuineIntel")
    assert study.cpu_class(intel) == expected + ("-intel" if "avx512f" in flags else "")


def test_cpu_class_names_other_machines(monkeypatch):
    monkeypatch.setattr(study.platform, "machine", lambda: "aarch64")
    assert study.cpu_class("flags\t: fp asimd") == "aarch64"
