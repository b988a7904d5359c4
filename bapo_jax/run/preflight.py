"""Before a run computes: the platform, the trainer's devices, JAX's GPU memory pool, the plan.

`run.cli.main` calls these in order, each before the step that needs it (docs/sharding.md lists
the steps): `simulated_device_count`, `set_memory_fraction` and `restrict_gpus` before the JAX
backend starts; then `check_platform` (a pure function of what JAX and the machine report) and
`check_memory_plan` (the run's own train step compiled for its mesh must fit the budget;
`skip_plan` / `--skip-plan` overrides). Every refusal is a `RunConfigError` naming the flag or
key to change.
"""

from __future__ import annotations

import dataclasses
import glob
import os
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any

import jax

from bapo_jax.run.config import RunConfig, RunConfigError, config_errors
from bapo_jax.sharding import memory_plan
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.train import step as step_lib
from bapo_jax.train.optim import make_optimizer

MEM_FRACTION_ENVS = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
TrainerDevices = int | tuple[int, ...] | None


# ---- before JAX starts --------------------------------------------------------------------------
def cpu_requested(environ: Mapping[str, str]) -> bool:
    """The user asked for the CPU platform (JAX_PLATFORMS=cpu)."""
    return environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"


def simulated_device_count(
    mesh_devices: int, trainer_devices: TrainerDevices, *, dry_run: bool, cpu: bool
) -> int:
    """How many CPU devices a run simulates: 1 (none) unless `dry_run` or `cpu`
    (JAX_PLATFORMS=cpu); then enough for the trainer's selection (all mesh devices by default,
    N for a count, the highest id + 1 for a list)."""
    if not (dry_run or cpu):
        return 1
    if trainer_devices is None:
        return mesh_devices
    if isinstance(trainer_devices, int):
        return trainer_devices
    return max(trainer_devices) + 1


def machine_gpu_count(environ: Mapping[str, str], root: str = "/") -> int:
    """NVIDIA GPUs this process could use, read without starting JAX: the driver's list
    (/proc/driver/nvidia/gpus, else /dev/nvidiaN), narrowed by CUDA_VISIBLE_DEVICES."""
    found = glob.glob(os.path.join(root, "proc/driver/nvidia/gpus/*"))
    if not found:
        found = [
            p
            for p in glob.glob(os.path.join(root, "dev/nvidia*"))
            if os.path.basename(p)[len("nvidia") :].isdigit()
        ]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return len(found)
    ids = [v for v in visible.split(",") if v.strip() and v.strip() != "-1"]
    return min(len(found), len(ids))


def trainer_memory_share(config: RunConfig) -> float:
    """The share of each of its GPUs the trainer's step may use: the memory plan's
    `FIT_FRACTION`, less the colocated servers' `gpu_memory_utilization` (`engine.colocate`)."""
    e = config.engine
    if e.colocated:
        return memory_plan.FIT_FRACTION - (e.server.gpu_memory_utilization or 0.0)
    return memory_plan.FIT_FRACTION


def set_memory_fraction(
    environ: MutableMapping[str, str], share: float = memory_plan.FIT_FRACTION
) -> float:
    """Sets JAX's GPU preallocation to the memory plan's budget `share` (`trainer_memory_share`),
    unless the user set XLA_CLIENT_MEM_FRACTION / XLA_PYTHON_CLIENT_MEM_FRACTION; returns the
    share in force, which is also the budget the run's plan is checked against. Must run before
    the JAX backend starts (it reads the variable once, at start-up)."""
    for name in MEM_FRACTION_ENVS:
        if environ.get(name):
            try:
                fraction = float(environ[name])
            except ValueError:
                raise RunConfigError(f"{name} must be a number, got {environ[name]!r}") from None
            if not 0 < fraction <= 1:
                raise RunConfigError(f"{name} must be in (0, 1], got {fraction}")
            return fraction
    environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{share:.2f}"
    return share


def restrict_gpus(trainer_devices: TrainerDevices, visible_gpus: int) -> str | None:
    """Limits JAX's CUDA devices to the trainer's (`jax_cuda_visible_devices`: ids among the
    `visible_gpus` GPUs CUDA_VISIBLE_DEVICES shows), before the backend starts; returns the
    list, or None when nothing is restricted (all devices are the trainer's, or no GPU)."""
    if trainer_devices is None or visible_gpus == 0:
        return None
    ids = range(trainer_devices) if isinstance(trainer_devices, int) else trainer_devices
    missing = [i for i in ids if i >= visible_gpus]
    if missing:
        raise RunConfigError(
            f"trainer_devices: GPU(s) {missing} do not exist; this process sees {visible_gpus} "
            f"GPU(s), 0..{visible_gpus - 1}"
        )
    visible = ",".join(str(i) for i in ids)
    jax.config.update("jax_cuda_visible_devices", visible)
    return visible


# ---- after JAX starts ---------------------------------------------------------------------------
def check_platform(
    *,
    platform: str,
    local_devices: int,
    process_count: int,
    mesh: str,
    mesh_devices: int,
    trainer_devices: TrainerDevices,
    gpus_restricted: bool,
    machine_gpus: int,
    cpu: bool,
    dry_run: bool,
) -> int:
    """Refuses a run that cannot use its devices; returns the trainer devices per process.

    platform: JAX's default backend ("cpu", "gpu", "tpu"); local_devices: its devices in this
    process; gpus_restricted: `restrict_gpus` limited JAX to the trainer's GPUs (so all local
    devices are the trainer's); machine_gpus: `machine_gpu_count`; cpu: JAX_PLATFORMS=cpu.
    """
    if platform == "cpu" and machine_gpus > 0 and not (cpu or dry_run):
        raise RunConfigError(
            f"JAX_PLATFORMS: this machine has {machine_gpus} GPU(s) but JAX found no GPU "
            "backend, so the run would train on CPU; install the GPU build "
            "(pip install -e '.[gpu]', README 'On a GPU pod') or set JAX_PLATFORMS=cpu to "
            "train on CPU on purpose"
        )
    if trainer_devices is None or gpus_restricted:
        chosen = local_devices
        if gpus_restricted and trainer_devices is not None:
            wanted = trainer_devices if isinstance(trainer_devices, int) else len(trainer_devices)
            if wanted != local_devices:
                raise RunConfigError(
                    f"trainer_devices: {trainer_devices!r} asks for {wanted} GPU(s), but JAX "
                    f"sees {local_devices} of them (check CUDA_VISIBLE_DEVICES)"
                )
    elif isinstance(trainer_devices, int):
        chosen = trainer_devices
        if chosen > local_devices:
            raise RunConfigError(
                f"trainer_devices: {chosen} devices asked for, but the {platform} platform has "
                f"{local_devices} in this process"
            )
    else:
        chosen = len(trainer_devices)
        missing = [i for i in trainer_devices if i >= local_devices]
        if missing:
            raise RunConfigError(
                f"trainer_devices: ids {missing} do not exist; the {platform} platform has "
                f"devices 0..{local_devices - 1} in this process"
            )
    total = chosen * process_count
    if total != mesh_devices:
        per_process = f"{chosen} per process x {process_count} processes"
        if total > mesh_devices and trainer_devices is None:
            hint = (
                f"set trainer_devices={mesh_devices // process_count} (--trainer-devices; the "
                f"vLLM servers take the rest) or a --mesh of {total} devices"
            )
        elif cpu or dry_run:
            hint = "give trainer_devices the mesh's devices, or pick another --mesh"
        else:
            hint = (
                f"pick a --mesh of {total} devices or change trainer_devices; on CPU, "
                "JAX_PLATFORMS=cpu simulates the devices"
            )
        raise RunConfigError(
            f"--mesh / mesh: {mesh!r} needs {mesh_devices} devices, but the trainer has {total} "
            f"({platform}, {per_process}); {hint}"
        )
    return chosen


def gpus_restricted() -> bool:
    """JAX's CUDA devices are limited to the trainer's (`restrict_gpus` ran) and JAX is on GPU."""
    return jax.config.read("jax_cuda_visible_devices") != "all" and jax.default_backend() == "gpu"


def select_trainer_devices(config: RunConfig) -> list[jax.Device]:
    """The mesh's devices: each process's share (the first N or the listed ids of its local
    devices; by default as many as the mesh needs per process, which a real run checked to be
    all of them in `check_platform`), in process order (`jax.devices()` order)."""
    spec = config.trainer_devices
    by_process: dict[int, list[jax.Device]] = {}
    for device in jax.devices():
        by_process.setdefault(device.process_index, []).append(device)
    per_process = max(1, config.mesh_config().num_devices // len(by_process))
    chosen: list[jax.Device] = []
    for devices in by_process.values():
        if gpus_restricted():
            chosen += devices
        elif spec is None:
            chosen += devices[:per_process]
        elif isinstance(spec, int):
            chosen += devices[:spec]
        else:
            if max(spec) >= len(devices):
                raise RunConfigError(
                    f"trainer_devices: ids {list(spec)} but a process has {len(devices)} devices"
                )
            chosen += [devices[i] for i in spec]
    return chosen


def trainer_mesh(config: RunConfig) -> jax.sharding.Mesh | None:
    """The trainer mesh over `select_trainer_devices`; None for the single-device default (one
    device mesh on JAX's first device: the unsharded path)."""
    mesh_config = config.mesh_config()
    devices = select_trainer_devices(config)
    if mesh_config.num_devices == 1 and devices == jax.devices()[:1]:
        return None
    with config_errors("--mesh / trainer_devices: "):
        return mesh_lib.make_mesh(mesh_config, devices)


# ---- the memory plan of the run's layout --------------------------------------------------------
def plan_run(
    config: RunConfig,
    *,
    devices: Sequence[jax.Device] | None = None,
    fit_fraction: float | None = None,
    top_buffers: int = 0,
) -> memory_plan.MemoryPlan:
    """Compiles the run's own train step (its model, loss, micro-batching, optimizer, attention
    and remat) for its mesh on abstract arguments and reads its per-device memory. `devices`:
    the mesh's (default: the first of `jax.devices()`); on GPU the plan is XLA:GPU's.
    `fit_fraction`: the budget's share of device memory (None: `trainer_memory_share`)."""
    from bapo_jax.run.build import model_options

    t = config.trainer
    mesh_config = config.mesh_config()
    per_update = t.rows_per_batch // t.algorithm.mini_batches
    step_config = step_lib.trainer_step_config(t)
    platform = (devices[0] if devices else jax.devices()[0]).platform
    options = model_options(config)
    attention = memory_plan.planned_attention(options.attention, platform)
    options = dataclasses.replace(options, attention=attention)
    return memory_plan.plan_memory(
        config.model.architecture(),
        mesh_config,
        seq_len=t.row_length,
        micro_batch=per_update // t.algorithm.micro_batches // mesh_config.batch_parallelism,
        num_micro_batches=t.algorithm.micro_batches,
        packed=t.algorithm.packing,
        options=options,
        step_config=step_config,
        optimizer=make_optimizer(t.optimizer),
        devices=None if devices is None else list(devices),
        top_buffers=top_buffers,
        fit_fraction=trainer_memory_share(config) if fit_fraction is None else fit_fraction,
    )


def plan_refusal(config: RunConfig, plan: memory_plan.MemoryPlan) -> str:
    """The error of a plan that does not fit: the numbers, the largest buffers, what to change."""
    m = config.mesh_config()
    model = config.model.hf_dir or config.model.preset
    lines = [
        f"mesh: the train step of {model} on mesh {config.mesh!r} "
        f"(data={m.data} x fsdp={m.fsdp} x tensor={m.tensor}) needs "
        f"{(plan.peak_bytes + plan.reference_bytes) / 1e9:.2f} GB per device at "
        f"{plan.seq_len} tokens, over the budget of {plan.budget_bytes / 1e9:.2f} GB "
        f"({plan.fit_fraction:.0%} of the {config.accelerator}'s "
        f"{plan.device_memory_bytes / 1e9:.0f} GB); largest per-device arrays:"
    ]
    for r in plan.largest_buffers:
        shape = ",".join(map(str, r.shape))
        lines.append(f"  {r.bytes / 1e9:7.2f} GB  {r.dtype}[{shape}] x{r.count}  {r.op_name[-80:]}")
    lines.append(
        "use more devices (--mesh, trainer_devices), model.attention=blockwise, more "
        "trainer.algorithm.micro_batches, or --skip-plan to run anyway"
    )
    return "\n".join(lines)


def check_memory_plan(
    config: RunConfig, devices: Sequence[jax.Device], fit_fraction: float
) -> dict[str, Any]:
    """Refuses (RunConfigError) a layout whose train step does not fit `fit_fraction` of the
    accelerator's memory; returns the plan's numbers. No compile when `config.skip_plan`."""
    if config.skip_plan:
        return {"skipped": "skip_plan"}
    plan = plan_run(config, devices=devices, fit_fraction=fit_fraction, top_buffers=5)
    if not plan.fits:
        raise RunConfigError(plan_refusal(config, plan))
    return {
        "seq_len": plan.seq_len,
        "peak_bytes_per_device": plan.peak_bytes + plan.reference_bytes,
        "budget_bytes": plan.budget_bytes,
        "platform": devices[0].platform,
    }
