"""The main job's CI checks (`--min-gain`, `--max-logprob-diff`, `--max-version-mismatches`):
what each fails on, by hand on summaries, and for real: a run whose learning rate is 1e-12 (an
override) gains nothing and exits 1 naming the check."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import pytest

from experiments import cpu_arithmetic as main_job
from tests.child_env import child_env
from tests.experiments.vllm_main_job import REPO


def _args(**kw) -> argparse.Namespace:
    base = {"min_gain": 10.0, "max_logprob_diff": 1e-3, "max_version_mismatches": 0}
    return argparse.Namespace(**{**base, **kw})


def _summary(points=20.0, diff=3e-7, mismatches=0) -> dict:
    behaviour = {"version_mismatch_tokens": mismatches}
    if diff is not None:
        behaviour["logprob_abs_diff_mean"] = diff
    return {"improvement_points": points, "behaviour": behaviour}


def test_each_check_fails_alone_and_names_itself():
    assert main_job.check_summary(_summary(), _args()) == []
    (low,) = main_job.check_summary(_summary(points=9.9), _args())
    assert "RL gained 9.9 points, fewer than --min-gain 10.0" in low
    (far,) = main_job.check_summary(_summary(diff=2e-3), _args())
    assert "above --max-logprob-diff 0.001" in far
    (unmeasured,) = main_job.check_summary(_summary(diff=None), _args())
    assert "measured no log-prob agreement" in unmeasured
    (older,) = main_job.check_summary(_summary(mismatches=3), _args())
    assert "3 trained tokens were sampled by an older version" in older
    none = _args(min_gain=None, max_logprob_diff=None, max_version_mismatches=None)
    assert main_job.check_summary(_summary(points=-5.0, diff=None, mismatches=9), none) == []


@pytest.mark.slow  # a whole (quick) run: in `make test-slow` (CI runs it)
def test_a_run_that_cannot_learn_fails_the_gain_check(tmp_path):
    cmd = [sys.executable, "-m", "experiments.cpu_arithmetic", "--quick", "--no-reexec"]
    # The smallest learning rate the optimizer takes (it refuses 0): the weights barely move.
    cmd += ["--out-dir", str(tmp_path), "--min-gain", "1", "trainer.optimizer.learning_rate=1e-12"]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr[-3000:]
    found = re.search(r"error: RL gained (\S+) points, fewer than --min-gain 1\.0", proc.stderr)
    assert found and float(found.group(1)) < 1, proc.stderr[-3000:]


def test_records_are_of_the_default_job_only(tmp_path):
    """`--record` / `--check-record` with --quick or an override: refused while the options
    are read (exit 2, before the warm start), naming both."""
    cmd = [sys.executable, "-m", "experiments.cpu_arithmetic", "--no-reexec", "--check-record"]
    cmd += ["--out-dir", str(tmp_path), "--quick", "trainer.steps=5"]
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "the records are of the default job" in proc.stderr
    assert "quick=True, overrides=['trainer.steps=5']" in proc.stderr
    assert not any(tmp_path.iterdir())  # nothing ran


def test_lora_applies_its_overrides_before_the_users():
    ap = argparse.Namespace(
        engine="embedded", quick=False, lora=True, vllm_python=None, vllm_url=[],
        overrides=["trainer.optimizer.learning_rate=5e-4"],
    )  # fmt: skip
    config = main_job.resolve(ap)
    assert (config.model.lora_rank, config.model.lora_alpha) == (8, 16.0)
    assert config.trainer.optimizer.learning_rate == 5e-4  # the user's override wins
    plain = main_job.resolve(argparse.Namespace(**{**vars(ap), "lora": False, "overrides": []}))
    assert plain.model.lora_rank == 0 and plain.trainer.optimizer.learning_rate == 1e-4
