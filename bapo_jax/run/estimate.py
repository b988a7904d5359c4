"""An iteration cost model of a run on a GPU/TPU pod: what each phase costs, what hides.

    python -m bapo_jax.run.estimate experiments.aime_7b [--accelerator h100] [--trainer-gpus 4]
        [--servers 4] [--server-gpus 1] [--staleness 1] [--rate train_mfu=0.4 ...] [key=value]

No accelerator is reachable from this project's machines, so the pod is a model: every rate
is an assumption printed beside its number with its public source (docs/pod.md), and any of
them can be replaced (`--rate name=value`, e.g. with what a real run's first iterations
measured). Per iteration of `config` (B prompts x G samples, prompt / response caps P / L):

    generation (per server, the servers in parallel; S servers of g GPUs each)
      prefill   = 2 N x prompt tokens / (g x peak x prefill_mfu)
      decode    = steps x step time; concurrency c = min(sequences in flight, KV capacity)
                  KV capacity = (g x memory x kv_memory_share - 2 N bytes) / (kv bytes a token
                  x mean context); a step streams the weights and the c sequences' KV:
                  step time = max((2 N + c x kv x ctx) / (g x HBM x decode_bandwidth_share),
                                  2 N c / (g x peak x prefill_mfu));
                  steps = max(response tokens per server / c, L x longest_response_share)
    reward      = B G x reward_s_per_response / reward workers
    log-prob    = (2 N + 2 l d T) x tokens / (D x peak x train_mfu), per forward pass
                  (the old policy's when ratio_base is "recomputed"; the reference's with KL)
    updates     = epochs x tokens x (6 N + 6 l d T)(x 4/3 with full remat) / (D x peak x
                  train_mfu)     (PaLM's 6N + 12 l d T per trained token, causal: half the
                  attention; T the mean sequence; D trainer devices)
    sync        = write 2 N / sync_write (trainer), stage 2 N / sync_read (servers, while they
                  generate), reload 2 N / sync_reload (servers paused)
    eval, checkpoint: their cost every `eval_every` / `checkpoint.every` iterations, amortized

At staleness 0 everything runs in turn; at k >= 1 the trainer's log-prob + updates + write
run beside the servers' generation of the next batch (+ reward), the staged read beside it
too, and the reload between batches is exposed. `colocated` is verl's layout on the same GPUs
(a reference line: every GPU generates, then every GPU trains, plus a reshard of the weights).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bapo_jax.models.config import Qwen2Config

__all__ = [
    "ACCELERATOR_SPECS",
    "Accelerator",
    "Estimate",
    "Layout",
    "Rates",
    "SyncHostMemory",
    "estimate",
    "sync_host_memory",
]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """peak_flops: dense bf16 FLOP/s; hbm: bytes/s; memory: bytes (as `mesh.ACCELERATORS`)."""

    peak_flops: float
    hbm: float
    memory: float
    source: str


_SXM = "NVIDIA {} datasheet: {} TFLOP/s bf16 dense, {} HBM"
ACCELERATOR_SPECS: dict[str, Accelerator] = {
    "h100": Accelerator(989e12, 3.35e12, 80e9, _SXM.format("H100 SXM5", 989, "3.35 TB/s")),
    "h200": Accelerator(989e12, 4.8e12, 141e9, _SXM.format("H200 SXM", 989, "4.8 TB/s")),
    "a100-80gb": Accelerator(312e12, 2.039e12, 80e9, _SXM.format("A100 80GB", 312, "2.039 TB/s")),
    "a100-40gb": Accelerator(312e12, 1.555e12, 40e9, _SXM.format("A100 40GB", 312, "1.555 TB/s")),
    "tpu-v5e": Accelerator(197e12, 819e9, 16e9, "Cloud TPU v5e docs: 197 TFLOP/s bf16, 819 GB/s"),
    "tpu-v5p": Accelerator(
        459e12, 2765e9, 95e9, "Cloud TPU v5p docs: 459 TFLOP/s bf16, 2,765 GB/s"
    ),
}


@dataclasses.dataclass(frozen=True)
class Rates:
    """The model's assumptions (docs/pod.md cites each); `--rate name=value` replaces one.

    train_mfu:              model FLOPs utilization of the trainer's passes (6N rule).
    prefill_mfu:            the servers' prefill (and decode's compute bound).
    decode_bandwidth_share: share of HBM bandwidth a decoding step achieves.
    kv_memory_share:        share of a server GPU's memory vLLM takes (None: the run's
                            `engine.server.gpu_memory_utilization`, else vLLM's default 0.9).
    mean_response_share:    mean response length / the cap L.
    longest_response_share: the longest response / L (bounds the decode steps: the tail).
    reward_s_per_response:  seconds a reward worker spends on one response.
    reward_workers:         None: the run's reward workers (`rewards.worker_count`).
    sync_write_gb_s / sync_read_gb_s / sync_reload_gb_s: the trainer's checkpoint write, a
                            server's staged read, vLLM's in-place reload (GB/s of bf16).
    checkpoint_gb_s:        the run checkpoint's write (params + AdamW moments, fp32).
    eval_problems:          None: 30 per eval set (AIME 2024 and 2025 hold 30 each) or
                            `eval.limit`.
    reshard_gb_s:           colocated layouts only: moving the weights between trainer and
                            engine on the same GPUs.
    """

    train_mfu: float = 0.35
    prefill_mfu: float = 0.5
    decode_bandwidth_share: float = 0.6
    kv_memory_share: float | None = None
    mean_response_share: float = 0.6
    longest_response_share: float = 1.0
    reward_s_per_response: float = 0.02
    reward_workers: int | None = None
    sync_write_gb_s: float = 2.0
    sync_read_gb_s: float = 5.0
    sync_reload_gb_s: float = 10.0
    checkpoint_gb_s: float = 2.0
    reshard_gb_s: float = 100.0
    eval_problems: int | None = None

    def replace_from(self, pairs: list[str]) -> Rates:
        """`name=value` strings -> a copy with those rates; an unknown name or a value that is
        not a positive number is refused naming it."""
        fields = {f.name: f for f in dataclasses.fields(self)}
        changes: dict[str, Any] = {}
        for pair in pairs:
            name, sep, value = pair.partition("=")
            if not sep or name not in fields:
                raise ValueError(
                    f"--rate {pair!r}: expected name=value, name one of {sorted(fields)}"
                )
            try:
                number = float(value)
            except ValueError:
                raise ValueError(f"--rate {name}: {value!r} is not a number") from None
            if not number > 0:
                raise ValueError(f"--rate {name}: must be > 0, got {value}")
            whole = name in ("reward_workers", "eval_problems")
            changes[name] = int(number) if whole else number
        return dataclasses.replace(self, **changes)


@dataclasses.dataclass(frozen=True)
class Layout:
    """trainer_gpus: D, the trainer's devices; servers: S vLLM servers of server_gpus GPUs each
    (tensor parallel); staleness: the loop's k; colocated: every GPU does both, in turn."""

    trainer_gpus: int
    servers: int
    server_gpus: int
    staleness: int
    colocated: bool = False

    def __post_init__(self) -> None:
        for name in ("trainer_gpus", "servers", "server_gpus"):
            if getattr(self, name) < 1:
                raise ValueError(f"Layout.{name} must be >= 1, got {getattr(self, name)}")
        if self.staleness < 0:
            raise ValueError(f"Layout.staleness must be >= 0, got {self.staleness}")

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated on {self.trainer_gpus} (verl-style reference)"
        return (
            f"{self.trainer_gpus} trainer + {self.servers} x {self.server_gpus} vLLM, "
            f"staleness {self.staleness}"
        )


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Seconds per iteration of each phase; `iteration_s`: the loop's wall time; `hidden_s`:
    the seconds of the phases that ran beside another (their sum minus the wall time);
    `concurrency`: sequences a server decodes at once; `kv_capacity`: how many its KV cache
    holds at the mean context (0: the weights leave no room); `checkpoint_every`: the run's
    checkpoint cadence in iterations (the work a crash can lose)."""

    layout: Layout
    phases: dict[str, float]
    concurrency: int
    kv_capacity: int
    iteration_s: float
    hidden_s: float
    days: float
    checkpoint_every: int = 0


GPUS_PER_NODE = 8  # an HGX node (H100 / H200 / A100 SXM): the servers' host memory per node
READ_FILES, READ_SEGMENT = 4, 64 << 20  # sync_read: files in flight per reader, a segment each


@dataclasses.dataclass(frozen=True)
class SyncHostMemory:
    """A server node's host memory during a weight sync (bytes). ``servers`` x ``ranks``: the
    servers on the node and each one's ranks there; ``version``: 2 N (bf16); ``peak``: with
    ``node_share`` (a server of several ranks restores the version once into its shared
    buffer, dropping each segment's cached pages as it goes: a version plus the segments in
    flight; a one-rank server restores into its own heap, the files cached once for the
    node); ``held``: what the node's ranks hold (each server's ranks: one version between
    them); ``unshared``: every rank restoring for itself; ``reads``: bytes each rank of a
    server reads from the sync directory (its reader, then the others)."""

    servers: int
    ranks: int
    version: int
    peak: int
    held: int
    unshared: int
    reads: tuple[int, ...]


def sync_host_memory(
    model: Qwen2Config, layout: Layout, gpus_per_node: int = GPUS_PER_NODE
) -> SyncHostMemory:
    """The host memory of one server node during a sync (`SyncHostMemory`)."""
    version = 2 * model.num_params()
    ranks = min(layout.server_gpus, gpus_per_node)
    servers = max(1, min(layout.servers, gpus_per_node // ranks))
    if ranks > 1:
        peak = servers * (version + READ_FILES * READ_SEGMENT)
    else:
        peak = servers * version + version
    return SyncHostMemory(
        servers=servers,
        ranks=ranks,
        version=version,
        peak=peak,
        held=servers * version,
        unshared=servers * ranks * version + version,
        reads=(version,) + (0,) * (ranks - 1),
    )


def kv_bytes_per_token(model: Qwen2Config, dtype_bytes: int = 2) -> int:
    """K and V of every layer: 2 x l x K x H x bytes."""
    return 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * dtype_bytes


def estimate(
    config: Any, model: Qwen2Config, layout: Layout, rates: Rates, accelerator: str
) -> Estimate:
    """The cost model of the module doc for `config` (a `RunConfig`) on `layout`."""
    if accelerator not in ACCELERATOR_SPECS:
        raise ValueError(f"accelerator {accelerator!r}: known {sorted(ACCELERATOR_SPECS)}")
    acc = ACCELERATOR_SPECS[accelerator]
    t, r = config.trainer, config.trainer.rollout
    n, weights = model.num_params(), 2 * model.num_params()  # bf16 serving and sync
    responses = r.prompts_per_step * r.samples_per_prompt
    mean_response = r.max_response_tokens * rates.mean_response_share
    mean_seq = r.max_prompt_tokens + mean_response  # prompts padded to P on the trainer
    tokens = responses * mean_seq
    attn = model.num_hidden_layers * model.hidden_size * mean_seq  # l d T

    # Generation: S servers in parallel, each B G / S responses.
    gpus_gen = layout.server_gpus  # colocated: every GPU group of that size serves, in turn
    servers = layout.trainer_gpus // gpus_gen if layout.colocated else layout.servers
    share = rates.kv_memory_share or config.engine.server.gpu_memory_utilization or 0.9
    kv = kv_bytes_per_token(model)
    ctx = r.max_prompt_tokens + mean_response / 2  # a sequence's mean resident context
    kv_capacity = max(0, int((gpus_gen * acc.memory * share - weights) // (kv * ctx)))
    per_server = responses / servers
    in_flight = min(per_server, config.engine.requests_per_server * r.samples_per_prompt)
    c = max(1, min(int(in_flight), kv_capacity))
    step_s = max(
        (weights + c * kv * ctx) / (gpus_gen * acc.hbm * rates.decode_bandwidth_share),
        2 * n * c / (gpus_gen * acc.peak_flops * rates.prefill_mfu),
    )
    steps = max(
        per_server * mean_response / c, r.max_response_tokens * rates.longest_response_share
    )
    prefill = (
        2 * n * per_server * r.max_prompt_tokens / (gpus_gen * acc.peak_flops * rates.prefill_mfu)
    )
    workers = rates.reward_workers or config.rewards.worker_count

    trainer_flops = layout.trainer_gpus * acc.peak_flops * rates.train_mfu
    forward = (2 * n + 2 * attn) * tokens / trainer_flops
    passes = int(t.algorithm.ratio_base == "recomputed") + int(
        t.algorithm.reference_hf_dir is not None
    )
    remat = 4 / 3 if config.model.remat not in (False, "none") else 1.0
    update = t.algorithm.epochs * (6 * n + 6 * attn) * tokens * remat / trainer_flops
    phases = {
        "prefill": prefill,
        "decode": steps * step_s,
        "reward": responses * rates.reward_s_per_response / workers,
        "logprob": passes * forward,
        "update": update,
        "sync_write": 0.0 if layout.colocated else weights / (rates.sync_write_gb_s * 1e9),
        "sync_stage": 0.0 if layout.colocated else weights / (rates.sync_read_gb_s * 1e9),
        "sync_reload": (weights / (rates.reshard_gb_s * 1e9) if layout.colocated
                        else weights / (rates.sync_reload_gb_s * 1e9)),
        "checkpoint": (12 * n / (rates.checkpoint_gb_s * 1e9)) / max(1, t.checkpoint.every),
    }  # fmt: skip
    if t.eval_every:  # one eval's generation, amortized: the eval set x samples on the servers
        problems = rates.eval_problems or config.eval.limit or 30 * len(config.eval.sets)
        eval_tokens = (
            problems * config.eval.samples * config.eval.max_tokens * rates.mean_response_share
        )
        phases["eval"] = eval_tokens / (servers * c) * step_s / t.eval_every
    else:
        phases["eval"] = 0.0
    generate = phases["prefill"] + phases["decode"] + phases["reward"]
    train = phases["logprob"] + phases["update"] + phases["sync_write"]
    fixed = phases["sync_reload"] + phases["checkpoint"] + phases["eval"]
    if layout.colocated or layout.staleness == 0:
        iteration = generate + train + phases["sync_stage"] + fixed
        hidden = 0.0
    else:  # the next batch generates while this one trains; the staged read beside it
        iteration = max(generate, train + phases["sync_stage"]) + fixed
        hidden = generate + train + phases["sync_stage"] + fixed - iteration
    return Estimate(
        layout=layout,
        phases=phases,
        concurrency=c,
        kv_capacity=kv_capacity,
        iteration_s=iteration,
        hidden_s=hidden,
        days=iteration * t.steps / 86400,
        checkpoint_every=t.checkpoint.every,
    )


# ---- report ------------------------------------------------------------------------------------
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
}


def layout_of(
    config: Any,
    *,
    servers: int | None = None,
    server_gpus: int | None = None,
    trainer_gpus: int | None = None,
    staleness: int | None = None,
) -> Layout:
    """The run's own layout (`trainer_devices` or the mesh's devices, the launched and given
    servers, `tensor_parallel_size`, `offpolicy.staleness`), any field replaced."""
    e = config.engine
    if trainer_gpus is None:
        devices = config.trainer_devices
        trainer_gpus = (
            len(devices) if isinstance(devices, tuple) else devices
        ) or config.mesh_config().num_devices
    return Layout(
        trainer_gpus=trainer_gpus,
        servers=servers or (e.launch_servers + len(e.vllm_urls)) or 1,
        server_gpus=server_gpus or e.server.tensor_parallel_size,
        staleness=config.trainer.offpolicy.staleness if staleness is None else staleness,
    )  # fmt: skip


def format_estimate(
    est: Estimate, rates: Rates, accelerator: str, steps: int, model: Qwen2Config
) -> str:
    """The estimate as printed: phases, what is exposed and hidden, the days for the steps."""
    p, lines = est.phases, [f"iteration estimate: {est.layout.label}, {accelerator}"]
    lines.append(
        f"  generation {p['prefill'] + p['decode']:8.0f} s  (prefill {p['prefill']:.0f} s, decode "
        f"{p['decode']:.0f} s at {est.concurrency} sequences per server; KV room for "
        f"{est.kv_capacity})"
    )
    for name in ("reward", "logprob", "update", "sync_write", "sync_stage", "sync_reload",
                 "eval", "checkpoint"):  # fmt: skip
        lines.append(f"  {name:<10} {p[name]:8.1f} s")
    lines.append(
        f"  iteration  {est.iteration_s:8.0f} s  ({est.iteration_s / 60:.1f} min; hidden "
        f"{est.hidden_s:.0f} s); {steps} steps: {est.days:.2f} days"
    )
    if not est.layout.colocated:
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
    lines.append("  rates (override with --rate name=value; sources: docs/pod.md):")
    for f in dataclasses.fields(rates):
        lines.append(f"    {f.name} = {getattr(rates, f.name)}  [{RATE_SOURCES[f.name]}]")
    lines.append(f"    accelerator: {ACCELERATOR_SPECS[accelerator].source}")
    return "\n".join(lines)


def batch_deadline_s(config: Any, model: Qwen2Config) -> float:
    """How long one rollout batch may take: `engine.deadline_s`, else on a GPU pod three
    times the estimated generation of a batch (prefill + decode + reward) at the default rates,
    at least an hour, else (CPU servers) an hour."""
    if config.engine.deadline_s is not None:
        return float(config.engine.deadline_s)
    if config.engine.server.cpu_cores or config.accelerator not in ACCELERATOR_SPECS:
        return 3600.0
    p = estimate(config, model, layout_of(config), Rates(), config.accelerator).phases
    return max(3600.0, 3 * (p["prefill"] + p["decode"] + p["reward"]))


def pod_estimate(config: Any, model: Qwen2Config) -> str:
    """What a run prints at its start (and its dry run): its own layout at the default rates
    (`python -m bapo_jax.run.estimate` redoes it with other rates or layouts)."""
    try:
        layout, rates = layout_of(config), Rates()
        found = estimate(config, model, layout, rates, config.accelerator)
    except ValueError as error:
        return f"iteration estimate: none ({error})"
    return format_estimate(found, rates, config.accelerator, config.trainer.steps, model)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import importlib

    from bapo_jax.overrides import apply_overrides

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("experiment", help="a module with a CONFIG, e.g. experiments.aime_7b")
    ap.add_argument("--accelerator", default=None, help="default: the run's accelerator")
    ap.add_argument("--trainer-gpus", type=int, default=None)
    ap.add_argument("--servers", type=int, default=None)
    ap.add_argument("--server-gpus", type=int, default=None, help="tensor parallel per server")
    ap.add_argument("--staleness", type=int, default=None)
    ap.add_argument("--rate", action="append", default=[], help="name=value (Rates)")
    ap.add_argument("overrides", nargs="*", help="key.sub=value settings of the run config")
    args = ap.parse_args(argv)
    try:
        config = apply_overrides(importlib.import_module(args.experiment).CONFIG, args.overrides)
        rates = Rates().replace_from(args.rate)
        layout = layout_of(config, servers=args.servers, server_gpus=args.server_gpus,
                           trainer_gpus=args.trainer_gpus, staleness=args.staleness)  # fmt: skip
        accelerator = args.accelerator or config.accelerator
        model = Qwen2Config.preset(config.model.preset)
        est = estimate(config, model, layout, rates, accelerator)
    except (ValueError, ModuleNotFoundError, AttributeError) as error:
        raise SystemExit(f"error: {error}") from None
    print(format_estimate(est, rates, accelerator, config.trainer.steps, model))


if __name__ == "__main__":
    main()
