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


# Trainer meshes. The vLLM servers run on separate GPUs (docs/sharding.md).
PRESETS: dict[str, MeshConfig] = {
    # 8 x 80 GB for a 7B trainer: ZeRO-3 over all 8 (28 q / 4 kv heads need no tensor split).
    # Chosen with `python -m bapo_jax.sharding.plan` (docs/sharding.md).
    "7b": MeshConfig(data=1, fsdp=8, tensor=1),
    # 32 x 80 GB for a 32B trainer: ZeRO-3 over 8 x tensor parallel over 4 (40 q / 8 kv heads).
    # Pure fsdp=32 does not fit 9k-token sequences (docs/sharding.md has the plan numbers).
    "32b": MeshConfig(data=1, fsdp=8, tensor=4),
    # CPU test meshes (XLA_FLAGS=--xla_force_host_platform_device_count=8).
    "cpu1": MeshConfig(),
    "cpu-fsdp8": MeshConfig(fsdp=8),
    "cpu-fsdp4-tp2": MeshConfig(fsdp=4, tensor=2),
    "cpu-dp2-fsdp2-tp2": MeshConfig(data=2, fsdp=2, tensor=2),
}


def mesh_preset(name: str) -> MeshConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown mesh preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]


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
