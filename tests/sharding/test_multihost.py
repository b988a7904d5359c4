"""Multi-host: two processes x 4 CPU devices (jax.distributed on localhost, gloo collectives) run
the train step of `tests/train/test_step.py` and match the single-process 8-device run."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time

import chex
import jax
import numpy as np
import pytest

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.sharding import distributed
from bapo_jax.train.step import StepConfig

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "multihost_worker.py")
NUM_PROCESSES = 2
TIMEOUT_S = 600


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(mesh_name: str, out: str) -> list[subprocess.CompletedProcess]:
    """Both processes, together bounded by TIMEOUT_S; survivors are killed on any failure."""
    port = _free_port()
    procs = []
    for i in range(NUM_PROCESSES):
        env = dict(os.environ)
        env.update(
            XLA_FLAGS="--xla_force_host_platform_device_count=4",
            JAX_PLATFORMS="cpu",
            PYTHONPATH=REPO + os.pathsep + env.get("PYTHONPATH", ""),
            **{
                distributed.COORDINATOR_ENV: f"127.0.0.1:{port}",
                distributed.NUM_PROCESSES_ENV: str(NUM_PROCESSES),
                distributed.PROCESS_ID_ENV: str(i),
            },
        )
        cmd = [sys.executable, WORKER, "--mesh", mesh_name, "--out", out]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    deadline = time.monotonic() + TIMEOUT_S
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mesh_name", ["cpu-fsdp4-tp2"])
def test_two_processes_match_single_process(mesh_name, tmp_path):
    results = _launch(mesh_name, str(tmp_path / "result"))
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i} failed:\n{r.stderr[-4000:]}"

    # Single-process reference on this process's 8 devices (conftest), same steps.
    worker = _load("bapo_multihost_worker", WORKER)
    step_test = worker.load_step_test()
    step_config = StepConfig(loss="bapo", loss_config=BAPOConfig(rho0=0.6))
    ref_params, ref_history = step_test.run_steps(step_config, mesh_name)
    ref_params = worker.flat_params(ref_params)
    ref_metrics = {k: np.stack([h[k] for h in ref_history]) for k in worker.METRICS}

    for i in range(NUM_PROCESSES):
        with np.load(tmp_path / f"result.{i}.npz") as f:
            got = dict(f)
        assert int(got["meta/process_count"]) == NUM_PROCESSES
        assert int(got["meta/device_count"]) == 8
        assert int(got["meta/local_device_count"]) == 4
        params = {k.removeprefix("params/"): v for k, v in got.items() if k.startswith("params/")}
        assert sorted(params) == sorted(ref_params)
        chex.assert_trees_all_close(params, ref_params, atol=1e-5, rtol=1e-4)
        # The BAPO bounds are picked from a grid: identical, not merely close.
        for key in ("c_low", "c_high"):
            np.testing.assert_array_equal(got[f"metrics/{key}"], ref_metrics[key], err_msg=key)
        for key in ("loss", "grad_norm"):
            np.testing.assert_allclose(
                got[f"metrics/{key}"], ref_metrics[key], atol=1e-5, rtol=1e-4, err_msg=key
            )


def test_launcher_settings_from_env():
    assert distributed.launcher_settings({}) is None
    assert distributed.launcher_settings({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    assert distributed.launcher_settings({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"}) == {}
    assert distributed.launcher_settings({"BAPO_DISTRIBUTED": "auto"}) == {}
    env = {"BAPO_COORDINATOR": "10.0.0.1:1234", "BAPO_NUM_PROCESSES": "4", "BAPO_PROCESS_ID": "3"}
    assert distributed.launcher_settings(env) == {
        "coordinator_address": "10.0.0.1:1234",
        "num_processes": 4,
        "process_id": 3,
    }
    with pytest.raises(ValueError, match="BAPO_PROCESS_ID must be in \\[0, 4\\), got 4"):
        distributed.launcher_settings({**env, "BAPO_PROCESS_ID": "4"})
    with pytest.raises(ValueError, match="BAPO_NUM_PROCESSES must be set too"):
        distributed.launcher_settings({"BAPO_COORDINATOR": "10.0.0.1:1234"})
    with pytest.raises(ValueError, match="BAPO_COORDINATOR must be host:port"):
        distributed.launcher_settings({**env, "BAPO_COORDINATOR": "10.0.0.1"})
    with pytest.raises(ValueError, match="SLURM_NTASKS must be an int, got 'x'"):
        distributed.launcher_settings({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "x"})
    with pytest.raises(ValueError, match="BAPO_DISTRIBUTED must be 'auto'"):
        distributed.launcher_settings({"BAPO_DISTRIBUTED": "yes"})
    # A single-process environment leaves JAX alone.
    assert distributed.maybe_initialize({}) is False
    assert jax.process_count() == 1


def test_global_batch_from_process_rows_single_process():
    """With one process, the rows are the whole batch, split over the batch axes."""
    from bapo_jax.sharding import mesh as mesh_lib

    mesh = mesh_lib.make_mesh(mesh_lib.mesh_preset("cpu-fsdp4-tp2"))
    rows = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)
    assert distributed.process_row_range(8) == (0, 8)
    out = distributed.global_batch_from_process_rows({"x": rows}, mesh)["x"]
    chex.assert_shape(out, (8, 3))
    np.testing.assert_array_equal(np.asarray(out), rows)
    assert out.sharding.spec == jax.sharding.PartitionSpec(("data", "fsdp"), None)
