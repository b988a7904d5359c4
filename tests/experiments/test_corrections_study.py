"""The corrections comparison (`experiments.corrections_study`): its plan's runs, and its paired
statistics against scipy on hand-made per-seed values."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as scipy_stats

from experiments import corrections_study as cs


def test_every_arm_runs_the_stale_partial_regime_with_its_own_offpolicy_settings():
    specs = cs.PLAN.specs()
    assert len(specs) == len(cs.ARMS) * 5
    for spec in specs:
        config = cs.PLAN.config(spec, "/warm/hf")
        off = config.trainer.offpolicy
        assert (off.staleness, off.partial_budget) == (2, cs.PARTIAL_BUDGET)
        assert config.trainer.algorithm.mini_batches == 8 and config.trainer.steps == 30
        assert off.max_version_gap == (3 if spec.arm == "bapo_gap3" else None)
        assert config.trainer.rollout.seed == spec.seed
    lags = cs.PLAN.config(next(s for s in specs if s.arm == "bapo_lags4"), "/warm/hf")
    assert lags.trainer.algorithm.bapo.lag_buckets == 4
    masked = cs.PLAN.config(next(s for s in specs if s.arm == "bapo_is_mask"), "/warm/hf")
    assert masked.trainer.algorithm.ratio_base == "recomputed"
    assert masked.trainer.algorithm.bapo.is_mode == "token_mask"


def test_the_paired_statistics_by_hand():
    rng = np.random.default_rng(0)
    results = {}
    for arm in cs.ARMS:
        shift = 0.05 if arm == "bapo" else 0.0
        for seed in cs.PLAN.seeds:
            base = 0.5 + 0.01 * seed
            results[f"stale_partial/{arm}/seed{seed}"] = {
                key: base + shift + rng.normal(0, 0.01) for key in cs.MEASURES
            }
    table = cs.compare(results, cs.PLAN)
    row, clip = table["accuracy_last"]["bapo"], table["accuracy_last"]["clip"]
    diffs = row["values"] - clip["values"]
    assert row["diff"] == pytest.approx(diffs.mean())
    half = scipy_stats.t.ppf(0.975, 4) * diffs.std(ddof=1) / np.sqrt(5)
    assert (row["low"], row["high"]) == pytest.approx((diffs.mean() - half, diffs.mean() + half))
    assert row["p"] == pytest.approx(scipy_stats.ttest_rel(row["values"], clip["values"]).pvalue)
    ps = [table["accuracy_last"][a]["p"] for a in cs.ARMS if a != "clip"]
    m = len(ps)
    ranked = sorted(range(m), key=lambda i: ps[i])
    running, holm = 0.0, [0.0] * m
    for rank, i in enumerate(ranked):  # Holm by hand
        running = max(running, min(1.0, (m - rank) * ps[i]))
        holm[i] = running
    got = [table["accuracy_last"][a]["p_holm"] for a in cs.ARMS if a != "clip"]
    assert got == pytest.approx(holm)
    assert row["low"] > 0 and table["accuracy_last"]["bapo"]["p_holm"] < 0.05
    text = cs.report_text(table, cs.PLAN, command="cmd", wall_s=1.0)
    assert "| `bapo` |" in text and "(baseline)" in text
