"""The memory plan of one train step: XLA's per-device bytes of the compiled, sharded step.

`plan_memory` builds the real-size `TrainState` (fp32 params + AdamW moments) as abstract arrays
carrying their `NamedSharding`s (nothing is allocated), lowers and compiles the FULL jitted train
step (`make_train_step`: chunked log-probs, the BAPO loss and bound search, backward, AdamW) on
the given devices and reads XLA's per-device buffer assignment:

    peak = arguments + outputs - aliased + temporaries        (bytes per device)

(the state is donated, so the new state's outputs alias the old state's arguments). The step
fits when peak <= 85% of one device's memory. `find_max_seq_len` searches the longest sequence
that fits. The command line around it (simulated CPU devices, reports) is `sharding.plan`.
"""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import jax.numpy as jnp
import optax

from bapo_jax.models.config import ModelOptions, Qwen2Config
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.sharding import rules as rules_lib
from bapo_jax.sharding.hlo_buffers import BufferRow, largest_buffers
from bapo_jax.sharding.mesh import MeshConfig
from bapo_jax.train import optim
from bapo_jax.train.batch import TrainBatch
from bapo_jax.train.state import abstract_train_state, state_shardings
from bapo_jax.train.step import StepConfig, make_train_step

FIT_FRACTION = 0.85
SEQ_LEN_QUANTUM = 512
DEFAULT_SEQ_LEN = 1024 + 8192


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one compiled train step.

    argument/output/alias/temp_bytes: XLA's `memory_analysis()` of the compiled step.
    peak_bytes: argument + output - alias + temp.
    fit_fraction: the share of `device_memory_bytes` the step may use (`fits`); a run sets
      JAX's GPU memory pool to the same share (`run.preflight.set_memory_fraction`).
    state_bytes, batch_bytes: analytic per-device size of the sharded TrainState / TrainBatch
      (the arguments, split by kind).
    reference_bytes: the frozen KL reference's params per device, resident beside the step
      (sharded like the policy's; 0 when kl_coef == 0); counted in `fits`.
    packed: compiled for packed rows (segment ids, positions); `token_budget`: tokens of one
      micro-batch over all devices (a packed micro-batch fills it with whole sequences).
    """

    seq_len: int
    micro_batch: int
    num_micro_batches: int
    global_batch: int
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    peak_bytes: int
    state_bytes: int
    batch_bytes: int
    device_memory_bytes: int
    lower_seconds: float
    compile_seconds: float
    largest_buffers: tuple[BufferRow, ...] = ()
    reference_bytes: int = 0
    fit_fraction: float = FIT_FRACTION
    packed: bool = False

    @property
    def token_budget(self) -> int:
        return self.global_batch // self.num_micro_batches * self.seq_len

    @property
    def budget_bytes(self) -> int:
        """The bytes a step may use: `fit_fraction` of the device's memory."""
        return int(self.fit_fraction * self.device_memory_bytes)

    @property
    def fits(self) -> bool:
        return self.peak_bytes + self.reference_bytes <= self.budget_bytes


def planned_attention(attention: str, platform: str) -> str:
    """The attention a plan compiles on `platform` for a run that uses `attention`.

    cuDNN's flash attention compiles on GPU only; elsewhere the plan compiles "blockwise",
    which, like it, never holds the [T, T] scores (O(T x block) memory), so the estimate keeps
    the right shape of the peak.
    """
    if attention == "cudnn" and platform != "gpu":
        return "blockwise"
    return attention


def check_sizes(**sizes: int) -> None:
    """seq_len >= 2, micro_batch >= 1, num_micro_batches >= 1 (ints), by keyword."""
    for name, value in sizes.items():
        low = 2 if name == "seq_len" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def _per_device_bytes(tree) -> int:
    """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        shard = leaf.sharding.shard_shape(leaf.shape)
        total += math.prod(shard) * jnp.dtype(leaf.dtype).itemsize
    return total


def _with_shardings(abstract, shardings):
    """ShapeDtypeStructs of `abstract` carrying the matching `NamedSharding` of `shardings`.

    `shardings` is `abstract` with every Param node replaced by one sharding, so its leaves line
    up one-to-one with the array leaves of `abstract`."""
    leaves, treedef = jax.tree.flatten(abstract)
    specs = jax.tree.leaves(shardings)
    if len(specs) != len(leaves):
        raise ValueError(f"{len(specs)} shardings for {len(leaves)} state arrays")
    return jax.tree.unflatten(
        treedef,
        [
            jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
            for x, s in zip(leaves, specs, strict=True)
        ],
    )


def abstract_batch(
    global_batch: int,
    seq_len: int,
    mesh: jax.sharding.Mesh,
    *,
    with_ref_logp: bool = False,
    packed: bool = False,
) -> TrainBatch:
    """A [B, T] `TrainBatch` of ShapeDtypeStructs, B split over the mesh's batch axes
    (`with_ref_logp`: also the KL reference's log-probs; `packed`: segment ids and positions,
    the trainer's packed rows)."""
    sharding = rules_lib.batch_sharding(mesh, ndim=2)

    def spec(dtype):
        return jax.ShapeDtypeStruct((global_batch, seq_len), dtype, sharding=sharding)

    return TrainBatch(
        input_ids=spec(jnp.int32),
        attention_mask=spec(jnp.int32),
        loss_mask=spec(jnp.float32),
        advantages=spec(jnp.float32),
        behavior_logp=spec(jnp.float32),
        ref_logp=spec(jnp.float32) if with_ref_logp else None,
        segment_ids=spec(jnp.int32) if packed else None,
        positions=spec(jnp.int32) if packed else None,
    )


def plan_memory(
    model_config: Qwen2Config,
    mesh_config: MeshConfig,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    micro_batch: int = 1,
    num_micro_batches: int = 1,
    options: ModelOptions | None = None,
    step_config: StepConfig | None = None,
    optimizer: optax.GradientTransformation | None = None,
    devices: list[jax.Device] | None = None,
    top_buffers: int = 0,
    fit_fraction: float = FIT_FRACTION,
    packed: bool = False,
) -> MemoryPlan:
    """Compiles the full train step on abstract, sharded arguments and reads its memory.

    packed: the batch carries segment ids and positions (the trainer's packed rows; the same
      [B, T] shape, so one micro-batch is a token budget of micro_batch x (data x fsdp) x T).

    micro_batch: sequences per batch-parallel device per micro-batch, so one update holds
      B = micro_batch x (data x fsdp) x num_micro_batches sequences of `seq_len` tokens.
    devices: the first `mesh_config.num_devices` of `jax.devices()` by default.
    top_buffers: list this many of the largest per-device arrays (`largest_buffers`).
    fit_fraction: the share of device memory the step may use (`MemoryPlan.fits`).
    """
    if not 0 < fit_fraction <= 1:
        raise ValueError(f"fit_fraction must be in (0, 1], got {fit_fraction}")
    check_sizes(seq_len=seq_len, micro_batch=micro_batch, num_micro_batches=num_micro_batches)
    mesh_config.check_heads(model_config.num_attention_heads, model_config.num_key_value_heads)
    options = options or ModelOptions()
    step_config = step_config or StepConfig(num_micro_batches=num_micro_batches)
    if step_config.num_micro_batches != num_micro_batches:
        raise ValueError(
            f"step_config.num_micro_batches={step_config.num_micro_batches} differs from "
            f"num_micro_batches={num_micro_batches}"
        )
    optimizer = optimizer or optim.make_optimizer(optim.OptimizerConfig())
    if devices is None:
        available = jax.devices()
        if len(available) < mesh_config.num_devices:
            raise ValueError(
                f"mesh needs {mesh_config.num_devices} devices, JAX has {len(available)}; set "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={mesh_config.num_devices} "
                "before JAX starts (the CLI does this)"
            )
        devices = available[: mesh_config.num_devices]
    mesh = mesh_lib.make_mesh(mesh_config, devices)

    graphdef, abstract = abstract_train_state(model_config, optimizer, options=options)
    shardings = state_shardings(abstract, mesh)
    state = _with_shardings(abstract, shardings)
    global_batch = micro_batch * mesh_config.batch_parallelism * num_micro_batches
    # ---- KL reference (kl_coef > 0): its log-probs in the batch, its params beside the step.
    kl = step_config.loss_config.kl_coef > 0
    batch = abstract_batch(global_batch, seq_len, mesh, with_ref_logp=kl, packed=packed)
    reference_bytes = _per_device_bytes(state.params) if kl else 0
    # ---- end KL reference.
    step = make_train_step(graphdef, optimizer, step_config, state_shardings=shardings)

    start = time.perf_counter()
    lowered = step.lower(state, batch)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    stats = compiled.memory_analysis()
    peak = (
        stats.argument_size_in_bytes
        + stats.output_size_in_bytes
        - stats.alias_size_in_bytes
        + stats.temp_size_in_bytes
    )
    return MemoryPlan(
        seq_len=seq_len,
        micro_batch=micro_batch,
        num_micro_batches=num_micro_batches,
        global_batch=global_batch,
        argument_bytes=int(stats.argument_size_in_bytes),
        output_bytes=int(stats.output_size_in_bytes),
        alias_bytes=int(stats.alias_size_in_bytes),
        temp_bytes=int(stats.temp_size_in_bytes),
        peak_bytes=int(peak),
        state_bytes=_per_device_bytes(state),
        batch_bytes=_per_device_bytes(batch),
        device_memory_bytes=mesh_config.device_memory_bytes,
        lower_seconds=lowered_at - start,
        compile_seconds=compiled_at - lowered_at,
        largest_buffers=largest_buffers(compiled.as_text(), top_buffers) if top_buffers else (),
        reference_bytes=reference_bytes,
        fit_fraction=fit_fraction,
        packed=packed,
    )


def find_max_seq_len(plan_at, start: int, limit: int) -> tuple[int, list[MemoryPlan]]:
    """Longest multiple of 512 in [512, limit] whose plan fits (0 when none does).

    `plan_at(seq_len) -> MemoryPlan`. Starts at `start` (rounded down to 512), doubles or
    halves until the fit changes, then bisects; the peak grows with the length, so the fitting
    lengths are a prefix. Returns (length, every plan compiled, in order).
    """
    q = SEQ_LEN_QUANTUM
    if limit < q:
        raise ValueError(f"limit must be >= {q}, got {limit}")
    probes: list[MemoryPlan] = []

    def fits(units: int) -> bool:
        probes.append(plan_at(units * q))
        return probes[-1].fits

    top = limit // q
    units = min(max(start // q, 1), top)
    if fits(units):
        lo, hi = units, None  # lo fits; hi (if any) does not
        while hi is None and lo < top:
            nxt = min(lo * 2, top)
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
        if hi is None:
            return lo * q, probes
    else:
        lo, hi = 0, units
        while lo == 0 and hi > 1:
            nxt = hi // 2
            if fits(nxt):
                lo = nxt
            else:
                hi = nxt
        if lo == 0:
            return 0, probes
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo * q, probes
