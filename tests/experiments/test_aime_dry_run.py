"""`python -m experiments.aime_7b --dry-run` / `aime_32b --dry-run` on CPU: the real train step
compiles for the mesh on simulated devices and one toy RL iteration runs end to end, on the
embedded engine, and (given a vLLM interpreter) through a real vLLM server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str, vllm_python: str | None = None) -> subprocess.CompletedProcess:
    """The command with no vLLM interpreter found, unless `vllm_python` names one."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "BAPO_RUN_ENV_READY")}
    env["JAX_PLATFORMS"] = "cpu"
    env["BAPO_VLLM_PYTHON"] = vllm_python or os.path.join(ROOT, "no-vllm-here", "python")
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
    skipped = report["vllm_stand_in"]["skipped"]  # no interpreter: said plainly
    assert "no vLLM interpreter at" in skipped and "skipped the real vLLM part" in proc.stdout


@pytest.mark.vllm
def test_dry_run_with_a_vllm_interpreter_runs_one_iteration_through_a_real_server(tmp_path):
    """The vLLM part of the dry run (the 7B step's compile on its mesh is the slow test's: here
    one device and a small preset keep the test to the real server's path)."""
    from bapo_jax.rollout import serve

    python = serve.vllm_python()
    proc = _run(
        "-m", "experiments.aime_7b", "--dry-run", "--out-dir", str(tmp_path), "--mesh", "cpu1",
        "--vllm-python", python, "model.preset=tiny-hd64",
        vllm_python=os.path.join(ROOT, "not-this-one"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    part = json.loads((tmp_path / "dry_run.json").read_text())["vllm_stand_in"]
    (state,) = part["engine_at_start"]["servers"].values()
    assert state == {"worker_version": 0, "poisoned": False, "weight_version": "0"}
    final = part["final"]
    assert final["sync/engine_version"] == 1 and final["updates"] == 1  # generate, update, sync
    assert "eval/aime2024/avg@1" in final and final["trained_tokens"] > 0
    assert final["version_mismatch/tokens"] == 0
    synced = os.listdir(tmp_path / "vllm_stand_in" / "weight_sync")
    assert sorted(synced) == ["v00000000", "v00000001"]


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
