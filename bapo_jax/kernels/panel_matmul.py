"""A CPU matmul for decoding: y [M, N] = x [M, K] @ W [K, N] in fp32 at a handful of rows.

A decode step multiplies every weight matrix by B rows (a handful). XLA's CPU library dots
run such products well below the FMA peak; this kernel (`panel_matmul.cc`, an XLA FFI custom
call) stores W in column panels of 16,

    panels[p, k, j] = W[k, 16 p + j]   (zero past N),   shape [P, K, 16], P = ceil(N / 16),

and streams each panel once with a tile of rows in vector registers (16 rows with AVX-512, 6
with AVX2: `panel_matmul.cc`), nearer the peak (measured:
docs/rollout.md, `benchmarks.embedded_decode`). Each output is one sequential fp32 sum over
k, so results do not depend on the thread count.

Fused. Small XLA fusions around each product cost a decode step more than their arithmetic
(docs/rollout.md), so the norm before a product and the residual add after it can be done
inside the call, as options:

    y = residual + rms_norm(x; scale, eps) @ W     (rms_norm: HF Qwen2RMSNorm, in fp32)

Built and registered by `bapo_jax.kernels.library` (`available()`: whether it can run here;
callers keep XLA's dot as the path when it cannot).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float

from bapo_jax.kernels.library import available

__all__ = ["PANEL", "TARGET", "available", "pack", "panel_matmul", "unpack"]

PANEL = 16  # columns per panel (one 64-byte vector of fp32)
TARGET = "bapo_panel_matmul"


def pack(w: Float[Array, "K N"]) -> Float[Array, "P K 16"]:
    """W [K, N] -> panels [ceil(N / 16), K, 16], zero-padded past N."""
    k, n = w.shape
    padded = jnp.pad(w, ((0, 0), (0, -n % PANEL)))  # [K, 16 P]
    return padded.reshape(k, -1, PANEL).transpose(1, 0, 2)  # [P, K, 16]


def unpack(panels: Float[Array, "P K 16"], n: int) -> Float[Array, "K N"]:
    """The inverse of `pack`."""
    p, k, _ = panels.shape
    return panels.transpose(1, 0, 2).reshape(k, p * PANEL)[:, :n]


def panel_matmul(
    x: Float[Array, "M K"],
    panels: Float[Array, "P K 16"],
    n: int,
    *,
    scale: Float[Array, " K"] | None = None,
    eps: float = 0.0,
    residual: Float[Array, "M N"] | None = None,
) -> Float[Array, "M N"]:
    """residual + rms_norm(x) @ W for W = unpack(panels, n), fp32 in and out: [M, N].

    rms_norm is HF's Qwen2RMSNorm, scale * x / sqrt(mean(x^2) + eps) per row, applied only when
    `scale` is given; `residual` is added only when given. Needs `available()`."""
    m, k = x.shape
    dtypes = {"x": x, "panels": panels, "scale": scale, "residual": residual}
    for name, a in dtypes.items():
        if a is not None and a.dtype != jnp.float32:
            raise ValueError(f"panel_matmul takes fp32, got {name} {a.dtype}")
    if panels.shape[1:] != (k, PANEL) or panels.shape[0] != -(-n // PANEL):
        raise ValueError(
            f"panel_matmul: panels {panels.shape} do not hold a [{k}, {n}] matrix "
            f"(want [{-(-n // PANEL)}, {k}, {PANEL}])"
        )
    if scale is not None and scale.shape != (k,):
        raise ValueError(f"panel_matmul: scale has shape {scale.shape}, want ({k},)")
    if residual is not None and residual.shape != (m, n):
        raise ValueError(f"panel_matmul: residual has shape {residual.shape}, want ({m}, {n})")
    none = jnp.zeros((0,), jnp.float32)  # the kernel reads an empty operand as "not given"
    out = jax.ShapeDtypeStruct((m, n), jnp.float32)
    return jax.ffi.ffi_call(TARGET, out)(
        x,
        panels,
        none if scale is None else scale,
        none if residual is None else residual,
        eps=np.float32(eps),
    )
