"""Multi-process (multi-host) JAX: start-up from the launcher's environment, global batches.

One process per host (each owning that host's GPUs) runs the same program; the processes meet
at a coordinator (`jax.distributed.initialize`), after which `jax.devices()` lists every device
of every process and a mesh over all of them spans the hosts. Arrays on such a mesh are global:
each process holds only the shards of its own devices.

`maybe_initialize()` decides from the environment:

  BAPO_COORDINATOR=host:port, BAPO_NUM_PROCESSES=P, BAPO_PROCESS_ID=i
      explicit (any launcher; e.g. the multi-host test, or a hand-written pod script);
  BAPO_DISTRIBUTED=auto
      `jax.distributed.initialize()` with no arguments: JAX detects the cluster itself
      (SLURM, Open MPI, Kubernetes/GKE, Cloud TPU);
  BAPO_DISTRIBUTED=off
      single process, whatever the launcher's variables say;
  SLURM_JOB_ID with an `srun` step of several tasks (SLURM_STEP_NUM_TASKS > 1)
      the same auto-detection. A job of several tasks whose script runs the trainer without
      `srun` (SLURM_NTASKS > 1, no step of several tasks) would wait at the coordinator for
      peers that never start: it stays single-process and says so;
  none of these
      single process, nothing to do.

`maybe_initialize` prints the decision whenever a launcher variable was involved.

On CPU the cross-process collectives use gloo (JAX's default `jax_cpu_collectives_implementation`);
on GPU, NCCL.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from bapo_jax.sharding import rules as rules_lib

COORDINATOR_ENV = "BAPO_COORDINATOR"
NUM_PROCESSES_ENV = "BAPO_NUM_PROCESSES"
PROCESS_ID_ENV = "BAPO_PROCESS_ID"
AUTO_ENV = "BAPO_DISTRIBUTED"


def _int_env(env: Mapping[str, str], name: str) -> int:
    if name not in env:
        raise ValueError(f"{COORDINATOR_ENV} is set, so {name} must be set too")
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"{name} must be an int, got {env[name]!r}") from None


def launcher_decision(env: Mapping[str, str]) -> tuple[dict[str, object] | None, str | None]:
    """(the `jax.distributed.initialize` keyword arguments the environment asks for, or None
    for a single-process run ({} means: let JAX auto-detect the cluster); why, when a launcher
    variable decided it)."""
    coordinator = env.get(COORDINATOR_ENV)
    if coordinator:
        if ":" not in coordinator:
            raise ValueError(f"{COORDINATOR_ENV} must be host:port, got {coordinator!r}")
        num_processes = _int_env(env, NUM_PROCESSES_ENV)
        process_id = _int_env(env, PROCESS_ID_ENV)
        if num_processes < 1:
            raise ValueError(f"{NUM_PROCESSES_ENV} must be >= 1, got {num_processes}")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"{PROCESS_ID_ENV} must be in [0, {num_processes}), got {process_id}")
        settings = {
            "coordinator_address": coordinator,
            "num_processes": num_processes,
            "process_id": process_id,
        }
        return settings, f"{COORDINATOR_ENV}: process {process_id} of {num_processes}"
    auto = env.get(AUTO_ENV, "")
    if auto:
        if auto not in ("auto", "off"):
            raise ValueError(f"{AUTO_ENV} must be 'auto' or 'off' (or unset), got {auto!r}")
        if auto == "off":
            return None, f"{AUTO_ENV}=off: single process"
        return {}, f"{AUTO_ENV}=auto: JAX detects the cluster"
    if env.get("SLURM_JOB_ID"):
        tasks, step = env.get("SLURM_NTASKS", "1"), env.get("SLURM_STEP_NUM_TASKS", "")
        for name, value in (("SLURM_NTASKS", tasks), ("SLURM_STEP_NUM_TASKS", step or "0")):
            if not value.isdigit():
                raise ValueError(f"{name} must be an int, got {value!r}")
        if step and int(step) > 1:
            return {}, f"SLURM: one of the {step} tasks of an srun step"
        if int(tasks) > 1:
            return None, (
                f"SLURM job of {tasks} tasks, but this process is not in an srun step of several "
                f"tasks (SLURM_STEP_NUM_TASKS={step or 'unset'}): single process, which would "
                f"otherwise wait for peers that never start. Launch with srun for one process "
                f"per node, or set {AUTO_ENV}=auto to force JAX's detection"
            )
    return None, None


def launcher_settings(env: Mapping[str, str]) -> dict[str, object] | None:
    """`launcher_decision`'s settings alone."""
    return launcher_decision(env)[0]


def maybe_initialize(env: Mapping[str, str] | None = None) -> bool:
    """Calls `jax.distributed.initialize` when the launcher says so (see the module doc),
    printing why whenever a launcher variable decided.

    Must run before anything touches a JAX device. Returns True when this is (now) a
    multi-process run; calling it again is a no-op.
    """
    settings, why = launcher_decision(os.environ if env is None else env)
    if why is not None:
        print(f"multi-process: {why}", flush=True)
    if settings is None:
        return False
    if not jax.distributed.is_initialized():
        jax.distributed.initialize(**settings)
    return True


def global_batch_from_process_rows(tree, mesh: Mesh):
    """Global [B, ...] arrays, B split over the mesh's batch axes, from each process's rows.

    Every leaf is this process's contiguous block of rows (numpy, [B / P, ...] for P
    processes with equal shares); the global batch is the concatenation in process order. The
    mesh must place each process's devices on a contiguous block of the batch axes (true for
    `make_mesh` over `jax.devices()`, which lists devices process by process).
    """

    def place(local):
        local = np.asarray(local)
        sharding = NamedSharding(
            mesh, rules_lib.logical_to_spec(("batch",) + (None,) * (local.ndim - 1))
        )
        global_shape = (local.shape[0] * jax.process_count(), *local.shape[1:])
        return jax.make_array_from_process_local_data(sharding, local, global_shape)

    return jax.tree.map(place, tree)


def process_row_range(global_batch: int) -> tuple[int, int]:
    """[start, stop) of the rows of a global batch that this process feeds."""
    count, index = jax.process_count(), jax.process_index()
    if global_batch % count:
        raise ValueError(f"global batch {global_batch} is not divisible by the {count} processes")
    share = global_batch // count
    return index * share, (index + 1) * share


_CHUNK_BYTES = 1 << 30  # one broadcast program moves at most this many bytes


def broadcast_bytes(data: bytes | None) -> bytes:
    """Process 0's `data` on every process (the others pass None), any length (a pod's rollout
    batch: 32k-64k responses x 4,096 samples can exceed 2^31 bytes). The length travels as 8
    bytes, then the data in chunks of `_CHUNK_BYTES`, the last padded to a power of two (a
    bounded number of compiled programs)."""
    from jax.experimental import multihost_utils

    primary = jax.process_index() == 0
    if primary and not isinstance(data, bytes):
        raise ValueError(f"process 0 must broadcast bytes, got {type(data).__name__}")
    header = np.zeros(8, np.uint8)
    if primary:
        header[:] = np.frombuffer(len(data).to_bytes(8, "little"), np.uint8)
    header = np.asarray(multihost_utils.broadcast_one_to_all(header))
    size = int.from_bytes(header.tobytes(), "little")
    out = bytearray(size)
    for start in range(0, size, _CHUNK_BYTES):
        count = min(_CHUNK_BYTES, size - start)
        buffer = np.zeros(1 << (count - 1).bit_length(), np.uint8)
        if primary:
            buffer[:count] = np.frombuffer(data, np.uint8, count=count, offset=start)
        buffer = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
        out[start : start + count] = buffer[:count].tobytes()
    return bytes(out)
