"""An iteration cost model of a run on a GPU/TPU pod: what each phase costs, what hides.

    python -m bapo_jax.run.estimate experiments.aime_7b [--accelerator h100] [--trainer-gpus 4]
        [--servers 4] [--server-gpus 1] [--staleness 1] [--rate train_mfu=0.4 ...]
        [--measured RUN_DIR ...] [--rank] [key=value]

The pod is a model in two layers (docs/pod.md, "What an iteration costs"): the *kernels*
(`Kernels`), unit costs from the accelerator's datasheet and the rates (`gpu_kernels`) or
fitted to a run's metrics (`run.measured`), and the *work* (`Work`) of one iteration of
`config` (B prompts x G samples, prompt / response caps P / L, S servers):

    generation, per server (the servers in parallel), n = B G / S sequences, m / l their mean /
    longest response, c = min(sequences in flight, vLLM's max_num_seqs, KV capacity) at once
      prefill   = n P x prefill_token_s
      decode    = max(steps x decode_step_s + n m x decode_token_s, n m x decode_compute_s)
                  steps = (n - c)+ x m / c + l   (saturated until the queue empties, then the
                  last admitted sequences run to their end: the tail)
      pod:      decode_step_s = 2 N bytes / (g x HBM x decode_bandwidth_share) (the weights
                streamed once a step) + 2 l x tp_allreduce_s when g > 1 (tensor parallel: two
                all-reduces of the hidden state per layer and step); decode_token_s = KV
                bytes a token x (P + m / 2) / (g x HBM x decode_bandwidth_share) (a sequence's
                resident KV);
                decode_compute_s = 2 N / (g x peak x prefill_mfu); KV capacity = (g x memory
                x kv_memory_share - 2 N bytes) / (KV a token x ctx), the share a colocated
                layout's u
    reward      = B G x reward_s / reward workers
    log-prob    = passes x tokens x forward_token_s   (the recomputed pi_old, the KL
                  reference, the teacher check of `logging.logprob_agreement`)
    updates     = epochs x tokens x (train_token_s + s x forward_token_s) + E x update_s
                  (s = 1 when the loss needs a statistic of the whole update before its
                  backward and the update runs in micro-batches: BAPO's update-wide search
                  takes a forward pass over the update first; E = epochs x mini-batches)
      pod:      train_token_s = (6 N + 6 l d T)(x 4/3 with full remat) / (D x peak x train_mfu)
                (PaLM's 6N + 12 l d T per trained token, causal: half the attention; T the mean
                sequence P + m; D trainer devices); forward_token_s = (2 N + 2 l d T) / (same);
                LoRA (a frozen base): 2 N less a token (no weight gradients of the base)
    sync        = write (trainer), stage (servers, while they generate), reload (servers
                  paused): 2 N bytes over each bandwidth on a pod; LoRA: the adapters' bytes,
                  not staged (vLLM loads an adapter in one step); the run checkpoint 12 bytes a
                  parameter, LoRA: 4 a base parameter + 12 an adapter's
    eval, checkpoint: their cost every `eval_every` / `checkpoint.every` iterations, amortized;
    overhead    = the loop's own seconds per iteration (0 on a pod; fitted on this CPU)

At staleness 0 everything runs in turn; at k >= 1 the trainer's log-prob + updates + write
(+ the servers' staged read) run beside the generation of the next batch (+ reward), and the
reload between batches is exposed. A colocated layout runs in turn, its KV room from its
servers' share u; without a share it is verl's layout (a reference line: the weights
resharded on the GPUs instead of the Orbax sync).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from bapo_jax.algorithms import registry
from bapo_jax.checks import check_int
from bapo_jax.models.config import Qwen2Config
from bapo_jax.models.lora import adapter_params
from bapo_jax.sharding import mesh as mesh_lib

__all__ = [
    "ACCELERATOR_SPECS",
    "Accelerator",
    "Estimate",
    "Kernels",
    "Layout",
    "Rates",
    "SyncHostMemory",
    "Work",
    "estimate",
    "gpu_kernels",
    "lora_terms",
    "sync_host_memory",
    "work_of",
]


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """peak_flops: dense bf16 FLOP/s; hbm: bytes/s (its memory: `mesh.ACCELERATORS`);
    max_num_seqs: vLLM 0.32's default for its OpenAI server on this device (arg_utils:
    1,024 from 70 GB of memory, A100 excepted; 256 else)."""

    peak_flops: float
    hbm: float
    source: str
    max_num_seqs: int = 1024


_SXM = "NVIDIA {} datasheet: {} TFLOP/s bf16 dense, {} HBM"
ACCELERATOR_SPECS: dict[str, Accelerator] = {
    "h100": Accelerator(989e12, 3.35e12, _SXM.format("H100 SXM5", 989, "3.35 TB/s")),
    "h200": Accelerator(989e12, 4.8e12, _SXM.format("H200 SXM", 989, "4.8 TB/s")),
    "a100-80gb": Accelerator(312e12, 2.039e12, _SXM.format("A100 80GB", 312, "2.039 TB/s"), 256),
    "a100-40gb": Accelerator(312e12, 1.555e12, _SXM.format("A100 40GB", 312, "1.555 TB/s"), 256),
    "tpu-v5e": Accelerator(197e12, 819e9, "Cloud TPU v5e docs: 197 TFLOP/s bf16, 819 GB/s", 256),
    "tpu-v5p": Accelerator(459e12, 2765e9, "Cloud TPU v5p docs: 459 TFLOP/s bf16, 2,765 GB/s"),
}
CPU_MAX_NUM_SEQS = 128  # vLLM 0.32's default on CPU servers, per tensor-parallel rank


@dataclasses.dataclass(frozen=True)
class Rates:
    """The model's assumptions (docs/pod.md cites each); `--rate name=value` replaces one.

    train_mfu:              model FLOPs utilization of the trainer's passes (6N rule).
    prefill_mfu:            the servers' prefill (and decode's compute bound).
    decode_bandwidth_share: share of HBM bandwidth a decoding step achieves.
    kv_memory_share:        share of a server GPU's memory vLLM takes (None: the run's
                            `engine.server.gpu_memory_utilization`, else vLLM's default 0.9;
                            the default too for verl's reference and for a colocated run's
                            servers estimated on GPUs of their own).
    mean_response_share:    mean response length / the cap L.
    longest_response_share: the longest response / L (bounds the decode steps: the tail).
    mean_response_tokens / longest_response_tokens: the same in tokens (a run's measured
                            lengths: they do not grow with the cap), replacing the shares.
    reward_s_per_response:  seconds a reward worker spends on one response.
    reward_workers:         None: the run's reward workers (`rewards.worker_count`).
    sync_write_gb_s / sync_read_gb_s / sync_reload_gb_s: the trainer's checkpoint write, a
                            server's staged read, vLLM's in-place reload (GB/s of bf16).
    checkpoint_gb_s:        the run checkpoint's write (params + AdamW moments, fp32).
    eval_problems:          None: 30 per eval set (AIME 2024 and 2025 hold 30 each) or
                            `eval.limit`.
    reshard_gb_s:           verl's colocated reference only: moving the weights between
                            trainer and engine on the same GPUs.
    tp_allreduce_s:         one all-reduce of a decoding step's hidden states among a
                            tensor-parallel server's GPUs (a few KB: latency-bound).
    """

    train_mfu: float = 0.35
    prefill_mfu: float = 0.5
    decode_bandwidth_share: float = 0.6
    kv_memory_share: float | None = None
    mean_response_share: float = 0.6
    longest_response_share: float = 1.0
    mean_response_tokens: float | None = None
    longest_response_tokens: float | None = None
    reward_s_per_response: float = 0.02
    reward_workers: int | None = None
    sync_write_gb_s: float = 2.0
    sync_read_gb_s: float = 5.0
    sync_reload_gb_s: float = 10.0
    checkpoint_gb_s: float = 2.0
    reshard_gb_s: float = 100.0
    eval_problems: int | None = None
    tp_allreduce_s: float = 20e-6

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

    def lengths(self, cap: int) -> tuple[float, float]:
        """(mean, longest) response tokens under the cap L."""
        mean = self.mean_response_tokens or cap * self.mean_response_share
        longest = self.longest_response_tokens or cap * self.longest_response_share
        return min(mean, cap), min(max(longest, mean), cap)


@dataclasses.dataclass(frozen=True)
class Layout:
    """trainer_gpus: D, the trainer's devices; servers: S vLLM servers of server_gpus GPUs each
    (tensor parallel); staleness: the loop's k; colocated: every GPU does both, in turn;
    server_share: a colocated server's share u of its GPUs' memory (`engine.colocate`; None:
    verl's colocated reference, whose engine takes vLLM's default)."""

    trainer_gpus: int
    servers: int
    server_gpus: int
    staleness: int
    colocated: bool = False
    server_share: float | None = None

    def __post_init__(self) -> None:
        for name in ("trainer_gpus", "servers", "server_gpus"):
            check_int(f"Layout.{name}", getattr(self, name), 1)
        check_int("Layout.staleness", self.staleness, 0)
        if self.server_share is not None and not (self.colocated and 0 < self.server_share < 1):
            raise ValueError(
                f"Layout.server_share: a share in (0, 1) of a colocated layout's GPU memory, got "
                f"{self.server_share} (colocated={self.colocated})"
            )

    @property
    def reference(self) -> bool:
        """verl's colocated layout, a reference line (not a layout this project runs)."""
        return self.colocated and self.server_share is None

    @property
    def label(self) -> str:
        if self.reference:
            return f"colocated on {self.trainer_gpus} (verl-style reference)"
        if self.colocated:
            return (
                f"colocated on {self.trainer_gpus}: {self.generating_servers} x "
                f"{self.server_gpus} vLLM at {self.server_share:.0%} of memory"
            )
        return (
            f"{self.trainer_gpus} trainer + {self.servers} x {self.server_gpus} vLLM, "
            f"staleness {self.staleness}"
        )

    @property
    def generating_servers(self) -> int:
        """Colocated: every group of `server_gpus` of the trainer's GPUs serves, in turn."""
        return self.trainer_gpus // self.server_gpus if self.colocated else self.servers


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Unit costs in seconds: the model's only machine-dependent inputs (module doc).

    prefill_token_s:  a prompt token's prefill on one server.
    decode_step_s:    a decoding step's fixed cost on one server (the weights streamed).
    decode_token_s:   a running sequence's share of a step (its KV streamed; on a CPU, its
                      compute and the server's per-sequence work).
    decode_compute_s: a generated token's compute floor on one server.
    train_token_s:    a token through forward + backward of one epoch, on the whole trainer.
    update_s:         an optimizer update's fixed cost (dispatch, the optimizer step).
    forward_token_s:  a token through one log-prob forward pass.
    reward_s:         one response on one reward worker.
    sync_write_s / sync_stage_s / sync_reload_s: one version's write, staged read, reload.
    checkpoint_s:     one run checkpoint's write.
    overhead_s:       the loop's own seconds per iteration (batch assembly, metrics).
    kv_capacity:      sequences a server's KV cache holds at the mean context (None: not
                      modelled, e.g. a measured CPU server).
    source:           where the numbers come from (printed with the estimate).
    """

    prefill_token_s: float
    decode_step_s: float
    decode_token_s: float
    decode_compute_s: float
    train_token_s: float
    update_s: float
    forward_token_s: float
    reward_s: float
    sync_write_s: float
    sync_stage_s: float
    sync_reload_s: float
    checkpoint_s: float
    overhead_s: float = 0.0
    kv_capacity: int | None = None
    source: str = ""


@dataclasses.dataclass(frozen=True)
class Work:
    """What one iteration does. responses: B G; per_server: n; mean / longest: m / l response
    tokens; in_flight: the sequences the client keeps at a server (requests x G); tokens: the
    trainer's tokens (B G x (P + m): prompts padded to P); updates: E, the optimizer updates;
    passes: log-prob forward passes; statistic_passes: forward passes an epoch before the
    updates' backward (the loss's update-wide statistic); workers: reward workers."""

    responses: int
    per_server: float
    prompt: int
    mean: float
    longest: float
    in_flight: int
    max_num_seqs: int
    tokens: float
    epochs: int
    updates: int
    passes: int
    statistic_passes: int
    workers: int


def server_max_num_seqs(config: Any, accelerator: str) -> int:
    """`--max-num-seqs` from the servers' args, else vLLM's default for the device."""
    args = list(config.engine.server.args)
    if "--max-num-seqs" in args:
        return int(args[args.index("--max-num-seqs") + 1])
    if config.engine.server.cpu_cores or accelerator not in ACCELERATOR_SPECS:
        return CPU_MAX_NUM_SEQS * config.engine.server.tensor_parallel_size
    return ACCELERATOR_SPECS[accelerator].max_num_seqs


def work_of(
    config: Any, model: Qwen2Config | None, layout: Layout, rates: Rates, accelerator: str
) -> Work:
    """The work of one iteration of `config` (a `RunConfig`) on `layout` (`model`: for a GPU
    server's KV room, `requests_per_server`)."""
    t, r = config.trainer, config.trainer.rollout
    mean, longest = rates.lengths(r.max_response_tokens)
    responses = r.prompts_per_step * r.samples_per_prompt
    a = t.algorithm
    return Work(
        responses=responses,
        per_server=responses / layout.generating_servers,
        prompt=r.max_prompt_tokens,
        mean=mean,
        longest=longest,
        in_flight=requests_per_server(config, model, layout) * r.samples_per_prompt,
        max_num_seqs=server_max_num_seqs(config, accelerator),
        tokens=responses * (r.max_prompt_tokens + mean),
        epochs=a.epochs,
        updates=a.epochs * a.mini_batches,
        passes=int(a.ratio_base == "recomputed")
        + int(a.reference_hf_dir is not None)
        + int(t.logging.logprob_agreement),
        statistic_passes=int(
            a.micro_batches > 1
            and registry.get_loss(a.loss).update_statistic_for(a.loss_config) is not None
        ),
        workers=rates.reward_workers or config.rewards.worker_count,
    )


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


def sync_host_memory(model: Qwen2Config, layout: Layout) -> SyncHostMemory:
    """The host memory of one server node during a sync (`SyncHostMemory`)."""
    version = 2 * model.num_params()
    ranks = min(layout.server_gpus, GPUS_PER_NODE)
    servers = max(1, min(layout.servers, GPUS_PER_NODE // ranks))
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


def kv_bytes_per_token(model: Qwen2Config) -> int:
    """K and V of every layer in bf16: 2 x l x K x H x 2 bytes."""
    return 2 * model.num_hidden_layers * model.num_key_value_heads * model.head_dim * 2


def lora_terms(config: Any, model: Qwen2Config) -> tuple[int, int]:
    """(bytes a version syncs, adapter parameters): a LoRA run syncs its adapters alone
    (`rollout.adapter_sync`) at the sync dtype; a full run its 2 N bf16 bytes (0 adapters)."""
    lora = config.model.lora()
    if lora is None:
        return 2 * model.num_params(), 0
    adapters = adapter_params(model, lora)
    return adapters * (4 if config.engine.sync_dtype == "float32" else 2), adapters


def gpu_kernels(
    config: Any, model: Qwen2Config, layout: Layout, rates: Rates, accelerator: str
) -> Kernels:
    """The kernels of `layout` from the accelerator's datasheet and `rates` (module doc)."""
    if accelerator not in ACCELERATOR_SPECS:
        raise ValueError(f"accelerator {accelerator!r}: known {sorted(ACCELERATOR_SPECS)}")
    acc, memory = ACCELERATOR_SPECS[accelerator], mesh_lib.ACCELERATORS[accelerator]
    r = config.trainer.rollout
    n, weights = model.num_params(), 2 * model.num_params()  # bf16 serving and sync
    synced, lora = lora_terms(config, model)
    mean, _ = rates.lengths(r.max_response_tokens)
    g = layout.server_gpus
    kv, ctx = kv_bytes_per_token(model), r.max_prompt_tokens + mean / 2  # resident context
    own = config.engine.server.gpu_memory_utilization
    if layout.reference or (config.engine.colocated and not layout.colocated):
        own = None  # vLLM's default: verl's engine, or a colocated run's servers moved apart
    share = layout.server_share or rates.kv_memory_share or own or 0.9
    bandwidth = g * acc.hbm * rates.decode_bandwidth_share
    allreduce = 2 * model.num_hidden_layers * rates.tp_allreduce_s if g > 1 else 0.0
    serve_flops = g * acc.peak_flops * rates.prefill_mfu
    train_flops = layout.trainer_gpus * acc.peak_flops * rates.train_mfu
    attn = model.num_hidden_layers * model.hidden_size * (r.max_prompt_tokens + mean)  # l d T
    forward = 2 * n + 2 * attn
    # forward + activation gradients (2N + 4 l d T) + weight gradients (2N, none for a frozen
    # base: LoRA's own are r / d of it), and full remat's second forward
    train = forward + (2 * n + 4 * attn) + (0 if lora else 2 * n)
    remat = forward if config.model.remat not in (False, "none") else 0.0
    reload_gb_s = rates.reshard_gb_s if layout.reference else rates.sync_reload_gb_s
    return Kernels(
        prefill_token_s=2 * n / serve_flops,
        decode_step_s=weights / bandwidth + allreduce,
        decode_token_s=kv * ctx / bandwidth,
        decode_compute_s=2 * n / serve_flops,
        train_token_s=(train + remat) / train_flops,
        update_s=0.0,
        forward_token_s=forward / train_flops,
        reward_s=rates.reward_s_per_response,
        sync_write_s=0.0 if layout.reference else synced / (rates.sync_write_gb_s * 1e9),
        sync_stage_s=0.0 if layout.reference or lora else synced / (rates.sync_read_gb_s * 1e9),
        sync_reload_s=synced / (reload_gb_s * 1e9),
        checkpoint_s=(4 * n + 12 * lora if lora else 12 * n) / (rates.checkpoint_gb_s * 1e9),
        kv_capacity=max(0, int((g * memory * share - weights) // (kv * ctx))),
        source=acc.source,
    )


def decode_steps(sequences: float, concurrency: int, mean: float, longest: float) -> float:
    """Decoding steps of one server for `sequences` responses, `concurrency` at a time:
    saturated until the queue empties, then the last admitted ones run to the longest."""
    if sequences <= 0:
        return 0.0
    return max(0.0, sequences - concurrency) * mean / concurrency + longest


def decode_seconds(k: Kernels, sequences: float, c: int, mean: float, longest: float) -> float:
    tokens = sequences * mean
    steps = decode_steps(sequences, c, mean, longest)
    return max(steps * k.decode_step_s + tokens * k.decode_token_s, tokens * k.decode_compute_s)


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Seconds per iteration of each phase; `iteration_s`: the loop's wall time; `hidden_s`:
    the seconds of the phases that ran beside another (their sum minus the wall time);
    `concurrency`: sequences a server decodes at once; `kv_capacity`: how many its KV cache
    holds at the mean context (0: the weights leave no room; None: not modelled);
    `checkpoint_every`: the run's checkpoint cadence in iterations (the work a crash can
    lose); `steps`: the run's iterations; `sync_bytes`: a version's bytes; `adapters`: a LoRA
    run's adapter parameters (0: a full run)."""

    layout: Layout
    phases: dict[str, float]
    concurrency: int
    kv_capacity: int | None
    iteration_s: float
    hidden_s: float
    days: float
    checkpoint_every: int = 0
    steps: int = 0
    source: str = ""
    sync_bytes: int = 0
    adapters: int = 0


def estimate(
    config: Any,
    model: Qwen2Config,
    layout: Layout,
    rates: Rates,
    accelerator: str,
    kernels: Kernels | None = None,
) -> Estimate:
    """The cost model of the module doc for `config` (a `RunConfig`) on `layout`; `kernels`
    (e.g. fitted to a run's metrics, `run.measured`) replace the datasheet's."""
    k = kernels or gpu_kernels(config, model, layout, rates, accelerator)
    w = work_of(config, model, layout, rates, accelerator)
    sync_bytes, adapters = lora_terms(config, model)
    t = config.trainer
    bound = w.max_num_seqs if k.kv_capacity is None else min(w.max_num_seqs, k.kv_capacity)
    c = max(1, min(int(w.per_server), w.in_flight, bound))
    phases = {
        "prefill": w.per_server * w.prompt * k.prefill_token_s,
        "decode": decode_seconds(k, w.per_server, c, w.mean, w.longest),
        "reward": w.responses * k.reward_s / w.workers,
        "logprob": w.passes * w.tokens * k.forward_token_s,
        "update": w.epochs * w.tokens * (k.train_token_s + w.statistic_passes * k.forward_token_s)
        + w.updates * k.update_s,
        "sync_write": k.sync_write_s,
        "sync_stage": k.sync_stage_s,
        "sync_reload": k.sync_reload_s,
        "checkpoint": k.checkpoint_s / max(1, t.checkpoint.every),
        "overhead": k.overhead_s,
        "eval": 0.0,
    }
    if t.eval_every:  # one eval's generation, amortized: the eval set x samples on the servers
        e = config.eval
        problems = rates.eval_problems or e.limit or 30 * len(e.sets)
        sequences = problems * e.samples / layout.generating_servers
        mean, longest = rates.lengths(e.max_tokens)
        eval_c = max(1, min(int(sequences), bound))
        phases["eval"] = decode_seconds(k, sequences, eval_c, mean, longest) / t.eval_every
    generate = phases["prefill"] + phases["decode"] + phases["reward"]
    train = phases["logprob"] + phases["update"] + phases["sync_write"]
    fixed = phases["sync_reload"] + phases["checkpoint"] + phases["eval"] + phases["overhead"]
    if layout.colocated or layout.staleness == 0:
        iteration = generate + train + phases["sync_stage"] + fixed
    else:  # the next batch generates while this one trains; the staged read beside it
        iteration = max(generate, train + phases["sync_stage"]) + fixed
    return Estimate(
        layout=layout,
        phases=phases,
        concurrency=c,
        kv_capacity=k.kv_capacity,
        iteration_s=iteration,
        hidden_s=sum(phases.values()) - iteration,
        days=iteration * t.steps / 86400,
        checkpoint_every=t.checkpoint.every,
        steps=t.steps,
        source=k.source,
        sync_bytes=sync_bytes,
        adapters=adapters,
    )


# ---- the run's own numbers ----------------------------------------------------------------------
def layout_of(
    config: Any,
    *,
    servers: int | None = None,
    server_gpus: int | None = None,
    trainer_gpus: int | None = None,
    staleness: int | None = None,
    separate: bool = False,
) -> Layout:
    """The run's own layout (`trainer_devices` or the mesh's devices, the launched and given
    servers (colocated with none named yet: one per g of the trainer's GPUs),
    `tensor_parallel_size`, `offpolicy.staleness`, `engine.colocate` with its servers'
    memory share), any field replaced; `separate`: the servers on GPUs of their own."""
    e = config.engine
    colocated = e.colocated and not separate
    if trainer_gpus is None:
        devices = config.trainer_devices
        trainer_gpus = (
            len(devices) if isinstance(devices, tuple) else devices
        ) or config.mesh_config().num_devices
    server_gpus = server_gpus or e.server.tensor_parallel_size
    every_gpu = max(trainer_gpus // server_gpus, 1) if colocated else 1  # none named yet
    return Layout(
        trainer_gpus=trainer_gpus,
        servers=servers or (e.launch_servers + len(e.vllm_urls)) or every_gpu,
        server_gpus=server_gpus,
        staleness=config.trainer.offpolicy.staleness if staleness is None else staleness,
        colocated=colocated,
        server_share=e.server.gpu_memory_utilization if colocated else None,
    )  # fmt: skip


def requests_per_server(
    config: Any, model: Qwen2Config | None, layout: Layout | None = None
) -> int:
    """`engine.requests_per_server`, else enough prompts (of G samples each) to fill what a
    server runs at once: min(vLLM's max_num_seqs, the KV capacity at the mean context of the
    default rates) / G, rounded up (CPU servers, or no `model`: max_num_seqs / G). `layout`:
    default the run's own."""
    if config.engine.requests_per_server is not None:
        return config.engine.requests_per_server
    g = config.trainer.rollout.samples_per_prompt
    limit = server_max_num_seqs(config, config.accelerator)
    gpu = not config.engine.server.cpu_cores and config.accelerator in ACCELERATOR_SPECS
    if gpu and model is not None:
        layout = layout or layout_of(config)
        room = gpu_kernels(config, model, layout, Rates(), config.accelerator).kv_capacity
        limit = min(limit, room or g)
    return max(1, math.ceil(limit / g))


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


if __name__ == "__main__":
    from bapo_jax.run.estimate_report import main

    main()
