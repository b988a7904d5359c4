"""`python -m experiments.aime_7b --dry-run` / `aime_32b --dry-run` on CPU: the real train step
compiles for the mesh on simulated devices and one toy RL iteration runs end to end, on the
embedded engine, and (given a vLLM interpreter) through a real vLLM server."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from experiments import records

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*args: str, vllm_python: str | None = None) -> subprocess.CompletedProcess:
    """The command with no vLLM interpreter found, unless `vllm_python` names one."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    env["BAPO_VLLM_PYTHON"] = vllm_python or os.path.join(ROOT, "no-vllm-here", "python")
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500
    )


@pytest.mark.parametrize(
    "experiment, devices, trainer_devices, with_vllm",
    [
        # 7B: one node's 8 GPUs (vLLM colocated on them), and its vLLM part through a real
        # server (in `make test-vllm`: one dry run covers both); 32B: four whole 8-GPU nodes,
        # without a vLLM interpreter (the dry run says it skipped that part).
        pytest.param("aime_7b", 8, 8, True, marks=pytest.mark.vllm),
        pytest.param("aime_32b", 32, None, False, marks=pytest.mark.slow),
    ],
)
def test_dry_run_compiles_for_the_mesh_and_runs_one_rl_step(
    tmp_path, experiment, devices, trainer_devices, with_vllm
):
    args = ["-m", f"experiments.{experiment}", "--dry-run", "--out-dir", str(tmp_path)]
    if with_vllm:
        from bapo_jax.rollout import serve

        # --vllm-python (engine.server.python) wins over $BAPO_VLLM_PYTHON, set here to nothing.
        args += ["--vllm-python", serve.vllm_python()]
    proc = _run(*args, vllm_python=os.path.join(ROOT, "not-this-one") if with_vllm else None)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "dry_run.json").read_text())
    real = report["real_step"]
    assert real["rows_per_update"] == 64 * 16 and real["seq_len"] == 1024 + 8192
    assert real["fits"], real  # the preset mesh holds the real model's step
    assert real["attention"] == "blockwise"  # plain attention's [T, T] scores would not fit
    # 85% of an 80 GB H100 less the colocated servers' share (7B: 0.4, 32B: 0.3)
    share = {"aime_7b": 0.45, "aime_32b": 0.55}[experiment]
    assert real["peak_gb_per_device"] <= real["budget_gb"] == pytest.approx(share * 80)
    assert real["mesh_devices"] == devices
    # What README and docs quote of this step: the record (experiments.records) holds it.
    assert records.check_memory_plan(experiment, real) == []
    # The trainer's packed step: 128 micro-batches of 8 rows (one per batch device: fsdp 8),
    # a budget of 8 x 9,216 tokens.
    assert real["packed"] and real["micro_batches"] == 128
    assert real["micro_batch_tokens"] == 8 * (1024 + 8192)
    assert "'micro_batch_tokens': 73728" in proc.stdout
    assert "iteration estimate: " in proc.stdout and " days" in proc.stdout  # run.estimate
    step = report["stand_in_step"]
    assert step["updates"] == 1 and step["optimizer_step"] == 1
    assert 0.6 <= step["c_low"] <= 0.9 and step["c_high"] >= 1.2
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    # The stand-in's embedded engine took version 1: a copy of the params (its load, timed by
    # `begin_update` right after the update) and the switch to it (time/sync); nothing written
    # to disk, nothing hidden. Both are a tiny model's, far below its update, which compiles.
    sync = rows[0]
    assert sync["sync/engine_version"] == 1 and sync["sync/attempts"] == 1
    assert sync["time/sync_load"] > 0 and sync["time/sync"] > 0
    assert sync["time/sync_write"] == sync["time/sync_write_hidden"] == 0
    assert sync["time/sync_load_hidden"] == 0
    assert sync["time/sync_load"] + sync["time/sync"] < sync["time/update"]
    assert os.listdir(tmp_path / "checkpoints")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["mesh"] == {"aime_7b": "7b-8gpu", "aime_32b": "32b-32gpu"}[experiment]
    assert config["trainer_devices"] == trainer_devices and config["accelerator"] == "h100"
    assert config["model"]["attention"] == "blockwise"
    # The real step was compiled for the trainer's mesh on as many simulated CPU devices.
    assert real["mesh_devices"] == real["platform_devices"] == devices
    assert f"simulates {devices}" not in proc.stderr  # dry runs do not print the CPU note
    part = report["vllm_stand_in"]
    if not with_vllm:
        assert "no vLLM interpreter at" in part["skipped"]  # said plainly
        assert "skipped the real vLLM part" in proc.stdout
        return
    # One RL iteration of a stand-in (head_dim 64) through a real server the run launched:
    # it held version 0 before generating, then generate, update, Orbax sync, one eval call.
    (state,) = part["engine_at_start"]["servers"].values()
    assert state == {"worker_version": 0, "poisoned": False, "weight_version": "0"}
    final = part["final"]
    assert final["sync/engine_version"] == 1 and final["updates"] == 1
    assert "eval/aime2024/avg@1" in final and final["trained_tokens"] > 0
    assert final["version_mismatch/tokens"] == 0
    # Version 1 went through an Orbax checkpoint: written, then loaded by the server.
    assert final["time/sync_write"] > 0 and final["time/sync_load"] > 0 and final["time/sync"] > 0
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
