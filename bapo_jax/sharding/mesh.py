"""Device meshes: a swappable `MeshConfig` (data x fsdp x tensor) and named presets.

The mesh is the only place where physical layout is chosen. Model code names logical axes
(`bapo_jax.sharding.rules` maps them); changing from the 7B to the 32B layout is a change of
`MeshConfig`, nothing else.

Axes:
  data   -- pure data parallelism (parameters replicated across it).
  fsdp   -- data parallelism with parameters, gradients and optimizer state sharded (ZeRO-3).
  tensor -- Megatron-style tensor parallelism over heads and the MLP hidden dimension.
The batch is split over data x fsdp.
"""

from __future__ import annotations

import dataclasses
import math
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Shape of the device mesh.

    Attributes:
      data: size of the replicated data-parallel axis.
      fsdp: size of the fully-sharded data-parallel axis.
      tensor: size of the tensor-parallel axis; must divide the query and KV head counts.
      device_memory_bytes: memory of one device, for the memory plan (80 GB A100/H100 default).
    """

    data: int = 1
    fsdp: int = 1
    tensor: int = 1
    device_memory_bytes: int = 80 * 10**9

    def __post_init__(self):
        for name in MESH_AXES:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MeshConfig.{name} must be a positive int, got {value!r}")
        if self.device_memory_bytes <= 0:
            raise ValueError(
                f"MeshConfig.device_memory_bytes must be > 0, got {self.device_memory_bytes}"
            )

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.data, self.fsdp, self.tensor)

    @property
    def num_devices(self) -> int:
        return math.prod(self.shape)

    @property
    def batch_parallelism(self) -> int:
        """Number of ways the batch is split (data x fsdp)."""
        return self.data * self.fsdp

    def check_heads(self, num_attention_heads: int, num_key_value_heads: int) -> None:
        """Refuses a tensor axis that does not divide the query and KV head counts."""
        for field, heads in (
            ("num_attention_heads", num_attention_heads),
            ("num_key_value_heads", num_key_value_heads),
        ):
            if heads % self.tensor:
                raise ValueError(
                    f"MeshConfig.tensor={self.tensor} does not divide the model's {field}={heads}; "
                    f"choose a tensor size that divides both {num_attention_heads} query and "
                    f"{num_key_value_heads} KV heads"
                )


# Trainer meshes, with vLLM colocated on the same GPUs or on GPUs of its own (docs/sharding.md).
# Each shape is proved by `python -m bapo_jax.sharding.plan` at 1,024 + 8,192 tokens
# (docs/sharding.md).
PRESETS: dict[str, MeshConfig] = {
    # Half of one 8-GPU node for a 7B trainer (the other 4 GPUs run vLLM: aime_7b.SEPARATE):
    # ZeRO-3 over 4 (28 q / 4 kv heads need no tensor split); needs blockwise attention.
    "7b": MeshConfig(data=1, fsdp=4, tensor=1),
    # A whole 8-GPU node for a 7B trainer (aime_7b: vLLM colocated on the same GPUs).
    "7b-8gpu": MeshConfig(data=1, fsdp=8, tensor=1),
    # Two 8-GPU nodes for a 32B trainer: ZeRO-3 over 4 x tensor parallel over 4 (40 q / 8 kv
    # heads; a tensor group of 4 stays inside one node); needs blockwise attention.
    "32b": MeshConfig(data=1, fsdp=4, tensor=4),
    # Four 8-GPU nodes for a 32B trainer: ZeRO-3 over 8 x tensor parallel over 4 (aime_32b:
    # one vLLM server per node colocated on its GPUs).
    "32b-32gpu": MeshConfig(data=1, fsdp=8, tensor=4),
    # CPU test meshes (XLA_FLAGS=--xla_force_host_platform_device_count=8).
    "cpu1": MeshConfig(),
    "cpu-fsdp8": MeshConfig(fsdp=8),
    "cpu-fsdp4-tp2": MeshConfig(fsdp=4, tensor=2),
    "cpu-dp2-fsdp2-tp2": MeshConfig(data=2, fsdp=2, tensor=2),
}

# Memory of one device of each target accelerator, in GB of 10**9 bytes: the nominal size,
# which is at or below what the device reports (an H100's "80 GB" is 80 GiB = 85.9e9 bytes), so
# a plan against it is conservative.
ACCELERATORS: dict[str, int] = {
    "h100": 80 * 10**9,
    "h200": 141 * 10**9,
    "a100-40gb": 40 * 10**9,
    "a100-80gb": 80 * 10**9,
    "tpu-v5e": 16 * 10**9,
    "tpu-v5p": 95 * 10**9,
}


def mesh_preset(name: str) -> MeshConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown mesh preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


def accelerator_memory_bytes(name: str) -> int:
    """Bytes of memory of one device of accelerator `name` (`ACCELERATORS`)."""
    if name not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {name!r}; known: {sorted(ACCELERATORS)}")
    return ACCELERATORS[name]


def parse_mesh(spec: str) -> MeshConfig:
    """A preset name ("7b") or an explicit shape "data=1,fsdp=4,tensor=1[,memory_gb=80]".

    Axes left out of an explicit shape are 1; the one parser of every `--mesh` and `mesh=`.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"mesh must be a preset name or 'data=1,fsdp=4,tensor=1', got {spec!r}")
    if "=" not in spec:
        return mesh_preset(spec.strip())
    fields: dict[str, int] = {}
    for part in spec.split(","):
        key, sep, value = (x.strip() for x in part.partition("="))
        if not sep:
            raise ValueError(f"mesh spec {spec!r}: {part!r} is not key=value")
        if key in fields or (key == "memory_gb" and "device_memory_bytes" in fields):
            raise ValueError(f"mesh spec {spec!r}: {key} given twice")
        if key in MESH_AXES:
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"mesh axis {key} must be an int, got {value!r}") from None
        elif key == "memory_gb":
            try:
                fields["device_memory_bytes"] = int(float(value) * 10**9)
            except ValueError:
                raise ValueError(f"mesh memory_gb must be a number, got {value!r}") from None
        else:
            raise ValueError(
                f"mesh spec {spec!r}: unknown field {key!r}; use {MESH_AXES} or memory_gb"
            )
    return MeshConfig(**fields)


def make_mesh(config: MeshConfig, devices: list[jax.Device] | None = None) -> Mesh:
    """Builds a `Mesh` with Auto axis types (sharding propagated by XLA, as with pjit)."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) != config.num_devices:
        raise ValueError(
            f"MeshConfig shape data={config.data} x fsdp={config.fsdp} x tensor={config.tensor} "
            f"needs {config.num_devices} devices, but {len(devices)} are available"
        )
    grid = np.asarray(devices, dtype=object).reshape(config.shape)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


_HOST_DEVICE_COUNT_FLAG = "--xla_force_host_platform_device_count"


def xla_flags_with_cpu_devices(xla_flags: str, num_devices: int) -> str:
    """`xla_flags` with its host device count replaced: `num_devices` simulated CPU devices
    (none set for 1), every other flag kept."""
    flags = [f for f in xla_flags.split() if not f.startswith(_HOST_DEVICE_COUNT_FLAG)]
    if num_devices > 1:
        flags.append(f"{_HOST_DEVICE_COUNT_FLAG}={num_devices}")
    return " ".join(flags)


def use_cpu_devices(num_devices: int) -> None:
    """JAX in this process on the CPU platform with exactly `num_devices` simulated devices
    (XLA_FLAGS' host device count; both in `os.environ`, so child processes get them too).
    JAX reads them when its backend starts, not when it is imported, so this works in-process
    until then; a backend already started keeps its devices (callers check the count)."""
    os.environ["XLA_FLAGS"] = xla_flags_with_cpu_devices(
        os.environ.get("XLA_FLAGS", ""), num_devices
    )
    os.environ["JAX_PLATFORMS"] = "cpu"
    jax.config.update("jax_platforms", "cpu")
