"""The embedded sampler's CPU kernels as decode ops (`decode.DecodeOps`): matrices in the
column panels of `bapo_jax.kernels.panel_matmul` and the decode step's attention in
`bapo_jax.kernels.decode_attention`, both XLA FFI custom calls (fp32, one device).

The kernel runs a 16-row step's dots about 1.4x faster than XLA's and does the RMSNorm before a
product and the residual add after it inside its call (fewer XLA thunks per step); at many rows
of a tiny model XLA's dots are faster (docs/rollout.md), so the engine can switch them off.
`COLUMN_BLOCKS` is the engine's XLA layout otherwise: one column block per core of this
project's 2-core benchmark machine.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from bapo_jax.kernels import decode_attention, panel_matmul
from bapo_jax.models.decode import ColumnBlocks

__all__ = ["COLUMN_BLOCKS", "PackedMatrix", "PanelKernels", "decode_ops"]

COLUMN_BLOCKS = 2


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedMatrix:
    """A weight matrix [K, N] in the kernel's column panels (`panel_matmul.pack`):
    panels [ceil(N / 16), K, 16]."""

    panels: Float[Array, "P K 16"]
    n: int = dataclasses.field(metadata=dict(static=True))


@dataclasses.dataclass(frozen=True)
class PanelKernels:
    """`decode.DecodeOps` on the CPU kernels (fp32 only)."""

    def prepare(self, w: Float[Array, "I O"]) -> PackedMatrix:
        if w.dtype != jnp.float32:
            raise ValueError(f"PanelKernels need fp32 weights (fp32 compute), got {w.dtype}")
        return PackedMatrix(panel_matmul.pack(w), w.shape[-1])

    def linear(
        self,
        x: Float[Array, "... I"],
        stored: PackedMatrix,
        out_dtype=None,
        *,
        norm: Float[Array, " I"] | None = None,
        eps: float = 0.0,
        residual: Float[Array, "... O"] | None = None,
    ) -> Float[Array, "... O"]:
        rows = x.reshape(-1, x.shape[-1])  # [M, I]
        flat_residual = None if residual is None else residual.reshape(rows.shape[0], stored.n)
        out = panel_matmul.panel_matmul(
            rows, stored.panels, stored.n, scale=norm, eps=eps, residual=flat_residual
        )  # [M, O] fp32
        return out.reshape(*x.shape[:-1], stored.n).astype(out_dtype or x.dtype)

    def attention(
        self,
        q: Float[Array, "B K G H"],
        keys: Float[Array, "B K H S"],
        values: Float[Array, "B K S H"],
        valid: Bool[Array, "B S"],
    ) -> Float[Array, "B K G H"]:
        return decode_attention.decode_attention(q, keys, values, valid)


def decode_ops(params, compute_dtype, *, cpu_kernels: bool) -> PanelKernels | ColumnBlocks:
    """The kernels for fp32 params on one device when asked for and they can run here, else
    XLA's dots in `COLUMN_BLOCKS` column blocks."""
    one_device = all(len(leaf.sharding.device_set) == 1 for leaf in jax.tree.leaves(params))
    fp32 = jnp.dtype(compute_dtype) == jnp.float32
    if cpu_kernels and one_device and fp32 and panel_matmul.available():
        return PanelKernels()
    return ColumnBlocks(COLUMN_BLOCKS)
