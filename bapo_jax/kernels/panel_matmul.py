"""A CPU matmul for decoding: y [M, N] = x [M, K] @ W [K, N] in fp32 at a handful of rows.

A decode step multiplies every weight matrix by B rows (B = 16 in the benchmark). XLA's CPU
library dots reach about half the FMA peak of the 2-core benchmark host there; this kernel
(`panel_matmul.cc`, an XLA FFI custom call) stores W in column panels of 16,

    panels[p, k, j] = W[k, 16 p + j]   (zero past N),   shape [P, K, 16], P = ceil(N / 16),

and streams each panel once with 16 rows of accumulators, at about two thirds of the peak
(the 31M model's decode dots: 146 vs 100-110 GFLOP/s, docs/rollout.md). Each output is one
sequential fp32 sum over k, so results do not depend on the thread count.

Fused. A decode step runs ~200 small XLA thunks besides its ~30 products, so the norm before a
product and the residual add after it are done inside the call, as options:

    y = residual + rms_norm(x; scale, eps) @ W     (rms_norm: HF Qwen2RMSNorm, in fp32)

Build. The C++ source is compiled for the host CPU (`-O3 -march=native`) on first use, with the
system's C++ compiler and JAX's FFI headers, into a cache keyed by the source, the compiler
command, jaxlib's version and the CPU's feature flags (`$BAPO_JAX_KERNEL_CACHE`, default
`~/.cache/bapo_jax/kernels`; written to a temporary file, then renamed). `available()` says
whether the kernel can run here: on CPU, not disabled with `BAPO_JAX_CPU_KERNELS=0`, and built.
Callers keep XLA's dot as the path when it cannot.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
from jaxtyping import Array, Float

PANEL = 16  # columns per panel (one 64-byte vector of fp32)
TARGET = "bapo_panel_matmul"
SOURCE = Path(__file__).with_name("panel_matmul.cc")
_log = logging.getLogger(__name__)


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _compile_command(out: str) -> list[str]:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or "c++"
    return [
        compiler,
        "-O3",
        "-march=native",
        "-std=c++17",
        "-shared",
        "-fPIC",
        f"-I{jax.ffi.include_dir()}",
        str(SOURCE),
        "-o",
        out,
    ]


def library_path() -> Path:
    """Where the compiled kernel for this source, compiler, jaxlib and CPU lives."""
    key = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(_compile_command("")).encode(), jaxlib.__version__):
        key.update(part if isinstance(part, bytes) else part.encode())
    key.update(_cpu_flags().encode())
    cache = os.environ.get("BAPO_JAX_KERNEL_CACHE") or Path.home() / ".cache/bapo_jax/kernels"
    return Path(cache) / f"panel_matmul-{key.hexdigest()[:16]}.so"


def _build(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        subprocess.run(_compile_command(tmp), check=True, capture_output=True, text=True)
        os.replace(tmp, path)  # atomic: a concurrent build or a crash never leaves half a file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def available() -> bool:
    """True when the kernel is registered with XLA and can run on the default backend."""
    if os.environ.get("BAPO_JAX_CPU_KERNELS", "1") == "0" or jax.default_backend() != "cpu":
        return False
    path = library_path()
    try:
        if not path.exists():
            _build(path)
        library = ctypes.cdll.LoadLibrary(str(path))
        jax.ffi.register_ffi_target(
            TARGET, jax.ffi.pycapsule(library.BapoPanelMatmul), platform="cpu"
        )
    except (OSError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        _log.warning("panel_matmul kernel unavailable, decoding uses XLA dots: %s", detail)
        return False
    return True


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
