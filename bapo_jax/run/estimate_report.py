"""The iteration estimate as printed: each phase, what hides, the days for the run's steps, and
the rates (with their sources, docs/pod.md) or the measured kernels it rests on."""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
from typing import Any

from bapo_jax.models.config import Qwen2Config
from bapo_jax.overrides import apply_overrides
from bapo_jax.run.estimate import (
    Estimate,
    Kernels,
    Rates,
    estimate,
    layout_of,
    sync_host_memory,
)

__all__ = ["RATE_SOURCES", "format_estimate", "main", "pod_estimate"]

RATE_SOURCES = {
    "train_mfu": "assumption below published large-model training MFU (PaLM 46.2%, "
    "Chowdhery et al. 2022, Table 3): RL's remat + micro-batch loop on 4-16 GPUs",
    "prefill_mfu": "assumption: prefill is compute-bound GEMMs (vLLM on H100)",
    "decode_bandwidth_share": "assumption: decode streams weights + KV from HBM at ~60% of "
    "peak (memory-bound GEMV; vLLM paged attention)",
    "kv_memory_share": "vLLM --gpu-memory-utilization (default 0.9, vLLM docs)",
    "mean_response_share": "assumption, no public source for this data set: replace it with "
    "a run's logged mean response length / cap",
    "longest_response_share": "the longest response hits the cap (overlong responses exist)",
    "mean_response_tokens": "None: the share above; a run's measured mean (--measured)",
    "longest_response_tokens": "None: the share above; a run's measured longest (--measured)",
    "reward_s_per_response": "assumption: math-verify of one boxed answer (calibrate: "
    "benchmarks.iteration_model)",
    "reward_workers": "the run's rewards.worker_count (half the host's CPUs, 2-32)",
    "sync_write_gb_s": "assumption: Orbax write to node-local NVMe incl. device-to-host copy",
    "sync_read_gb_s": "assumption: page-cache / NVMe read + XXH3 check (this CPU: 6.6-7.0 GB/s, "
    "docs/rollout.md)",
    "sync_reload_gb_s": "assumption: host-to-device copy over PCIe Gen5 x16 (~50 GB/s peak) "
    "through vLLM's weight loaders",
    "checkpoint_gb_s": "assumption: Orbax async save of params + AdamW moments",
    "reshard_gb_s": "assumption: NVLink-local weight handoff (verl colocated)",
    "eval_problems": "30 per AIME set",
    "tp_allreduce_s": "assumption: a small NCCL all-reduce over NVLink is latency-bound, "
    "~10-30 us (nccl-tests all_reduce_perf at KB sizes on 8 x H100)",
}
PHASES = ("reward", "logprob", "update", "sync_write", "sync_stage", "sync_reload", "eval",
          "checkpoint", "overhead")  # fmt: skip


def format_estimate(
    est: Estimate,
    rates: Rates,
    accelerator: str,
    model: Qwen2Config,
    kernels: Kernels | None = None,
) -> str:
    """The estimate as printed: phases, what is exposed and hidden, the days for the steps,
    and the rates (or the measured kernels) it rests on."""
    p, lines = est.phases, [f"iteration estimate: {est.layout.label}, {accelerator}"]
    room = "not modelled" if est.kv_capacity is None else str(est.kv_capacity)
    lines.append(
        f"  generation {p['prefill'] + p['decode']:8.0f} s  (prefill {p['prefill']:.0f} s, decode "
        f"{p['decode']:.0f} s at {est.concurrency} sequences per server; KV room for {room})"
    )
    lines += [f"  {name:<10} {p[name]:8.1f} s" for name in PHASES]
    lines.append(
        f"  iteration  {est.iteration_s:8.0f} s  ({est.iteration_s / 60:.1f} min; hidden "
        f"{est.hidden_s:.0f} s); {est.steps} steps: {est.days:.2f} days"
    )
    if est.adapters:
        lines.append(
            f"  sync: the LoRA adapters alone, {est.sync_bytes / 1e6:.1f} MB a version "
            f"({est.adapters:,} parameters; the base's {2 * model.num_params() / 1e9:.1f} GB "
            "stays on the servers)"
        )
    elif not est.layout.reference and kernels is None:
        mem = sync_host_memory(model, est.layout)
        lines.append(
            f"  sync host memory per server node: {mem.peak / 1e9:.1f} GB peak, "
            f"{mem.peak / mem.held:.2f}x what its ranks hold ({mem.servers} server(s) x "
            f"{mem.ranks} rank(s); a server's first rank reads {mem.version / 1e9:.1f} GB, "
            f"its others {mem.reads[-1] / 1e9:.0f} GB; every rank reading for itself: "
            f"{mem.unshared / 1e9:.0f} GB)"
        )
    if every := est.checkpoint_every:
        lines.append(
            f"  a run checkpoint every {every} iterations: up to "
            f"{every * est.iteration_s / 60:.0f} min of work lost to a crash"
        )
    if kernels is not None:
        lines.append(f"  kernels measured ({kernels.source}):")
        for f in dataclasses.fields(kernels):
            if f.name not in ("source", "kv_capacity"):
                lines.append(f"    {f.name} = {getattr(kernels, f.name):.4g} s")
        lines.append(
            f"  lengths: mean {rates.mean_response_tokens} / longest "
            f"{rates.longest_response_tokens} response tokens (measured)"
        )
        return "\n".join(lines)
    lines.append("  rates (override with --rate name=value; sources: docs/pod.md):")
    for f in dataclasses.fields(rates):
        lines.append(f"    {f.name} = {getattr(rates, f.name)}  [{RATE_SOURCES[f.name]}]")
    lines.append(f"    accelerator: {est.source}")
    return "\n".join(lines)


def pod_estimate(config: Any, model: Qwen2Config) -> str:
    """What a run prints at its start (and its dry run): its own layout at the default rates
    (`python -m bapo_jax.run.estimate` redoes it with other rates or layouts)."""
    try:
        rates = Rates()
        found = estimate(config, model, layout_of(config), rates, config.accelerator)
    except ValueError as error:
        return f"iteration estimate: none ({error})"
    return format_estimate(found, rates, config.accelerator, model)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="An iteration cost model of a run on a GPU/TPU pod")
    ap.add_argument("experiment", help="a module with a CONFIG, e.g. experiments.aime_7b")
    ap.add_argument("--accelerator", default=None, help="default: the run's accelerator")
    ap.add_argument("--trainer-gpus", type=int, default=None)
    ap.add_argument("--servers", type=int, default=None)
    ap.add_argument("--server-gpus", type=int, default=None, help="tensor parallel per server")
    ap.add_argument("--staleness", type=int, default=None)
    ap.add_argument(
        "--separate",
        action="store_true",
        help="the servers on GPUs of their own, even where the run colocates them",
    )
    ap.add_argument("--rate", action="append", default=[], help="name=value (Rates)")
    ap.add_argument(
        "--measured",
        action="append",
        default=[],
        metavar="RUN_DIR",
        help="kernels and lengths fitted to these runs' metrics (bapo_jax.run.measured) "
        "instead of the accelerator's datasheet",
    )
    ap.add_argument(
        "--rank",
        type=int,
        default=None,
        metavar="NODES",
        help="rank the trainer / vLLM splits and colocated layouts of NODES 8-GPU nodes that "
        "the memory plan proves fit, with speed-ups over the run's layout or the one the "
        "flags give (bapo_jax.run.layouts; compiles the step once per trainer size)",
    )
    ap.add_argument("overrides", nargs="*", help="key.sub=value settings of the run config")
    args = ap.parse_intermixed_args(argv)
    try:
        config = apply_overrides(importlib.import_module(args.experiment).CONFIG, args.overrides)
        rates = Rates().replace_from(args.rate)
        layout = layout_of(config, servers=args.servers, server_gpus=args.server_gpus,
                           trainer_gpus=args.trainer_gpus, staleness=args.staleness,
                           separate=args.separate)  # fmt: skip
        accelerator = args.accelerator or config.accelerator
        model = Qwen2Config.preset(config.model.preset)
        kernels = None
        if args.measured:
            from bapo_jax.run import measured  # it imports this module

            found = measured.fit([measured.load_run(d) for d in args.measured])
            kernels = found.kernels
            rates = dataclasses.replace(
                rates,
                mean_response_tokens=found.rates.mean_response_tokens,
                longest_response_tokens=found.rates.longest_response_tokens,
            )
        if args.rank is not None:
            flags = os.environ.get("XLA_FLAGS", "")
            if "xla_force_host_platform_device_count" not in flags:  # before JAX starts
                os.environ["XLA_FLAGS"] = (
                    f"{flags} --xla_force_host_platform_device_count={8 * args.rank}"
                ).strip()
            from bapo_jax.run import layouts

            ranked = layouts.rank(config, model, rates, accelerator, args.rank)
            print(layouts.format_ranking(ranked, layout, layout_of(config)))
            return
        found_estimate = estimate(config, model, layout, rates, accelerator, kernels)
    except (ValueError, ModuleNotFoundError, AttributeError) as error:
        raise SystemExit(f"error: {error}") from None
    print(format_estimate(found_estimate, rates, accelerator, model, kernels))
