"""The trainer / vLLM splits of a pod, ranked by the iteration model, among those that fit.

    python -m bapo_jax.run.estimate experiments.aime_7b --rank 1     # nodes of 8 GPUs

A candidate gives the trainer D GPUs (a multiple of the run mesh's tensor size: the mesh
becomes data=1, fsdp=D/tensor, tensor) and the rest to S servers of g GPUs each (g in 1, 2, 4,
8, within a node), at staleness 0 and 1. It fits when the trainer's step, compiled for its mesh
by the memory plan (`run.preflight.plan_run`, one micro-batch row per batch device), peaks within
the plan's budget, and a server's g GPUs hold the bf16 weights with KV room for one request's
G sequences at the mean context. Fitting candidates are ranked by the estimated iteration time;
the colocated layout (verl's: every GPU generates, then trains) follows as a reference line
(this project runs trainer and servers on separate GPUs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from bapo_jax.models.config import Qwen2Config
from bapo_jax.run import estimate as est

__all__ = ["Candidate", "candidate_config", "format_ranking", "plan_peak", "rank"]

SERVER_GPUS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One split: its layout, its estimate (None when it does not fit), the trainer plan's
    peak bytes per device (None: not planned) and why it does not fit ("" when it does)."""

    layout: est.Layout
    estimate: est.Estimate | None
    peak_bytes: float | None
    refusal: str = ""


def candidate_config(config: Any, layout: est.Layout) -> Any:
    """`config` on `layout`: the trainer's mesh over D devices (the run's tensor size kept),
    one micro-batch row per batch device (data x fsdp), S launched servers of g GPUs,
    staleness k."""
    from bapo_jax.overrides import apply_overrides

    tensor = config.mesh_config().tensor
    t = config.trainer
    rows = t.rows_per_batch // t.algorithm.mini_batches
    batch_devices = layout.trainer_gpus // tensor  # data x fsdp: the axes that split the batch
    if rows % batch_devices:
        raise ValueError(f"the {rows} rows of an update do not split over {batch_devices} devices")
    micro = rows // batch_devices
    return apply_overrides(
        config,
        [
            f"mesh=data=1,fsdp={layout.trainer_gpus // tensor},tensor={tensor}",
            f"trainer_devices={layout.trainer_gpus}",
            f"trainer.algorithm.micro_batches={micro}",
            f"trainer.offpolicy.staleness={layout.staleness}",
            f"engine.launch_servers={layout.servers}",
            "engine.vllm_urls=[]",
            f"engine.server.tensor_parallel_size={layout.server_gpus}",
            "engine.server.devices=[]",
        ],
    )


def plan_peak(config: Any) -> tuple[float | None, str]:
    """(peak bytes per device, refusal) of the run's train step compiled for its mesh on
    simulated CPU devices; a mesh that does not divide the model is a refusal."""
    import jax

    from bapo_jax.run import preflight

    devices = config.mesh_config().num_devices
    if len(jax.devices()) < devices:
        raise ValueError(
            f"--rank: the plan of {devices} trainer devices needs as many simulated CPU "
            f"devices (XLA_FLAGS=--xla_force_host_platform_device_count={devices}); "
            f"JAX has {len(jax.devices())}"
        )
    try:
        plan = preflight.plan_run(config, devices=jax.devices()[:devices])
    except ValueError as error:  # e.g. a dimension the mesh does not divide
        return None, f"mesh {config.mesh}: {error}".splitlines()[0]
    peak = plan.peak_bytes + plan.reference_bytes
    if not plan.fits:
        return peak, f"trainer peak {peak / 1e9:.1f} GB > budget {plan.budget_bytes / 1e9:.1f} GB"
    return peak, ""


def _server_refusal(config: Any, model: Qwen2Config, layout: est.Layout, accelerator: str) -> str:
    kernels = est.gpu_kernels(config, model, layout, est.Rates(), accelerator)
    group = config.trainer.rollout.samples_per_prompt
    if (kernels.kv_capacity or 0) < group:
        return (
            f"a server of {layout.server_gpus} GPU(s) holds KV for {kernels.kv_capacity} "
            f"sequences, fewer than one request's {group}"
        )
    return ""


def rank(
    config: Any,
    model: Qwen2Config,
    rates: est.Rates,
    accelerator: str,
    nodes: int,
    peak: Callable[[Any], tuple[float | None, str]] = plan_peak,
    gpus_per_node: int = est.GPUS_PER_NODE,
) -> list[Candidate]:
    """Every split of `nodes` nodes at staleness 0 and 1, the fitting ones first by estimated
    iteration time, then the colocated reference, then those that do not fit."""
    total = nodes * gpus_per_node
    tensor = config.mesh_config().tensor
    plans: dict[int, tuple[float | None, str]] = {}
    fitting, refused = [], []
    for trainer in range(tensor, total, tensor):
        for g in SERVER_GPUS:
            servers = (total - trainer) // g
            if g > gpus_per_node or servers < 1:
                continue
            for k in (0, 1):
                layout = est.Layout(trainer, servers, g, k)
                try:
                    candidate = candidate_config(config, layout)
                except ValueError as error:
                    if not k:
                        refused.append(Candidate(layout, None, None, str(error)))
                    continue
                refusal = _server_refusal(candidate, model, layout, accelerator)
                if trainer not in plans:
                    plans[trainer] = peak(candidate)
                bytes_, trainer_refusal = plans[trainer]
                refusal = trainer_refusal or refusal
                if refusal and k:  # listed once, at staleness 0
                    continue
                found = (
                    None if refusal else est.estimate(candidate, model, layout, rates, accelerator)
                )
                (refused if refusal else fitting).append(Candidate(layout, found, bytes_, refusal))
    fitting.sort(key=lambda c: c.estimate.iteration_s)
    g = min(x for x in SERVER_GPUS if not _server_refusal(config, model, est.Layout(
        total, 1, x, 0, colocated=True), accelerator))  # fmt: skip
    colocated = est.Layout(total, 1, g, 0, colocated=True)
    reference = Candidate(
        colocated, est.estimate(config, model, colocated, rates, accelerator), None, ""
    )
    return [*fitting, reference, *refused]


def format_ranking(ranked: list[Candidate], today: est.Layout) -> str:
    """The ranking as a table: each split's estimate and its speed-up over `today`'s."""
    base = next((c.estimate.iteration_s for c in ranked if c.layout == today and c.estimate), None)
    lines = [
        "| layout | trainer plan peak | generation | update | iteration | days | vs today |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in ranked:
        peak = "-" if c.peak_bytes is None else f"{c.peak_bytes / 1e9:.1f} GB"
        label = c.layout.label + (" (today)" if c.layout == today else "")
        if c.estimate is None:
            lines.append(f"| {label} | {peak} | does not fit: {c.refusal} | | | | |")
            continue
        p, e = c.estimate.phases, c.estimate
        speed = f"{base / e.iteration_s:.2f}x" if base else "-"
        lines.append(
            f"| {label} | {peak} | {p['prefill'] + p['decode']:,.0f} s | {p['update']:,.0f} s "
            f"| {e.iteration_s / 60:.1f} min | {e.days:.2f} | {speed} |"
        )
    return "\n".join(lines)
