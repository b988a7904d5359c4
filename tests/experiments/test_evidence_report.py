"""The study v2's comparisons and verdicts on hand-made measures."""

import numpy as np
import pytest
from scipy import stats as scipy_stats

from experiments import evidence_report as r

SEEDS = (0, 1, 2, 3)


def _results(cells: dict[str, dict[str, list[float]]], measure="accuracy_last"):
    return {
        f"{cell}/{arm}/seed{s}": {measure: v[s]}
        for cell, arms in cells.items()
        for arm, v in arms.items()
        for s in range(len(v))
    }


def test_compare_is_the_paired_t_test_and_interval():
    a, b = np.array([0.5, 0.6, 0.55, 0.7]), np.array([0.45, 0.5, 0.52, 0.6])
    out = r.compare(a, b, margin=0.03)
    assert out["diff"] == pytest.approx(0.07)
    assert out["p"] == pytest.approx(scipy_stats.ttest_rel(a, b).pvalue)
    ci = scipy_stats.ttest_rel(a, b).confidence_interval()
    assert (out["low"], out["high"]) == pytest.approx((ci.low, ci.high))
    assert out["tost_p"] > 0.05  # 0.07 is no equivalence within 0.03
    assert out["a"] == a.tolist() and out["n"] == 4


@pytest.mark.parametrize(
    "diff, p_holm, tost_p, gate, want",
    [
        (0.05, 0.01, 0.9, False, "supported"),
        (-0.05, 0.01, 0.9, False, "refuted"),
        (0.001, 0.8, 0.01, True, "refuted"),  # equivalent, precondition met
        (0.001, 0.8, 0.01, False, "undetermined (detectable: 0.120)"),  # gate not met
        (0.02, 0.3, 0.4, True, "undetermined (detectable: 0.120)"),
    ],
)
def test_verdicts(diff, p_holm, tost_p, gate, want):
    row = {"diff": diff, "p_holm": p_holm, "tost_p_holm": tost_p, "detectable": 0.12}
    assert r.verdict(row, gate) == want


def test_primaries_adjust_over_the_family_and_read_the_gate():
    results = _results(
        {"stale": {"clip": [0.3, 0.32, 0.31, 0.29], "bapo": [0.4, 0.43, 0.39, 0.41]}}
    )
    declared = [r.Primary("acc", "stale", "bapo", "accuracy_last", 0.03, baseline="clip")]
    (row,) = r.primaries(results, declared, SEEDS, {"stale": {"paper": True}})
    assert row["p_holm"] == pytest.approx(row["p"]) and row["verdict"] == "supported"
    assert row["gate_met"] and row["diff"] == pytest.approx(0.1025)


def test_a_family_detects_at_holms_first_step():
    """With four primaries, the detectable effect is the one at alpha / 4 (Holm's first step),
    larger than a lone test's; TOST p's are adjusted as their own family."""
    arms = {"clip": [0.3, 0.32, 0.31, 0.29], "bapo": [0.31, 0.35, 0.30, 0.31]}
    results = _results({c: arms for c in ("a", "b", "c", "d")})
    declared = [r.Primary(c, c, "bapo", "accuracy_last", 0.03) for c in ("a", "b", "c", "d")]
    rows = r.primaries(results, declared, SEEDS, {})
    alone = r.compare(np.asarray(arms["bapo"]), np.asarray(arms["clip"]), 0.03)
    for row in rows:
        assert row["detectable"] > alone["detectable"]
        assert row["tost_p_holm"] == pytest.approx(min(1.0, 4 * alone["tost_p"]))


def test_factorial_main_effects_and_interaction_by_seed():
    # adaptive adds 0.1 without the dual clip, 0.2 with it; the dual clip adds 0 / 0.1
    base = [0.3, 0.31, 0.32, 0.33]
    arms = {
        "clip": base,
        "dual": base,
        "bapo": [x + 0.1 for x in base],
        "bapo_dual": [x + 0.2 for x in base],
    }
    results = _results({"stale": arms})
    out = r.factorial(
        results,
        "stale",
        "accuracy_last",
        SEEDS,
        {(0, 0): "clip", (0, 1): "dual", (1, 0): "bapo", (1, 1): "bapo_dual"},
    )
    assert out["adaptive"]["diff"] == pytest.approx(0.15)
    assert out["dual_clip"]["diff"] == pytest.approx(0.05)
    assert out["interaction"]["diff"] == pytest.approx(0.1)


def test_staleness_costs_and_collapses_against_the_control():
    results = _results(
        {
            "stale": {"clip": [0.2, 0.3, 0.25, 0.3], "bapo": [0.3, 0.32, 0.3, 0.31]},
            "fresh": {"clip": [0.35, 0.36, 0.34, 0.33], "bapo": [0.35, 0.36, 0.34, 0.33]},
            "on_policy": {"clip": [0.35, 0.4, 0.36, 0.3]},
        }
    )
    out = r.staleness(results, "stale", "fresh", ["clip", "bapo"], "accuracy_last", SEEDS)
    assert out["clip: stale - fresh"]["diff"] == pytest.approx(-0.0825)
    assert out["bapo - clip: cost difference"]["diff"] == pytest.approx(0.045)
    counts = r.collapses(results, "on_policy", "clip", SEEDS)
    # stale clip: 0.2 vs 0.35, 0.3 vs 0.4 (exactly 10 points) and 0.25 vs 0.36; fresh: none
    assert counts["stale/clip"] == 3 and counts["stale/bapo"] == 0
    assert counts["fresh/clip"] == 0 and "on_policy/clip" not in counts


def test_the_report_shows_the_gate_the_verdicts_and_every_table():
    results = _results(
        {
            "stale": {"clip": [0.3, 0.32, 0.31, 0.29], "bapo": [0.4, 0.43, 0.39, 0.41]},
            "on_policy": {"clip": [0.5, 0.5, 0.5, 0.5]},
        }
    )
    for name, m in results.items():
        m.update({"rho_r1": 0.45, "reached": None})
        m["accuracy_curve"] = [(9, m["accuracy_last"] - 0.1), (19, m["accuracy_last"])]
        m["pass_at_8_curve"] = [(9, 0.7), (19, 0.8)] if name.startswith("stale") else []
    declared = [r.Primary("BAPO trains better", "stale", "bapo", "accuracy_last", 0.03)]
    gate = {"mean": {k: 0.5 for k in ("length_ratio_0", "rho_r1_0", "rho_r1_pi_0")}}
    gate["mean"].update(zero_variance_0=0.2, length_ratio=1.3, rho_r1=0.46)
    gate["mean"].update(below_paper=0.05, below_recipe=0.9)
    gate["met"] = {"paper": False, "recipe": True}
    text = r.render(
        header="# H",
        setup="S",
        gates={"stale": gate},
        claims=r.primaries(results, declared, SEEDS, {"stale": gate["met"]}),
        tables={"T": r.table(results, "stale", ["clip", "bapo"], "accuracy_last", SEEDS)},
        extra={},
        collapse_counts=r.collapses(results, "on_policy", "clip", SEEDS),
        mechanism=r.mechanism_means(results, SEEDS),
        seeds=SEEDS,
        curve_by_run=r.curves(results, (0.25, 0.6)),
        rho0={"paper": 0.4, "recipe": 0.5},
        tried=[{"command": "python -m x --pilot --cap 96", "gate": {"stale_cap96": gate}}],
    )
    assert (
        "| `stale` | 0.50 | 0.500 | 0.500 | 0.20 | 1.30 | 0.460 | 0.05 | 0.90 | no | yes |" in text
    )
    assert "paper: not met | supported |" in text  # supported needs no gate
    assert "| bapo | +0.103 |" in text
    assert "| `stale/clip` | 4 |" in text  # 20 points below the control on every seed
    assert "| `stale/bapo` | 0.450 | - |" in text  # rho_r1 logged, rho_before not
    assert "Tried before, in a pilot (`python -m x --pilot --cap 96`, 3 seeds):" in text
    assert "| `stale_cap96` | 0.50 |" in text
    # curves from the warm start: clip's mean end accuracy 0.305, 10 points lower at it. 10
    assert "| `stale` | it. 0 | it. 10 | it. 20 |" in text
    assert "| clip | 0.250 / 0.600 | 0.205 / 0.700 | 0.305 / 0.800 |" in text
    assert "| clip | 0.250 / 0.600 | 0.400 | 0.500 |" in text  # on_policy: no pass@8 logged
    # the claim in words, with its gate's share
    assert "- **BAPO trains better**: supported. `bapo` - `clip` in accuracy_last" in text
    assert "below 0.4 in at least half of the baseline's updates) does not hold: 5% of" in text
