"""Memory plan: will the train step fit on the trainer GPUs? Compiled for a simulated CPU mesh.

    python -m bapo_jax.sharding.plan --model qwen2.5-7b --mesh 7b --attention blockwise
        [--accelerator h100] [--seq-len 9216] [--packed] [--scored-length 8192] [--json]

builds the real-size `TrainState` (fp32 params + AdamW moments) as abstract arrays carrying their
`NamedSharding`s (nothing is allocated), lowers and compiles the FULL jitted train step
(`make_train_step`: chunked log-probs, the BAPO loss and bound search, backward, AdamW) for a mesh
of that many simulated CPU devices, and reads XLA's per-device buffer assignment:

    peak = arguments + outputs - aliased + temporaries        (bytes per device)

(the state is donated, so the new state's outputs alias the old state's arguments). The step
fits when peak <= 85% of one device's memory.

It is an ESTIMATE: XLA:CPU's buffer assignment is not XLA:GPU's (different fusion, a CPU may
up-cast bf16 dots to fp32), and JAX on GPU preallocates and fragments; the 15% headroom is for
that. Exit status: 0 fits, 1 does not fit, 2 bad input.

The simulated devices (`XLA_FLAGS=--xla_force_host_platform_device_count=N`, N = mesh devices)
are set in-process before JAX creates its CPU backend (`mesh.use_cpu_devices`): run the command
as its own process.

This module is the command (argument parsing, text and JSON reports); the compile
and its numbers are `sharding.memory_plan`, the `--top-buffers` diagnostic `sharding.hlo_buffers`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import jax
import jax.numpy as jnp

from bapo_jax.checks import choices
from bapo_jax.models.config import AttentionImpl, ModelOptions, Qwen2Config
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.sharding.memory_plan import (
    DEFAULT_SEQ_LEN,
    FIT_FRACTION,
    SEQ_LEN_QUANTUM,
    MemoryPlan,
    check_sizes,
    find_max_seq_len,
    plan_memory,
    planned_attention,
)
from bapo_jax.train.step import StepConfig

__all__ = ["ESTIMATE_NOTE", "build_parser", "main", "parse_mesh", "parse_model"]

ESTIMATE_NOTE = (
    "estimate: XLA:CPU buffer assignment on simulated CPU devices, not a GPU compile; "
    "fits means peak <= the budget, 85% of device memory unless --memory-share says less "
    "(headroom for GPU fusion differences, fragmentation and JAX's preallocation)"
)
# The one mesh parser (preset or explicit shape); re-exported for callers of the plan module.
parse_mesh = mesh_lib.parse_mesh


def parse_model(name: str) -> Qwen2Config:
    """A `Qwen2Config` preset name, or a path to an HF config.json (or its directory)."""
    if os.path.exists(name):
        return Qwen2Config.from_hf(name)
    return Qwen2Config.preset(name)


# ---- CLI ---------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bapo_jax.sharding.plan",
        description="Per-device memory of the compiled train step on a simulated CPU mesh "
        "(an estimate; fits = peak <= 85%% of device memory).",
    )
    p.add_argument("--model", required=True, help="Qwen2Config preset or path to config.json")
    p.add_argument(
        "--mesh",
        required=True,
        help=f"mesh preset {sorted(mesh_lib.PRESETS)} or 'data=1,fsdp=8,tensor=1'",
    )
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help="tokens per sequence")
    p.add_argument(
        "--micro-batch", type=int, default=1, help="sequences per device per micro-batch"
    )
    p.add_argument("--num-micro-batches", type=int, default=1)
    p.add_argument(
        "--packed",
        action="store_true",
        help="compile for packed rows (segment ids, positions), as the trainer runs by default",
    )
    p.add_argument(
        "--scored-length",
        type=int,
        default=None,
        help="the LM head on this many trained tokens a row (the trainer: the response cap); "
        "default: every position",
    )
    p.add_argument("--remat", default="full", help="ModelOptions.remat policy")
    p.add_argument("--compute-dtype", default="bfloat16")
    p.add_argument("--param-dtype", default="float32")
    p.add_argument(
        "--attention",
        default="plain",
        choices=choices(AttentionImpl),
        help="ModelOptions.attention (blockwise: no [T, T] scores; cudnn: GPU only, planned "
        "as blockwise on CPU, which like it keeps O(T) attention memory)",
    )
    p.add_argument("--loss", default="bapo", help="registered loss name")
    p.add_argument(
        "--accelerator",
        default=None,
        help=f"target device, sets its memory: {sorted(mesh_lib.ACCELERATORS)} "
        "(default: the mesh config's 80 GB)",
    )
    p.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="memory of one device in GB (1e9 bytes); overrides --accelerator",
    )
    p.add_argument(
        "--memory-share",
        type=float,
        default=FIT_FRACTION,
        help=f"the share of a device's memory the step may use (default {FIT_FRACTION}; a "
        "colocated run's: that less its servers' gpu_memory_utilization)",
    )
    p.add_argument("--find-max-seq-len", action="store_true")
    p.add_argument(
        "--top-buffers",
        type=int,
        default=0,
        help="also list the N largest per-device arrays of the compiled step (diagnostic)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _resolve(args: argparse.Namespace):
    """(model config, mesh config, ModelOptions, StepConfig), validated; raises ValueError
    naming the bad field."""
    model_config = parse_model(args.model)
    mesh_config = mesh_lib.parse_mesh(args.mesh)
    if args.accelerator is not None:
        mesh_config = dataclasses.replace(
            mesh_config, device_memory_bytes=mesh_lib.accelerator_memory_bytes(args.accelerator)
        )
    if args.device_memory_gb is not None:
        if not args.device_memory_gb > 0:
            raise ValueError(f"--device-memory-gb must be > 0, got {args.device_memory_gb}")
        mesh_config = dataclasses.replace(
            mesh_config, device_memory_bytes=int(args.device_memory_gb * 10**9)
        )
    mesh_config.check_heads(model_config.num_attention_heads, model_config.num_key_value_heads)
    check_sizes(
        seq_len=args.seq_len,
        micro_batch=args.micro_batch,
        num_micro_batches=args.num_micro_batches,
    )
    if not 0 < args.memory_share <= 1:
        raise ValueError(f"--memory-share must be in (0, 1], got {args.memory_share}")
    if args.top_buffers < 0:
        raise ValueError(f"top_buffers must be >= 0, got {args.top_buffers}")
    try:
        param_dtype, compute_dtype = jnp.dtype(args.param_dtype), jnp.dtype(args.compute_dtype)
    except TypeError as e:
        raise ValueError(f"unknown dtype: {e}") from None
    options = ModelOptions(
        param_dtype=param_dtype,
        compute_dtype=compute_dtype,
        remat=args.remat,
        attention=planned_attention(args.attention, "cpu"),
    )
    step_config = StepConfig(
        loss=args.loss,
        num_micro_batches=args.num_micro_batches,
        scored_length=args.scored_length,
    )
    return model_config, mesh_config, options, step_config


def _gb(x: int) -> str:
    return f"{x / 1e9:8.2f} GB"


def _report_text(args, model_config, mesh_config, options, plan, max_len, probes) -> str:
    m = mesh_config
    lines = [
        f"memory plan -- {ESTIMATE_NOTE}",
        f"model {args.model}: {model_config.num_params() / 1e9:.2f}B params; "
        f"mesh {args.mesh}: data={m.data} x fsdp={m.fsdp} x tensor={m.tensor} "
        f"({m.num_devices} devices)",
        f"seq_len {plan.seq_len}, micro-batch {plan.micro_batch} seq/device x "
        f"{plan.num_micro_batches} micro-batches = {plan.global_batch} sequences per update; "
        f"token budget {plan.token_budget:,} tokens per micro-batch"
        + (" (packed rows)" if plan.packed else " (padded rows)")
        + (f", LM head on {args.scored_length} tokens a row" if args.scored_length else ""),
        f"params {jnp.dtype(options.param_dtype).name}, compute "
        f"{jnp.dtype(options.compute_dtype).name}, remat {options.remat}, attention "
        f"{args.attention}"
        + (" (planned as blockwise on CPU)" if args.attention == "cudnn" else "")
        + (f", accelerator {args.accelerator}" if args.accelerator else ""),
        "per-device memory:",
        f"  arguments    {_gb(plan.argument_bytes)}  (state {_gb(plan.state_bytes).strip()}, "
        f"batch {_gb(plan.batch_bytes).strip()})",
        f"  outputs      {_gb(plan.output_bytes)}",
        f"  aliased     -{_gb(plan.alias_bytes).strip():>11}  (donated state)",
        f"  temporaries  {_gb(plan.temp_bytes)}",
        f"  peak         {_gb(plan.peak_bytes)}  = arguments + outputs - aliased + temporaries "
        f"({plan.peak_bytes} bytes)",
        f"  budget       {_gb(plan.budget_bytes)}  = {plan.fit_fraction:.0%} of "
        f"{_gb(plan.device_memory_bytes).strip()}",
        f"fits: {'YES' if plan.fits else 'NO'}  "
        f"(peak is {plan.peak_bytes / plan.device_memory_bytes:.1%} of device memory)",
        f"lower {plan.lower_seconds:.1f} s, compile {plan.compile_seconds:.1f} s",
    ]
    if plan.largest_buffers:
        lines.append("largest per-device arrays of the compiled step (not a liveness analysis):")
        for r in plan.largest_buffers:
            shape = ",".join(map(str, r.shape))
            lines.append(
                f"  {_gb(r.bytes)}  {r.dtype}[{shape}] x{r.count}  {r.opcode}  {r.op_name[-90:]}"
            )
    if max_len is not None:
        lines.append(
            f"longest sequence that fits (multiple of {SEQ_LEN_QUANTUM}): {max_len} tokens "
            f"({len(probes)} compiles: "
            + ", ".join(f"{p.seq_len}:{'fits' if p.fits else 'no'}" for p in probes)
            + ")"
        )
    return "\n".join(lines)


def _plan_json(plan: MemoryPlan) -> dict[str, Any]:
    out = dataclasses.asdict(plan)
    if not plan.largest_buffers:
        del out["largest_buffers"]
    out["peak_bytes_per_device"] = out.pop("peak_bytes")
    out["fits"] = plan.fits
    out["token_budget"] = plan.token_budget
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model_config, mesh_config, options, step_config = _resolve(args)
    except ValueError as e:
        parser.error(str(e))  # exit status 2
    mesh_lib.use_cpu_devices(mesh_config.num_devices)
    if jax.device_count() != mesh_config.num_devices:
        parser.error(
            f"--mesh needs {mesh_config.num_devices} devices, but JAX started with "
            f"{jax.device_count()} before this command set them (run it as its own process)"
        )

    def plan_at(seq_len: int) -> MemoryPlan:
        return plan_memory(
            model_config,
            mesh_config,
            seq_len=seq_len,
            micro_batch=args.micro_batch,
            num_micro_batches=args.num_micro_batches,
            options=options,
            step_config=step_config,
            top_buffers=args.top_buffers,
            packed=args.packed,
            fit_fraction=args.memory_share,
        )

    plan = plan_at(args.seq_len)
    max_len, probes = None, []
    if args.find_max_seq_len:
        limit = model_config.max_position_embeddings
        cache = {plan.seq_len: plan}

        def cached(seq_len: int) -> MemoryPlan:
            if seq_len not in cache:
                cache[seq_len] = plan_at(seq_len)
            return cache[seq_len]

        max_len, probes = find_max_seq_len(cached, args.seq_len, limit)

    if args.json:
        out: dict[str, Any] = {
            "model": args.model,
            "mesh": args.mesh,
            "mesh_shape": dict(zip(mesh_lib.MESH_AXES, mesh_config.shape, strict=True)),
            "devices": mesh_config.num_devices,
            "num_params": model_config.num_params(),
            "remat": options.remat,
            "param_dtype": jnp.dtype(options.param_dtype).name,
            "compute_dtype": jnp.dtype(options.compute_dtype).name,
            "loss": args.loss,
            "note": ESTIMATE_NOTE,
            **_plan_json(plan),
        }
        out["attention"] = args.attention
        out["accelerator"] = args.accelerator
        if max_len is not None:
            out["max_seq_len"] = max_len
            out["max_seq_len_probes"] = [
                {
                    "seq_len": p.seq_len,
                    "peak_bytes_per_device": p.peak_bytes,
                    "fits": p.fits,
                    "compile_seconds": p.compile_seconds,
                }
                for p in probes
            ]
        print(json.dumps(out))
    else:
        print(_report_text(args, model_config, mesh_config, options, plan, max_len, probes))
    return 0 if plan.fits else 1


if __name__ == "__main__":
    sys.exit(main())
