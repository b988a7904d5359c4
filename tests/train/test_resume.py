"""Resume is exact: a run SIGKILLed mid-update, mid-rollout or mid-save and then resumed ends
with the same metrics rows and parameters as an uninterrupted run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.child_env import child_env

pytestmark = pytest.mark.slow  # long: in `make test-slow` (CI runs it)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Wall-clock measurements and compile counts (per process) differ between any two runs;
# everything else must match exactly.
_TIMING = ("time/", "compile/", "tokens_per_s", "model_flops_per_s", "mfu", "overlap/")


def _run(out_dir, kill: str | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tests.train.resume_worker", str(out_dir)]
    if kill:
        cmd += ["--kill", kill]
    return subprocess.run(
        cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900
    )


def _result(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    rows = [{k: v for k, v in r.items() if not k.startswith(_TIMING)} for r in rows]
    params = dict(np.load(os.path.join(out_dir, "final_params.npz")))
    with open(os.path.join(out_dir, "calls.json")) as f:
        calls = json.load(f)
    return rows, params, calls


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted")
    proc = _run(out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _result(out)


@pytest.mark.parametrize(
    "where",
    [
        # 6 iterations x E=4 updates, checkpoints after iterations 2, 4 and 6: the first update
        # after the 2nd save started, in iteration 5.
        "update",
        # The first rollout call after the 2nd save started: partial rollouts in flight and a
        # stale batch queued.
        pytest.param("rollout", marks=pytest.mark.slow),
        # The 2nd of 3 async saves is still being written.
        pytest.param("save", marks=pytest.mark.slow),
    ],
)
def test_killed_and_resumed_run_equals_uninterrupted(tmp_path, uninterrupted, where):
    want_rows, want_params, want_calls = uninterrupted
    want_calls = dict(want_calls)  # the fixture's, shared by the cases
    at_save = want_calls.pop("at_save")
    assert want_calls == {"update": 24, "rollout": want_calls["rollout"], "save": 3}
    assert [c["update"] for c in at_save] == [8, 16, 24]
    # Past a committed checkpoint: a save waits for the one before it to be committed.
    kill_at = 2 if where == "save" else at_save[1][where] + 1
    assert kill_at <= want_calls[where], (where, kill_at, want_calls)
    killed = _run(tmp_path, f"{where}:{kill_at}")
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert not (tmp_path / "final_params.npz").exists()
    resumed = _run(tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["resumed_from"] > 0  # a checkpoint was restored, not a fresh run redone
    rows, params, _ = _result(tmp_path)
    assert [r["step"] for r in rows] == list(range(6))
    assert rows == want_rows
    assert params.keys() == want_params.keys()
    for key in params:
        np.testing.assert_array_equal(params[key], want_params[key], err_msg=key)
