"""The command line every experiment shares.

    python -m experiments.NAME [--out-dir DIR] [--dry-run] [--recipe paper|authors]
        [--mesh 7b-8gpu|32b-32gpu|data=1,fsdp=8,tensor=1]
        [--trainer-devices 8|0,1,2,3] [--accelerator h100] [--skip-plan]
        [--model-dir HF_DIR] [--vllm-url URL ...] [--launch-servers N] [--vllm-python PATH]
        [--server-devices "0,1,2,3;4,5,6,7"] [--tensor-parallel-size N] [--gpu-memory-utilization F]
        [--served-model-name NAME] [--request-timeout S] [--requests-per-server N]
        [key.sub=value ...]

Flags are shortcuts for overrides (`--mesh 32b` = `mesh=32b`); any other setting is a
`key.sub=value` override of the experiment's `RunConfig` (`bapo_jax.overrides`), checked
before any compute. `--recipe NAME` first applies a published setting's overrides
(`run.recipes`: the paper's or the authors' verl recipe), so the flags and overrides given on
the command line win over it; the run prints which recipe it applied.

Then, in this process and before the JAX backend starts, the steps of `run.preflight`
(docs/sharding.md lists them): the devices, JAX's GPU pool, the platform, and a real run's train
step compiled for its mesh and refused if it does not fit (`--skip-plan`).

One setting cannot be made in-process: glibc reads its allocator tunables when a process
starts. Unless GLIBC_TUNABLES already holds `bapo_jax.malloc.MALLOC_TUNABLES` (malloc keeps
freed memory: no page-fault storm in XLA:CPU's allocations), the process re-executes itself
once with them.
`--no-reexec` skips that (for a debugger: the run is the same, its CPU steps slower).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence
from typing import Any

import jax

from bapo_jax.malloc import MALLOC_TUNABLES, with_malloc_tunables
from bapo_jax.overrides import add_flags, flag_overrides
from bapo_jax.run import preflight, recipes
from bapo_jax.run.config import RunConfig, RunConfigError, dump, validate_run
from bapo_jax.run.estimate_report import pod_estimate
from bapo_jax.sharding import mesh as mesh_lib

# Flags that are shortcuts for engine keys (`overrides.add_flags`: the field's help).
SERVER_FLAGS = {
    "--vllm-python": "engine.server.python",
    "--server-devices": "engine.server.devices",
    "--tensor-parallel-size": "engine.server.tensor_parallel_size",
    "--gpu-memory-utilization": "engine.server.gpu_memory_utilization",
    "--served-model-name": "engine.server.served_model_name",
    "--request-timeout": "engine.request_timeout_s",
    "--requests-per-server": "engine.requests_per_server",
}


def build_parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out-dir", default=None, help="run directory (default runs/<experiment>)")
    ap.add_argument("--dry-run", action="store_true", help="compile + one toy RL step on CPU")
    add_no_reexec(ap)
    ap.add_argument(
        "--recipe",
        default=None,
        help="a published setting applied before your overrides: "
        f"{' or '.join(sorted(recipes.RECIPES))} (bapo_jax/run/recipes.py; default: the "
        "experiment's own settings)",
    )
    ap.add_argument(
        "--mesh",
        default=None,
        help=f"trainer mesh: a preset {sorted(mesh_lib.PRESETS)} or 'data=1,fsdp=4,tensor=1'",
    )
    ap.add_argument(
        "--trainer-devices",
        default=None,
        help="the trainer's local devices: N (the first N) or ids '0,1,2,3' (trainer_devices; "
        "default all; the vLLM servers use the others)",
    )
    ap.add_argument(
        "--accelerator",
        default=None,
        help=f"the device the memory plan checks against: {sorted(mesh_lib.ACCELERATORS)}",
    )
    ap.add_argument(
        "--skip-plan",
        action="store_true",
        help="run even if the memory plan says the train step does not fit (skip_plan)",
    )
    ap.add_argument("--model-dir", default=None, help="HF directory of the initial policy")
    ap.add_argument("--vllm-url", action="append", default=[], help="a vLLM server (repeatable)")
    ap.add_argument("--launch-servers", type=int, default=None, help="vLLM servers to start")
    add_flags(ap.add_argument_group("vLLM servers (engine section)"), SERVER_FLAGS, RunConfig)
    ap.add_argument("overrides", nargs="*", help="key.sub=value settings")
    return ap


def _server_overrides(args: argparse.Namespace) -> list[str]:
    """The engine keys of the server flags. Given URLs (--vllm-url) replace the servers the
    experiment would launch, unless --launch-servers / --server-devices ask for them too;
    --server-devices launches one server per GPU list, each of its size, unless told
    otherwise."""
    out = []
    if args.vllm_url and args.launch_servers is None and args.server_devices is None:
        out += ["engine.launch_servers=0", "engine.server.devices=[]", "engine.server.cpu_cores=[]"]
    if args.server_devices is not None:
        groups = [g.strip() for g in args.server_devices.split(";") if g.strip()]
        out.append("engine.kind=vllm")
        if args.launch_servers is None:
            out.append(f"engine.launch_servers={len(groups)}")
        if args.tensor_parallel_size is None and groups:
            out.append(f"engine.server.tensor_parallel_size={len(groups[0].split(','))}")
    return out + flag_overrides(args, SERVER_FLAGS, RunConfig)


def resolve(default: RunConfig, args: argparse.Namespace) -> RunConfig:
    overrides = list(args.overrides)
    if args.mesh is not None:
        overrides.append(f"mesh={args.mesh}")
    if args.trainer_devices is not None:
        overrides.append(f"trainer_devices={args.trainer_devices}")
    if args.accelerator is not None:
        overrides.append(f"accelerator={args.accelerator}")
    if args.skip_plan:
        overrides.append("skip_plan=true")
    if args.model_dir is not None:
        overrides.append(f"model.hf_dir={args.model_dir}")
    if args.vllm_url:
        overrides += ["engine.kind=vllm", "engine.vllm_urls=" + ",".join(args.vllm_url)]
    if args.launch_servers is not None:
        overrides += ["engine.kind=vllm", f"engine.launch_servers={args.launch_servers}"]
    overrides += _server_overrides(args)
    return recipes.apply_recipe(default, args.recipe, overrides)


def add_no_reexec(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--no-reexec",
        action="store_true",
        help="do not re-execute the process for glibc's allocator setting (for a debugger; "
        "CPU steps run slower)",
    )


def ensure_environment(
    num_devices: int,
    module: str,
    argv: Sequence[str],
    *,
    cpu_platform: bool = False,
    reexec: bool = True,
) -> None:
    """The run's environment (module doc): JAX's platform and simulated devices in this
    process, then at most one re-exec of `python -m module argv` for the allocator.

    num_devices: CPU devices to simulate, when JAX runs on CPU by request (JAX_PLATFORMS=cpu,
    or `cpu_platform`, which sets it: the dry run); elsewhere the devices are real.
    reexec: False (--no-reexec) keeps this process and glibc's default allocator."""
    if cpu_platform or (preflight.cpu_requested(os.environ) and num_devices > 1):
        mesh_lib.use_cpu_devices(num_devices)
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    if MALLOC_TUNABLES in tunables or not sys.platform.startswith("linux"):
        return
    if not reexec:
        print("note: --no-reexec: glibc's default allocator (slower CPU steps)", file=sys.stderr)
        return
    env = dict(os.environ)
    env["GLIBC_TUNABLES"] = with_malloc_tunables(tunables)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def prepare_devices(config: RunConfig, *, dry_run: bool) -> float:
    """The steps between the environment and the first use of JAX (module doc); returns the share
    of device memory JAX's pool holds, the memory plan's budget. Dry runs stay one CPU process
    (no jax.distributed, no GPU restriction)."""
    fraction = preflight.set_memory_fraction(os.environ, preflight.trainer_memory_share(config))
    gpus, cpu = preflight.machine_gpu_count(os.environ), preflight.cpu_requested(os.environ)
    restricted = False
    if not (dry_run or cpu):
        restricted = preflight.restrict_gpus(config.trainer_devices, gpus) is not None
        from bapo_jax.sharding import distributed

        distributed.maybe_initialize()
    preflight.check_platform(
        platform=jax.default_backend(),
        local_devices=jax.local_device_count(),
        process_count=jax.process_count(),
        mesh=config.mesh,
        mesh_devices=config.mesh_config().num_devices,
        trainer_devices=config.trainer_devices,
        gpus_restricted=restricted and preflight.gpus_restricted(),
        machine_gpus=gpus,
        cpu=cpu,
        dry_run=dry_run,
    )
    return fraction


def compilation_cache(out_dir: str, env: dict[str, str] | os._Environ = os.environ) -> str:
    """JAX's persistent compilation cache for the run: $JAX_COMPILATION_CACHE_DIR when set, else
    <out_dir>/jax_cache, so that a resumed or repeated run loads its programs instead of
    compiling them again (the 7B step compiles for minutes). Set before the first compile."""
    path = env.get("JAX_COMPILATION_CACHE_DIR") or os.path.join(
        os.path.abspath(out_dir), "jax_cache"
    )
    jax.config.update("jax_compilation_cache_dir", path)
    return path


@contextlib.contextmanager
def _refusals(errors: type[Exception]):
    """A refused setting (`errors`) ends the run with its message and exit status 2."""
    try:
        yield
    except errors as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


def main(default: RunConfig, *, module: str, description: str, argv=None) -> dict[str, Any]:
    """Parse, validate, set the environment up, then dry-run or train."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(description).parse_intermixed_args(argv)
    with _refusals(ValueError):
        config = resolve(default, args)
        arch = validate_run(config, check_engine=not args.dry_run, check_servers=False)
    cpu = preflight.cpu_requested(os.environ)
    devices = preflight.simulated_device_count(
        config.mesh_config().num_devices, config.trainer_devices, dry_run=args.dry_run, cpu=cpu
    )
    if cpu and not args.dry_run and devices > 1 and not config.mesh.startswith("cpu"):
        print(f"note: mesh {config.mesh!r} on CPU simulates {devices} devices", file=sys.stderr)
    ensure_environment(devices, module, argv, cpu_platform=args.dry_run, reexec=not args.no_reexec)
    print(recipes.describe(args.recipe), flush=True)  # after the re-exec: printed once
    with _refusals(ValueError):  # before the JAX backend starts
        fraction = prepare_devices(config, dry_run=args.dry_run)
    out_dir = args.out_dir or os.path.join("runs", module.rsplit(".", 1)[-1])
    os.makedirs(out_dir, exist_ok=True)
    dump(config, os.path.join(out_dir, "config.json"))
    print(f"JAX compilation cache: {compilation_cache(out_dir)}", flush=True)
    if config.engine.kind == "vllm" and not config.engine.server.cpu_cores:  # a GPU/TPU pod
        print(pod_estimate(config, arch), flush=True)
    with _refusals(RunConfigError):
        if args.dry_run:
            from bapo_jax.run.dry_run import dry_run

            return dry_run(config, out_dir)
        from bapo_jax.run.build import build_trainer

        plan = preflight.check_memory_plan(
            config, preflight.select_trainer_devices(config), fraction
        )
        print(f"memory plan of the train step: {plan}", file=sys.stderr, flush=True)
        with build_trainer(config, out_dir) as trainer:
            return trainer.run()
