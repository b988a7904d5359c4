"""Reading a synced version straight from its files: one pass over each file hashes it and
copies its arrays' bytes into buffers the caller chooses.

A version's ``params/`` is an uncompressed Orbax OCDBT checkpoint (``weight_sync``): per
array, a zarr (v2) metadata entry and its chunks (one chunk per array from a one-process
writer, one per shard from a sharded one), each chunk's bytes stored whole (C order, no
codec) at an offset of a data file, small values inline in the b-tree. TensorStore's public
``ocdbt.dump`` lists those entries (key -> inline bytes or file, offset, length); this module
then reads every data file once, through a read-only mapping of the page cache: it hashes the
file against the manifest's table and copies each chunk into its place in the destination
array, which ``allocate(name, shape, dtype)`` supplies (host arrays by default; a vLLM worker
passes views of its node's shared sync buffer: ``node_share``). Optionally each file's cached
pages are dropped once it is done (``drop_cache``), so the host holds the destination plus the
files in flight, not a second copy of the version in the page cache.

Nothing read is returned unless every file's hashes match (``sync_checks.verify_hashes``,
naming a damaged file). Callers check the manifest, its HMAC and the files' names and sizes
first (``verify_layout``: a mapped file truncated while read would fault the process), and
the arrays' names, shapes and dtypes after (``check_restored``).
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

__all__ = ["Allocate", "numpy_dtype", "read_version"]

Allocate = Callable[[str, tuple[int, ...], np.dtype], np.ndarray]


def numpy_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass
class _Array:
    """One stored array: its zarr metadata and where each chunk lies."""

    shape: tuple[int, ...]
    chunks: tuple[int, ...]
    dtype: np.dtype
    inline: dict[tuple[int, ...], bytes] = field(default_factory=dict)
    stored: dict[tuple[int, ...], tuple[str, int, int]] = field(default_factory=dict)

    def grid(self) -> list[tuple[int, ...]]:
        sizes = zip(self.shape, self.chunks, strict=True)
        return list(itertools.product(*(range(-(-n // c)) for n, c in sizes)))


def _zarray(name: str, raw: bytes) -> _Array:
    """Parse and check one ``.zarray``: the layout this reader copies (what ``weight_sync``
    writes); anything else is refused naming the field."""
    meta = json.loads(raw)
    want = {"zarr_format": 2, "compressor": None, "filters": None, "order": "C"}
    for key, value in want.items():
        if meta.get(key) != value:
            raise ValueError(
                f"array {name!r}: {key}={meta.get(key)!r}, this reader needs {value!r} "
                "(an uncompressed checkpoint written by weight_sync)"
            )
    shape, chunks = tuple(meta["shape"]), tuple(meta["chunks"])
    if len(shape) != len(chunks) or any(c <= 0 for c in chunks):
        raise ValueError(f"array {name!r}: chunks {chunks} do not fit shape {shape}")
    return _Array(shape, chunks, numpy_dtype(meta["dtype"]))


def _location(ref: str) -> tuple[str, int, int]:
    """``value:<base>:<file>:<offset>:<length>`` (OCDBT's dump) -> (file relative to the
    checkpoint root, offset, length)."""
    head, offset, length = ref.rsplit(":", 2)
    kind, base, rel = head.split(":", 2)
    if kind != "value":
        raise ValueError(f"unexpected OCDBT value reference {ref!r}")
    return os.path.normpath(base + rel), int(offset), int(length)


def _locate(params_dir: str) -> dict[str, _Array]:
    """Stored array name (the tree path joined with ``.``) -> its metadata and chunks."""
    import tensorstore as ts

    base = ts.KvStore.open(f"file://{params_dir}/").result()
    versions = ts.ocdbt.dump(base).result()["versions"]
    if not versions:
        raise ValueError("the OCDBT index holds no version")
    root = versions[-1]
    if root.get("root_height", 0) != 0:  # one leaf holds ~10^5 keys: a 32B version has ~10^3
        raise ValueError(f"OCDBT b-tree of height {root['root_height']}: one leaf expected")
    entries = ts.ocdbt.dump(base, root["root"]["location"]).result()["entries"]
    arrays: dict[str, _Array] = {}
    chunk_entries = []
    for entry in entries:
        name, _, part = entry["key"].decode().rpartition("/")
        if part == ".zarray":
            raw = entry.get("inline_value")
            if raw is None:
                raise ValueError(f"array {name!r}: its .zarray is not inline")
            arrays[name] = _zarray(name, raw)
        else:
            chunk_entries.append((name, part, entry))
    for name, part, entry in chunk_entries:
        if name not in arrays:
            raise ValueError(f"chunk {name}/{part} of no array")
        array = arrays[name]
        index = tuple(int(i) for i in part.split(".")) if array.shape else ()  # 0-d: key "0"
        if "inline_value" in entry:
            array.inline[index] = entry["inline_value"]
        else:
            array.stored[index] = _location(entry["indirect_value"])
    for name, array in arrays.items():
        have, grid = set(array.inline) | set(array.stored), array.grid()
        if have != set(grid):
            raise ValueError(f"array {name!r}: chunks {sorted(set(grid) - have)} missing")
    return arrays


def _block(dest: np.ndarray, array: _Array, index: tuple[int, ...]) -> np.ndarray:
    """The view of ``dest`` that chunk ``index`` covers (clipped at the array's edge)."""
    if not index:  # a 0-d array: its one chunk, as a view (dest[()] would be a copy)
        return dest[...]
    return dest[
        tuple(
            slice(i * c, min((i + 1) * c, n))
            for i, c, n in zip(index, array.chunks, array.shape, strict=True)
        )
    ]


def _place(dest: np.ndarray, array: _Array, index: tuple[int, ...], data: Any) -> None:
    """Copy one stored chunk (a full chunk, also at the array's edge) into ``dest``."""
    count = math.prod(array.chunks)
    if len(data) != count * array.dtype.itemsize:
        raise ValueError(f"chunk {index}: {len(data)} bytes, want {count * array.dtype.itemsize}")
    src = np.frombuffer(data, array.dtype, count).reshape(array.chunks)
    block = _block(dest, array, index)
    block[...] = src[tuple(slice(0, n) for n in block.shape)]


def _pass_file(
    path: str, size: int, segment: int, jobs: list[tuple[np.ndarray, _Array, tuple, int, int]],
    drop_cache: bool,
) -> tuple[list[int], float]:  # fmt: skip
    """Hash one file per segment and copy its chunks out of the same mapping. A chunk whose
    place in its array is one contiguous run of bytes (a whole array, or rows of it) is
    copied segment by segment, right after the segment is hashed, and with ``drop_cache``
    each segment's cached pages are dropped at once: the page cache holds one segment of
    the file at a time. Other chunks (a shard cut along an inner dimension: a shard-sized
    file) are copied whole after the hash pass. Returns (the segments' XXH3-64, seconds
    spent hashing)."""
    hashes, hash_s = [], 0.0
    runs, whole = [], []  # (destination bytes, file offset) | (dest, array, index, data range)
    for dest, array, index, offset, length in jobs:
        if offset + length > size:
            raise ValueError(f"{path}: chunk {index} beyond the file's end")
        block = _block(dest, array, index)
        if block.shape == array.chunks and block.flags.c_contiguous:
            if length != block.nbytes:
                raise ValueError(f"{path}: chunk {index} has {length} bytes, want {block.nbytes}")
            runs.append((block.reshape(-1).view(np.uint8), offset))
        else:
            whole.append((dest, array, index, offset, length))
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size != size:
            raise ValueError(f"{path}: not {size} bytes while read")
        if size:
            mapped = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
            with mapped, memoryview(mapped) as view:
                for off in range(0, size, segment):
                    end = min(off + segment, size)
                    t0 = time.perf_counter()
                    hashes.append(xxhash.xxh3_64_intdigest(view[off:end]))
                    hash_s += time.perf_counter() - t0
                    for out, start in runs:  # the part of each run inside this segment
                        lo, hi = max(off, start), min(end, start + len(out))
                        if lo < hi:
                            out[lo - start : hi - start] = view[lo:hi]
                    if drop_cache and not whole:
                        os.posix_fadvise(f.fileno(), off, end - off, os.POSIX_FADV_DONTNEED)
                for dest, array, index, offset, length in whole:
                    with view[offset : offset + length] as data:
                        _place(dest, array, index, data)
        if drop_cache and whole:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return hashes, hash_s


def read_version(
    path: str | os.PathLike,
    manifest: Mapping[str, Any],
    *,
    allocate: Allocate | None = None,
    drop_cache: bool = False,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """Every array of version ``path`` (names as the manifest's ``params``, ``/``-joined) in
    buffers from ``allocate`` (default ``np.empty``), each file hashed against the manifest's
    ``files`` table in the same pass (module doc). Returns (arrays, timings: ``read_s`` the
    pass's wall time, ``verify_s`` the hashing's share of it). Raises ValueError naming a
    damaged file (before anything is returned) or a stored layout this reader does not copy."""
    from bapo_jax.rollout.sync_checks import verify_hashes

    path = os.fspath(path)
    params_dir, table = os.path.join(path, "params"), manifest["files"]
    segment = int(manifest["segment_bytes"])
    allocate = allocate or (lambda _name, shape, dtype: np.empty(shape, dtype))
    t0 = time.perf_counter()
    try:
        arrays = _locate(params_dir)
    except Exception as error:  # a damaged index file: the file check names it
        verify_hashes(path, manifest)
        raise ValueError(f"{path}: unreadable checkpoint index: {error}") from error
    out: dict[str, np.ndarray] = {}
    per_file: dict[str, list] = {rel: [] for rel in table}
    for stored_name, array in arrays.items():
        name = stored_name.replace(".", "/")
        dest = out[name] = allocate(name, array.shape, array.dtype)
        if dest.shape != array.shape or dest.dtype != array.dtype:
            raise ValueError(f"allocate({name!r}) gave {dest.shape} {dest.dtype}")
        for index, data in array.inline.items():
            _place(dest, array, index, data)
        for index, (rel, offset, length) in array.stored.items():
            key = os.path.join("params", rel)
            if key not in per_file:
                raise ValueError(f"{path}: chunk {stored_name}/{index} in {key}, not in the table")
            per_file[key].append((dest, array, index, offset, length))

    def one_pass(rel: str) -> tuple[list[int], float]:
        size = table[rel]["size"]
        return _pass_file(os.path.join(path, rel), size, segment, per_file[rel], drop_cache)

    order = sorted(table, key=lambda rel: -table[rel]["size"])  # the largest first
    workers = max(1, min(4, os.cpu_count() or 1, len(order)))
    with ThreadPoolExecutor(workers, thread_name_prefix="bapo-read") as pool:
        results = dict(zip(order, pool.map(one_pass, order), strict=True))
    verify_hashes(path, manifest, {rel: hashes for rel, (hashes, _) in results.items()})
    hash_s = sum(seconds for _, seconds in results.values())
    return out, {"read_s": time.perf_counter() - t0, "verify_s": hash_s / workers}
