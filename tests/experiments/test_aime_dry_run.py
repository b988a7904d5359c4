"""`python -m experiments.aime_7b --dry-run` / `aime_32b --dry-run` on CPU: the real train step
compiles for the mesh on simulated devices and one toy RL iteration runs end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "BAPO_RUN_ENV_READY")}
    env["JAX_PLATFORMS"] = "cpu"
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500
    )


@pytest.mark.parametrize(
    "experiment, devices",
    [
        pytest.param("aime_7b", 8, marks=pytest.mark.slow),
        pytest.param("aime_32b", 32, marks=pytest.mark.slow),
    ],
)
def test_dry_run_compiles_for_the_mesh_and_runs_one_rl_step(tmp_path, experiment, devices):
    proc = _run("-m", f"experiments.{experiment}", "--dry-run", "--out-dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "dry_run.json").read_text())
    real = report["real_step"]
    assert real["rows_per_update"] == 64 * 16 and real["seq_len"] == 1024 + 8192
    assert real["fits"], real  # the preset mesh holds the real model's step
    step = report["stand_in_step"]
    assert step["updates"] == 1 and step["optimizer_step"] == 1
    assert 0.6 <= step["c_low"] <= 0.9 and step["c_high"] >= 1.2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and rows[0]["time/sync"] >= 0
    assert os.listdir(tmp_path / "checkpoints")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["mesh"] == experiment.split("_")[1]
    assert f"simulates {devices}" not in proc.stderr  # dry runs do not print the CPU note


def test_a_mesh_that_does_not_divide_the_heads_is_refused_before_compute(tmp_path):
    # Qwen2.5-0.5B has 14 query / 2 KV heads; the 32b mesh splits heads 4 ways.
    proc = _run(
        "-m", "experiments.aime_7b", "--dry-run", "--mesh", "32b", "--out-dir", str(tmp_path),
        "model.preset=qwen2.5-0.5b",
    )  # fmt: skip
    assert proc.returncode == 2
    assert "mesh: MeshConfig.tensor=4 does not divide the model's num_attention_heads=14" in (
        proc.stderr
    )
    assert not (tmp_path / "dry_run.json").exists()


def test_an_unknown_override_is_refused_naming_the_key(tmp_path):
    proc = _run("-m", "experiments.aime_7b", "--dry-run", "trainer.rollout.temprature=0.7")
    assert proc.returncode == 2
    assert "trainer.rollout.temprature" in proc.stderr
