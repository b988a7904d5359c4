"""Builds and registers the CPU kernels of this package (every `*.cc` beside this file, one
shared library), which XLA calls as FFI custom calls.

The C++ sources are compiled for the host CPU (`-O3 -march=native`) on first use, with the
system's C++ compiler and JAX's FFI headers, into a cache keyed by the sources and their
headers, the compiler command, jaxlib's version and the CPU's feature flags
(`$BAPO_JAX_KERNEL_CACHE`, default `~/.cache/bapo_jax/kernels`; written to a temporary file,
then renamed). `available()` says whether the kernels can run here: on CPU, not disabled with
`BAPO_JAX_CPU_KERNELS=0`, and built.
Callers keep XLA's ops as the path when they cannot.
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
import jaxlib

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cc")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))  # included by the sources
# FFI target name -> the handler symbol the library exports
TARGETS = {
    "bapo_panel_matmul": "BapoPanelMatmul",
    "bapo_decode_attention": "BapoDecodeAttention",
}
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
        *map(str, SOURCES),
        "-o",
        out,
    ]


def library_path() -> Path:
    """Where the compiled kernels for these sources, compiler, jaxlib and CPU live."""
    key = hashlib.sha256()
    parts = (
        *(p.read_bytes() for p in SOURCES + HEADERS),
        " ".join(_compile_command("")),
        jaxlib.__version__,
    )
    for part in parts:
        key.update(part if isinstance(part, bytes) else part.encode())
    key.update(_cpu_flags().encode())
    cache = os.environ.get("BAPO_JAX_KERNEL_CACHE") or Path.home() / ".cache/bapo_jax/kernels"
    return Path(cache) / f"bapo_kernels-{key.hexdigest()[:16]}.so"


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
    """True when the kernels are registered with XLA and can run on the default backend."""
    if os.environ.get("BAPO_JAX_CPU_KERNELS", "1") == "0" or jax.default_backend() != "cpu":
        return False
    path = library_path()
    try:
        if not path.exists():
            _build(path)
        library = ctypes.cdll.LoadLibrary(str(path))
        for target, symbol in TARGETS.items():
            handler = jax.ffi.pycapsule(getattr(library, symbol))
            jax.ffi.register_ffi_target(target, handler, platform="cpu")
    except (OSError, AttributeError, subprocess.CalledProcessError) as error:
        detail = getattr(error, "stderr", "") or error
        _log.warning("CPU kernels unavailable, decoding uses XLA's ops: %s", detail)
        return False
    return True
