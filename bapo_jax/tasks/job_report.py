"""What a CPU job's run directory says: its metrics rows, how far BAPO's bounds moved, the
loop's timings and the behaviour log-prob agreement (the job's summary and the studies read
them)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np


def read_rows(out_dir: str) -> list[dict[str, Any]]:
    with open(os.path.join(out_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def bounds_summary(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """How far BAPO's searched bounds moved from their starts over the run."""
    c_low = [r["c_low"] for r in rows if "c_low" in r]
    c_high = [r["c_high"] for r in rows if "c_high" in r]
    if not c_low:
        return {}
    return {
        "c_low_min": min(c_low),
        "c_low_max": max(c_low),
        "c_high_min": min(c_high),
        "c_high_max": max(c_high),
    }


_TIMES = {
    "generate_s": "time/generate",
    "sync_write_s": "time/sync_write",
    "sync_load_s": "time/sync_load",
    "sync_s": "time/sync",
    "update_s": "time/update",
    "eval_s": "time/eval",
}


def loop_report(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per-iteration means of the loop's timings, the share of generation the update hid, and
    the behaviour log-prob agreement and version mismatches over every trained token."""
    out: dict[str, Any] = {}
    for name, key in _TIMES.items():
        values = [r[key] for r in rows if key in r]
        if values:
            out[f"mean_{name}"] = round(float(np.mean(values)), 4)
    generated = sum(r.get("overlap/generation_s", 0.0) for r in rows)
    if generated > 0:
        hidden = sum(r.get("overlap/hidden_s", 0.0) for r in rows)
        out["generation_hidden_share"] = round(hidden / generated, 4)
    trained = sum(r.get("trained_tokens", 0.0) for r in rows)
    checked = sum(r.get("agreement/tokens", 0.0) for r in rows)
    report: dict[str, Any] = {"trained_tokens": int(trained)}
    if checked:
        total = sum(
            r["agreement/mean_abs"] * r["agreement/tokens"] for r in rows if "agreement/tokens" in r
        )
        report["logprob_abs_diff_mean"] = total / checked
        report["logprob_abs_diff_max"] = max(
            r["agreement/max_abs"] for r in rows if "agreement/max_abs" in r
        )
        report["logprob_checked_tokens"] = int(checked)
    report["version_mismatch_tokens"] = int(sum(r.get("version_mismatch/tokens", 0) for r in rows))
    return {"timing_per_iteration": out, "behaviour": report}
