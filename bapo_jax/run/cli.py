"""The command line every experiment shares.

    python -m experiments.NAME [--out-dir DIR] [--dry-run] [--mesh 7b|32b|...]
        [--model-dir HF_DIR] [--vllm-url URL ...] [--launch-servers N] [--vllm-python PATH]
        [key.sub=value ...]

Flags are shortcuts for overrides (`--mesh 32b` = `mesh=32b`); any other setting is a
`key.sub=value` override of the experiment's `RunConfig` (`bapo_jax.train.overrides`), checked
before any compute. The process re-executes itself once with the environment a run wants,
which must be set before the process (glibc) or JAX (XLA flags) starts:

    GLIBC_TUNABLES  malloc keeps freed memory (no page-fault storm in XLA:CPU's allocations)
    XLA_FLAGS       --xla_force_host_platform_device_count=N on CPU, N = the mesh's devices
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import Any

from bapo_jax.run.config import RunConfig, RunConfigError, validate_run
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.train.overrides import apply_overrides

MALLOC_TUNABLES = (
    "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1000000000000:glibc.malloc.arena_max=1"
)
_REEXEC_MARK = "BAPO_RUN_ENV_READY"


def build_parser(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out-dir", default=None, help="run directory (default runs/<experiment>)")
    ap.add_argument("--dry-run", action="store_true", help="compile + one toy RL step on CPU")
    ap.add_argument("--mesh", default=None, help=f"mesh preset: {sorted(mesh_lib.PRESETS)}")
    ap.add_argument("--model-dir", default=None, help="HF directory of the initial policy")
    ap.add_argument("--vllm-url", action="append", default=[], help="a vLLM server (repeatable)")
    ap.add_argument("--launch-servers", type=int, default=None, help="vLLM servers to start")
    ap.add_argument(
        "--vllm-python",
        default=None,
        help="the vLLM environment's interpreter for launched servers (engine.vllm_python; "
        "default $BAPO_VLLM_PYTHON, else the project's .venv-vllm)",
    )
    ap.add_argument("overrides", nargs="*", help="key.sub=value settings")
    return ap


def resolve(default: RunConfig, args: argparse.Namespace) -> RunConfig:
    overrides = list(args.overrides)
    if args.mesh is not None:
        overrides.append(f"mesh={args.mesh}")
    if args.model_dir is not None:
        overrides.append(f"model.hf_dir={args.model_dir}")
    if args.vllm_url:
        overrides += ["engine.kind=vllm", "engine.vllm_urls=" + ",".join(args.vllm_url)]
    if args.launch_servers is not None:
        overrides += ["engine.kind=vllm", f"engine.launch_servers={args.launch_servers}"]
    if args.vllm_python is not None:
        overrides.append(f"engine.vllm_python={args.vllm_python}")
    return apply_overrides(default, overrides)


def ensure_environment(num_devices: int, module: str, argv: Sequence[str]) -> None:
    """Re-execute `python -m module argv` once with the run environment (module doc)."""
    if os.environ.get(_REEXEC_MARK) or not sys.platform.startswith("linux"):
        return
    env = dict(os.environ)
    env[_REEXEC_MARK] = "1"
    env["GLIBC_TUNABLES"] = ":".join(t for t in (env.get("GLIBC_TUNABLES"), MALLOC_TUNABLES) if t)
    if env.get("JAX_PLATFORMS", "cpu") == "cpu" and num_devices > 1:
        flags = [
            f
            for f in env.get("XLA_FLAGS", "").split()
            if not f.startswith("--xla_force_host_platform_device_count")
        ]
        flags.append(f"--xla_force_host_platform_device_count={num_devices}")
        env["XLA_FLAGS"] = " ".join(flags)
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", module, *argv], env)


def main(default: RunConfig, *, module: str, description: str, argv=None) -> dict[str, Any]:
    """Parse, validate, set the environment up, then dry-run or train."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(description).parse_intermixed_args(argv)
    try:
        config = resolve(default, args)
        validate_run(config, check_engine=not args.dry_run, check_servers=False)
    except (RunConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    on_cpu = os.environ.get("JAX_PLATFORMS", "cpu") == "cpu"
    devices = mesh_lib.mesh_preset(config.mesh).num_devices
    if on_cpu and not args.dry_run and devices > 1 and config.mesh.startswith(("7b", "32b")):
        print(f"note: mesh {config.mesh!r} on CPU simulates {devices} devices", file=sys.stderr)
    ensure_environment(devices, module, argv)
    out_dir = args.out_dir or os.path.join("runs", module.rsplit(".", 1)[-1])
    os.makedirs(out_dir, exist_ok=True)
    from bapo_jax.run.config import dump

    dump(config, os.path.join(out_dir, "config.json"))
    try:
        if args.dry_run:
            from bapo_jax.run.dry_run import dry_run

            return dry_run(config, out_dir)
        from bapo_jax.run.build import build_trainer

        with build_trainer(config, out_dir) as trainer:
            return trainer.run()
    except RunConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
