"""Multi-host start-up from the launcher's environment and global batches on one process (the
two-process RL loop, which runs the train step across processes, is
`tests/train/test_multihost_loop.py`)."""

from __future__ import annotations

import chex
import jax
import numpy as np
import pytest

from bapo_jax.sharding import distributed


def test_launcher_settings_from_env():
    assert distributed.launcher_settings({}) is None
    assert distributed.launcher_settings({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "1"}) is None
    srun = {"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_STEP_NUM_TASKS": "4"}
    assert distributed.launcher_decision(srun) == ({}, "SLURM: one of the 4 tasks of an srun step")
    # The batch script of a 4-task job, without srun: JAX would wait for 3 peers forever.
    settings, why = distributed.launcher_decision({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})
    assert settings is None and "SLURM job of 4 tasks, but this process is not in an srun" in why
    assert "SLURM_STEP_NUM_TASKS=unset" in why and "BAPO_DISTRIBUTED=auto" in why
    assert distributed.launcher_decision({**srun, "BAPO_DISTRIBUTED": "off"}) == (
        None,
        "BAPO_DISTRIBUTED=off: single process",
    )
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
    with pytest.raises(ValueError, match="BAPO_DISTRIBUTED must be 'auto' or 'off'"):
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
