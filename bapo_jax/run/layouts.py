"""The trainer / vLLM splits of a pod, ranked by the iteration model, among those that fit.

    python -m bapo_jax.run.estimate experiments.aime_7b --rank 1     # nodes of 8 GPUs

Separate splits (the trainer on D GPUs, S servers of g on the rest, staleness 0 and 1) and
colocated layouts (servers of g on the trainer's GPUs at a share u of their memory,
`SERVER_SHARES`), each fitting when the trainer's step, compiled for its mesh by the memory
plan, fits its budget and a server's GPUs hold the weights with KV room for one request; the
fitting ones ranked by the estimate, verl's colocated layout as a reference line (docs/pod.md,
"Which layout").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from bapo_jax.models.config import Qwen2Config
from bapo_jax.overrides import apply_overrides
from bapo_jax.rollout.server_settings import check_vllm_heads
from bapo_jax.run import estimate as est
from bapo_jax.run import preflight

__all__ = ["Candidate", "candidate_config", "format_ranking", "plan_peak", "rank"]

SERVER_GPUS = (1, 2, 4, 8)
SERVER_SHARES = (0.3, 0.4, 0.5)  # colocated servers' vLLM --gpu-memory-utilization


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
    one micro-batch row per batch device (data x fsdp), S launched servers of g GPUs (at vLLM's
    default memory share if the run colocates its own), staleness k; colocated, the servers on
    the trainer's GPUs in groups of g at share u (GPUs numbered across the pod: the estimate's
    bookkeeping; past a node, servers are started on each node and given by URL)."""
    tensor = config.mesh_config().tensor
    t = config.trainer
    rows = t.rows_per_batch // t.algorithm.mini_batches
    batch_devices = layout.trainer_gpus // tensor  # data x fsdp: the axes that split the batch
    if rows % batch_devices:
        raise ValueError(f"the {rows} rows of an update do not split over {batch_devices} devices")
    micro = rows // batch_devices
    placed = apply_overrides(
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
            "engine.colocate=false",
        ],
    )
    if not layout.colocated:  # servers on GPUs of their own hold vLLM's default share
        if not config.engine.colocated:
            return placed
        server = dataclasses.replace(placed.engine.server, gpu_memory_utilization=None)
        return dataclasses.replace(placed, engine=dataclasses.replace(placed.engine, server=server))
    g, servers = layout.server_gpus, layout.generating_servers
    devices = tuple(",".join(str(s * g + i) for i in range(g)) for s in range(servers))
    server = dataclasses.replace(
        placed.engine.server, devices=devices, gpu_memory_utilization=layout.server_share
    )
    engine = dataclasses.replace(
        placed.engine, launch_servers=servers, server=server, colocate=True
    )
    return dataclasses.replace(placed, engine=engine)


def plan_peak(config: Any) -> tuple[float | None, str]:
    """(peak bytes per device, refusal) of the run's train step compiled for its mesh on
    simulated CPU devices; a mesh that does not divide the model is a refusal (the budget is
    `rank`'s to check: a colocated layout's depends on its servers' share)."""
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
    return plan.peak_bytes + plan.reference_bytes, ""


def _budget_refusal(config: Any, peak: float | None) -> str:
    """Why the trainer's `peak` bytes do not fit its budget on `config`'s layout ("" if they do)."""
    if peak is None:
        return ""
    share = preflight.trainer_memory_share(config)
    budget = share * config.mesh_config().device_memory_bytes
    if peak <= budget:
        return ""
    return f"trainer peak {peak / 1e9:.1f} GB > budget {budget / 1e9:.1f} GB ({share:.0%})"


def _server_refusal(config: Any, model: Qwen2Config, layout: est.Layout, accelerator: str) -> str:
    try:
        check_vllm_heads(layout.server_gpus, model.num_attention_heads, model.num_key_value_heads)
    except ValueError as error:
        return f"vLLM refuses it: {error}"
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
) -> list[Candidate]:
    """Every split of `nodes` nodes at staleness 0 and 1 and every colocated layout, the fitting
    ones first by estimated iteration time, then verl's colocated reference, then those that
    do not fit (each listed once)."""
    total = nodes * est.GPUS_PER_NODE
    tensor = config.mesh_config().tensor
    plans: dict[int, tuple[float | None, str]] = {}  # the trainer's plan by its GPUs
    fitting, refused = [], []

    def consider(layout: est.Layout) -> None:
        try:
            candidate = candidate_config(config, layout)
        except ValueError as error:
            if not layout.staleness:
                refused.append(Candidate(layout, None, None, str(error)))
            return
        if layout.trainer_gpus not in plans:
            plans[layout.trainer_gpus] = peak(candidate)
        bytes_, mesh_refusal = plans[layout.trainer_gpus]
        refusal = (
            mesh_refusal
            or _budget_refusal(candidate, bytes_)
            or _server_refusal(candidate, model, layout, accelerator)
        )
        if refusal and layout.staleness:  # listed once, at staleness 0
            return
        found = None if refusal else est.estimate(candidate, model, layout, rates, accelerator)
        (refused if refusal else fitting).append(Candidate(layout, found, bytes_, refusal))

    for trainer in range(tensor, total, tensor):
        for g in SERVER_GPUS:
            if (total - trainer) // g >= 1:
                for k in (0, 1):
                    consider(est.Layout(trainer, (total - trainer) // g, g, k))
    for g in SERVER_GPUS:
        for share in SERVER_SHARES:
            consider(est.Layout(total, total // g, g, 0, colocated=True, server_share=share))
    fitting.sort(key=lambda c: c.estimate.iteration_s)
    g = min(x for x in SERVER_GPUS if not _server_refusal(config, model, est.Layout(
        total, 1, x, 0, colocated=True), accelerator))  # fmt: skip
    colocated = est.Layout(total, 1, g, 0, colocated=True)
    reference = Candidate(
        colocated, est.estimate(config, model, colocated, rates, accelerator), None, ""
    )
    return [*fitting, reference, *refused]


def format_ranking(
    ranked: list[Candidate], baseline: est.Layout, default: est.Layout | None = None
) -> str:
    """The ranking as a table: each layout's estimate and its speed-up over `baseline`'s; the
    run's `default` layout marked."""
    base = next(
        (c.estimate.iteration_s for c in ranked if c.layout == baseline and c.estimate), None
    )
    lines = [
        "| layout | trainer plan peak | generation | update | iteration | days | vs baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in ranked:
        peak = "-" if c.peak_bytes is None else f"{c.peak_bytes / 1e9:.1f} GB"
        marks = [m for m, at in (("default", default), ("baseline", baseline)) if c.layout == at]
        label = c.layout.label + (f" ({', '.join(marks)})" if marks else "")
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
