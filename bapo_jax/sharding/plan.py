"""Memory plan: will the train step fit on the trainer GPUs? Compiled for a simulated CPU mesh.

    python -m bapo_jax.sharding.plan --model qwen2.5-7b --mesh 7b [--seq-len 9216] [--json]

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

The simulated devices must exist before JAX creates its CPU backend, so the command re-executes
itself once with `XLA_FLAGS=--xla_force_host_platform_device_count=N` (N = mesh devices).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import math
import os
import re
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import optax

from bapo_jax.models.config import ModelOptions, Qwen2Config
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.sharding import rules as rules_lib
from bapo_jax.sharding.mesh import MeshConfig
from bapo_jax.train import optim
from bapo_jax.train.batch import TrainBatch
from bapo_jax.train.state import abstract_train_state, state_shardings
from bapo_jax.train.step import StepConfig, make_train_step

FIT_FRACTION = 0.85
SEQ_LEN_QUANTUM = 512
DEFAULT_SEQ_LEN = 1024 + 8192
ESTIMATE_NOTE = (
    "estimate: XLA:CPU buffer assignment on simulated CPU devices, not a GPU compile; "
    "fits means peak <= 85% of device memory (headroom for GPU fusion differences, "
    "fragmentation and JAX's preallocation)"
)
_DEVICES_ENV = "BAPO_PLAN_DEVICES"
_ATTENTION_FIELD = "attention"


@dataclasses.dataclass(frozen=True)
class BufferRow:
    """One array shape produced by an unfused instruction of the compiled per-device program."""

    bytes: int
    dtype: str
    shape: tuple[int, ...]
    count: int
    opcode: str
    op_name: str


_HLO_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_HLO_INSTR = re.compile(r"^\s+(?:ROOT )?%?[\w.\-]+ = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(")
_HLO_CALLS = re.compile(r"(?:calls|to_apply)=%?([\w.\-]+)")
_HLO_OP_NAME = re.compile(r'op_name="([^"]*)"')
_HLO_ITEMSIZE = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2}
_HLO_ITEMSIZE |= {"f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_HLO_NOT_A_BUFFER = frozenset({"parameter", "get-tuple-element", "bitcast", "tuple", "constant"})


def largest_buffers(hlo_text: str, n: int) -> tuple[BufferRow, ...]:
    """The `n` largest array shapes that unfused instructions of an optimized HLO module produce.

    A diagnostic for where temporaries go (e.g. the [B, K, G, T, S] attention scores), not a
    liveness analysis: shapes are per device, instructions inside fusions and reducers are
    skipped, and each (dtype, shape) is listed once with its number of producers.
    """
    inner = set(_HLO_CALLS.findall(hlo_text))
    rows: dict[tuple[str, tuple[int, ...]], BufferRow] = collections.OrderedDict()
    computation = None
    for line in hlo_text.splitlines():
        header = _HLO_HEADER.match(line)
        if header:
            computation = header.group(1)
            continue
        if computation is None or computation in inner:
            continue
        m = _HLO_INSTR.match(line)
        if not m or m.group(3) in _HLO_NOT_A_BUFFER:
            continue
        itemsize = _HLO_ITEMSIZE.get(m.group(1))
        if itemsize is None:
            continue
        shape = tuple(int(d) for d in m.group(2).split(",") if d)
        key = (m.group(1), shape)
        if key in rows:
            rows[key] = dataclasses.replace(rows[key], count=rows[key].count + 1)
        else:
            op_name = _HLO_OP_NAME.search(line)
            rows[key] = BufferRow(
                bytes=math.prod(shape) * itemsize,
                dtype=m.group(1),
                shape=shape,
                count=1,
                opcode=m.group(3),
                op_name=op_name.group(1) if op_name else "",
            )
    return tuple(sorted(rows.values(), key=lambda r: -r.bytes)[:n])


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Per-device bytes of one compiled train step.

    argument/output/alias/temp_bytes: XLA's `memory_analysis()` of the compiled step.
    peak_bytes: argument + output - alias + temp.
    state_bytes, batch_bytes: analytic per-device size of the sharded TrainState / TrainBatch
      (the arguments, split by kind).
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

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= FIT_FRACTION * self.device_memory_bytes


def parse_mesh(spec: str) -> MeshConfig:
    """A preset name ("7b") or an explicit shape "data=1,fsdp=16,tensor=2[,memory_gb=80]"."""
    if "=" not in spec:
        return mesh_lib.mesh_preset(spec)
    fields: dict[str, Any] = {}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key in mesh_lib.MESH_AXES:
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"mesh axis {key} must be an int, got {value!r}") from None
        elif key == "memory_gb":
            fields["device_memory_bytes"] = int(float(value) * 10**9)
        else:
            raise ValueError(
                f"mesh spec {spec!r}: unknown field {key!r}; use {mesh_lib.MESH_AXES} or memory_gb"
            )
    return mesh_lib.MeshConfig(**fields)


def check_sizes(**sizes: int) -> None:
    """seq_len >= 2, micro_batch >= 1, num_micro_batches >= 1 (ints), by keyword."""
    for name, value in sizes.items():
        low = 2 if name == "seq_len" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


def parse_model(name: str) -> Qwen2Config:
    """A `Qwen2Config` preset name, or a path to an HF config.json (or its directory)."""
    if os.path.exists(name):
        return Qwen2Config.from_hf(name)
    return Qwen2Config.preset(name)


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


def abstract_batch(global_batch: int, seq_len: int, mesh: jax.sharding.Mesh) -> TrainBatch:
    """A [B, T] `TrainBatch` of ShapeDtypeStructs, B split over the mesh's batch axes."""
    sharding = rules_lib.batch_sharding(mesh, ndim=2)

    def spec(dtype):
        return jax.ShapeDtypeStruct((global_batch, seq_len), dtype, sharding=sharding)

    return TrainBatch(
        input_ids=spec(jnp.int32),
        attention_mask=spec(jnp.int32),
        loss_mask=spec(jnp.float32),
        advantages=spec(jnp.float32),
        behavior_logp=spec(jnp.float32),
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
) -> MemoryPlan:
    """Compiles the full train step on abstract, sharded arguments and reads its memory.

    micro_batch: sequences per batch-parallel device per micro-batch, so one update holds
      B = micro_batch x (data x fsdp) x num_micro_batches sequences of `seq_len` tokens.
    devices: the first `mesh_config.num_devices` of `jax.devices()` by default.
    top_buffers: list this many of the largest per-device arrays (`largest_buffers`).
    """
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
    batch = abstract_batch(global_batch, seq_len, mesh)
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
    p.add_argument("--remat", default="full", help="ModelOptions.remat policy")
    p.add_argument("--compute-dtype", default="bfloat16")
    p.add_argument("--param-dtype", default="float32")
    if _ATTENTION_FIELD in {f.name for f in dataclasses.fields(ModelOptions)}:
        p.add_argument("--attention", default=None, help="ModelOptions.attention implementation")
    p.add_argument("--loss", default="bapo", help="registered loss name")
    p.add_argument(
        "--device-memory-gb",
        type=float,
        default=None,
        help="memory of one device in GB (1e9 bytes); default: the mesh config's (80)",
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
    mesh_config = parse_mesh(args.mesh)
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
    if args.top_buffers < 0:
        raise ValueError(f"top_buffers must be >= 0, got {args.top_buffers}")
    kw: dict[str, Any] = {}
    if getattr(args, _ATTENTION_FIELD, None) is not None:
        kw[_ATTENTION_FIELD] = args.attention
    try:
        param_dtype, compute_dtype = jnp.dtype(args.param_dtype), jnp.dtype(args.compute_dtype)
    except TypeError as e:
        raise ValueError(f"unknown dtype: {e}") from None
    options = ModelOptions(
        param_dtype=param_dtype, compute_dtype=compute_dtype, remat=args.remat, **kw
    )
    step_config = StepConfig(loss=args.loss, num_micro_batches=args.num_micro_batches)
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
        f"{plan.num_micro_batches} micro-batches = {plan.global_batch} sequences per update",
        f"params {jnp.dtype(options.param_dtype).name}, compute "
        f"{jnp.dtype(options.compute_dtype).name}, remat {options.remat}"
        + (
            f", attention {getattr(options, _ATTENTION_FIELD)}"
            if hasattr(options, _ATTENTION_FIELD)
            else ""
        ),
        "per-device memory:",
        f"  arguments    {_gb(plan.argument_bytes)}  (state {_gb(plan.state_bytes).strip()}, "
        f"batch {_gb(plan.batch_bytes).strip()})",
        f"  outputs      {_gb(plan.output_bytes)}",
        f"  aliased     -{_gb(plan.alias_bytes).strip():>11}  (donated state)",
        f"  temporaries  {_gb(plan.temp_bytes)}",
        f"  peak         {_gb(plan.peak_bytes)}  = arguments + outputs - aliased + temporaries "
        f"({plan.peak_bytes} bytes)",
        f"  budget       {_gb(int(FIT_FRACTION * plan.device_memory_bytes))}  = 85% of "
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
    return out


def _reexec_with_devices(num_devices: int, argv: list[str]) -> None:
    """Replaces this process with the same command under N simulated CPU devices."""
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={num_devices}")
    env = dict(os.environ)
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", **{_DEVICES_ENV: str(num_devices)})
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "bapo_jax.sharding.plan", *argv], env)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model_config, mesh_config, options, step_config = _resolve(args)
    except ValueError as e:
        parser.error(str(e))  # exit status 2
    if os.environ.get(_DEVICES_ENV) != str(mesh_config.num_devices):
        _reexec_with_devices(mesh_config.num_devices, argv)

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
            "fit_fraction": FIT_FRACTION,
            "note": ESTIMATE_NOTE,
            **_plan_json(plan),
        }
        if hasattr(options, _ATTENTION_FIELD):
            out[_ATTENTION_FIELD] = getattr(options, _ATTENTION_FIELD)
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
