"""Integrity checks of synced weights (the why: ``weight_sync``'s module doc).

FILES_SCHEME   XXH3-64 per 64 MiB segment of every checkpoint file (the default check:
               ~12 GB/s a core here, catches truncated and damaged files).
FILES_CRC32_SCHEME  the same table with zlib's CRC-32 (~1.7 GB/s a core); written before
               FILES_SCHEME, still read.
DIGEST_SCHEME  the sharding-invariant value digest ``digest_arrays`` (a sum of per-element
               hashes computed where the arrays live; opt-in, and older manifests).

Value digest (``digest_arrays``, scheme ``DIGEST_SCHEME``; opt-in ``value_digest=True``, and
the ``digest`` of manifests written before ``FILES_SCHEME``). For each parameter, two 32-bit
lane sums

    lane_0 = sum over elements e of h_e,  lane_1 = sum over e of fmix32(h_e ^ S)  (mod 2^32),
    h_e    = fmix32(bits(e) * K + pos(e)),   pos(e) = fmix32(seed(name) + horner_g(coords(e))),

where ``bits(e)`` is the element's raw bit pattern, ``horner_g`` folds its coordinates with
the odd multiplier g, K, S and g are fixed odd constants and fmix32 is MurmurHash3's
finalizer; blake2b-128 over each parameter's name, shape, dtype and lanes. A sum does not
depend on how the array is split, so it is computed where the array lives (jit; each process
sums its addressable shards, XLA's all-reduce combines them exactly) and equals what the
reader recomputes from its full host copy: it also checks that Orbax reassembled the values
the trainer held (the file check only sees bytes). Manifests with no ``digest_scheme`` carry
blake2b over the raw bytes.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import zlib
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import xxhash
from jax import lax

__all__ = [
    "DIGEST_SCHEME",
    "FILES_CRC32_SCHEME",
    "FILES_SCHEME",
    "FILE_SCHEMES",
    "SEGMENT_BYTES",
    "digest_arrays",
    "validate_manifest",
    "verify_hashes",
    "verify_layout",
]

DIGEST_SCHEME = "bapo-lanesum32x2-v1"
FILES_SCHEME = "bapo-files-xxh3-v1"
FILES_CRC32_SCHEME = "bapo-files-crc32-v1"
SEGMENT_BYTES = 64 << 20  # hash granularity: 16 segments per GB spread over the threads
_PARTIAL_TABLE = ".files.process_{}.json"  # one process's checksums, before the merge


# ---- digest ------------------------------------------------------------------------------------
_BITS_MULT = 0x85EBCA77  # K; odd constants from xxHash
_LANE_XOR = 0x27D4EB2F  # S
_COORD_MULT = 0x9E3779B1  # g (golden ratio)


def _fmix32(x: jax.Array) -> jax.Array:
    """MurmurHash3's 32-bit finalizer (a bijection that spreads every input bit)."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x85EBCA6B)
    x = x ^ (x >> 13)
    x = x * jnp.uint32(0xC2B2AE35)
    return x ^ (x >> 16)


def _bit_words(x: jax.Array) -> jax.Array:
    """Raw bits as uint32, one word per element; 64-bit dtypes get a trailing axis of 2."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    size = jnp.dtype(x.dtype).itemsize
    if size > 4:
        return lax.bitcast_convert_type(x, jnp.uint32)  # [..., size // 4]
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[size]
    return lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


@jax.jit
def _lane_sums(x: jax.Array, name_seed: jax.Array) -> jax.Array:
    """uint32[2]: the lane sums of the module doc (integer sums: exact under any sharding)."""
    words = _bit_words(x)  # [*S]
    folded = jnp.zeros(words.shape, jnp.uint32)  # [*S]
    for d in range(words.ndim):
        coord = lax.broadcasted_iota(jnp.uint32, words.shape, d)
        folded = (folded + coord) * jnp.uint32(_COORD_MULT)
    pos = _fmix32(folded + name_seed)
    h = _fmix32(words * jnp.uint32(_BITS_MULT) + pos)  # [*S]
    return jnp.stack(
        [
            jnp.sum(h, dtype=jnp.uint32),
            jnp.sum(_fmix32(h ^ jnp.uint32(_LANE_XOR)), dtype=jnp.uint32),
        ]
    )


def _name_seed(name: str) -> np.uint32:
    return np.frombuffer(hashlib.blake2b(name.encode(), digest_size=4).digest(), "<u4")[0]


def digest_arrays(flat: Mapping[str, Any]) -> str:
    """The ``DIGEST_SCHEME`` digest of ``{name: array}`` (see the module doc). Each array is
    digested where it lives (jax arrays, sharded or not, on their devices; host arrays on the
    default device); in a multi-process run every process must call it with the same tree."""
    h = hashlib.blake2b(digest_size=16)
    h.update(DIGEST_SCHEME.encode())
    for name in sorted(flat):
        x = flat[name]
        x = x if isinstance(x, jax.Array) else jnp.asarray(x)
        lanes = _lane_sums(x, _name_seed(name))
        if not lanes.is_fully_replicated:
            raise RuntimeError(f"digest of {name}: lane sums came back sharded ({lanes.sharding})")
        host = np.asarray(lanes.addressable_data(0), dtype="<u4")
        h.update(f"{name}|{tuple(x.shape)}|{jnp.dtype(x.dtype).name}|".encode())
        h.update(host.tobytes())
    return h.hexdigest()


def _digest_bytes_v0(flat: Mapping[str, np.ndarray]) -> str:
    """The digest of manifests written before ``DIGEST_SCHEME``: blake2b-128 over name, shape,
    dtype and raw bytes of each host array, in name order."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(flat):
        host = np.ascontiguousarray(np.asarray(flat[name]))
        h.update(f"{name}|{host.shape}|{host.dtype.name}|".encode())
        h.update(host.view(np.uint8).reshape(-1).data)
    return h.hexdigest()


# ---- file checksums (FILES_SCHEME) ---------------------------------------------------------
class _Crc32:
    """zlib's CRC-32 behind the streaming interface of xxhash's hashers."""

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


# scheme -> (the table's key for the per-segment values, a new streaming hasher)
FILE_SCHEMES: dict[str, tuple[str, Callable[[], Any]]] = {
    FILES_SCHEME: ("xxh3", xxhash.xxh3_64),
    FILES_CRC32_SCHEME: ("crc32", _Crc32),
}


def _segment_hash(path: str, offset: int, length: int, scheme: str) -> int:
    """The scheme's hash of ``length`` bytes of ``path`` from ``offset`` (a multiple of the
    page size), hashed where the page cache holds them (a read-only mapping: no copy; the
    hash releases the GIL, so threads overlap). Callers know the file is that long
    (``verify_layout``, or the writer's own files): a mapped file truncated while it is
    hashed would fault the process."""
    hasher = FILE_SCHEMES[scheme][1]()
    if length:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < offset + length:
                raise ValueError(f"{path}: shorter than {offset + length} bytes while hashing")
            mapped = mmap.mmap(f.fileno(), length, offset=offset, access=mmap.ACCESS_READ)
            with mapped, memoryview(mapped) as view:
                hasher.update(view)
    return hasher.intdigest()


def _checksum_files(
    base: str, rels: Iterable[str], segment: int = SEGMENT_BYTES, scheme: str = FILES_SCHEME
) -> dict[str, dict[str, Any]]:
    """``{rel: {"size", key: [one hash per segment]}}`` for files under ``base`` (key: the
    scheme's, e.g. "xxh3"); the segments of all files are spread over up to 4 threads."""
    key = FILE_SCHEMES[scheme][0]
    sizes = {rel: os.path.getsize(os.path.join(base, rel)) for rel in sorted(rels)}
    jobs = [(rel, off) for rel, size in sizes.items() for off in range(0, size, segment)]
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1, len(jobs)))) as ex:
        hashes = list(
            ex.map(
                lambda j: _segment_hash(
                    os.path.join(base, j[0]), j[1], min(segment, sizes[j[0]] - j[1]), scheme
                ),
                jobs,
            )
        )
    table: dict[str, dict[str, Any]] = {rel: {"size": n, key: []} for rel, n in sizes.items()}
    for (rel, _), value in zip(jobs, hashes, strict=True):
        table[rel][key].append(value)
    return table


def _files_under(base: str, sub: str) -> list[str]:
    """Paths (relative to ``base``) of the files below ``base/sub``."""
    out = []
    for d, _, names in os.walk(os.path.join(base, sub)):
        out += [os.path.relpath(os.path.join(d, n), base) for n in names]
    return sorted(out)


def _table_digest(table: Mapping[str, Any], segment: int, scheme: str = FILES_SCHEME) -> str:
    key = FILE_SCHEMES[scheme][0]
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{scheme}|{segment}".encode())
    for rel in sorted(table):
        h.update(f"|{rel}|{table[rel]['size']}|{table[rel][key]}".encode())
    return h.hexdigest()


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


# ---- the files of one version (FILES_SCHEME) ---------------------------------------------
def _own_files(base: str) -> list[str]:
    """The files this process checksums under ``base/params``: all of them with one process;
    else those in its own ``ocdbt.process_<i>`` directory, plus, on process 0, every file
    outside such directories (the merged OCDBT root and Orbax's metadata)."""
    files = _files_under(base, "params")
    if jax.process_count() == 1:
        return files
    mine = f"ocdbt.process_{jax.process_index()}"
    owned = {
        f: next((p for p in f.split(os.sep) if p.startswith("ocdbt.process_")), None) for f in files
    }
    primary = jax.process_index() == 0
    return [f for f, owner in owned.items() if owner == mine or (owner is None and primary)]


def _file_table(tmp: str) -> dict[str, dict[str, Any]]:
    """Checksums of every file under ``tmp/params``, computed by the processes that wrote
    them; the merged table on process 0 (the other processes get their own part)."""
    table = _checksum_files(tmp, _own_files(tmp))
    if jax.process_count() == 1:
        return table
    with open(os.path.join(tmp, _PARTIAL_TABLE.format(jax.process_index())), "w") as f:
        json.dump(table, f)
    _barrier(f"bapo-weight-sync-checksums-{os.path.basename(tmp)}")
    if jax.process_index() != 0:
        return table
    for i in range(1, jax.process_count()):
        part = os.path.join(tmp, _PARTIAL_TABLE.format(i))
        with open(part, encoding="utf-8") as f:
            table.update(json.load(f))
    for i in range(jax.process_count()):
        os.remove(os.path.join(tmp, _PARTIAL_TABLE.format(i)))
    missed = sorted(set(_files_under(tmp, "params")) - set(table))
    if missed:
        raise RuntimeError(f"files written but checksummed by no process: {missed}")
    return table


def verify_layout(path: str | os.PathLike, manifest: Mapping[str, Any]) -> None:
    """Refuse (ValueError naming the file) a version whose ``params/`` files are not those of
    the manifest's ``files`` table: missing, extra, truncated or grown. Cheap (the table's
    digest and a ``stat`` per file): it runs before anything reads the files."""
    path = os.fspath(path)
    scheme = manifest.get("digest_scheme")
    table, segment = manifest.get("files"), manifest.get("segment_bytes")
    if scheme not in FILE_SCHEMES:
        raise ValueError(f"{path}: digest_scheme {scheme!r} is not one of {sorted(FILE_SCHEMES)}")
    if (
        not isinstance(table, Mapping)
        or not isinstance(segment, int)
        or segment <= 0
        or segment % mmap.ALLOCATIONGRANULARITY
    ):
        raise ValueError(
            f"{path}: manifest has digest_scheme {scheme!r} but files={type(table).__name__}"
            f" and segment_bytes={segment!r} (want a table and a positive multiple of "
            f"{mmap.ALLOCATIONGRANULARITY})"
        )
    if _table_digest(table, segment, scheme) != manifest.get("digest"):
        raise ValueError(f"{path}: digest mismatch (the manifest's file table is damaged)")
    on_disk = set(_files_under(path, "params"))
    missing, extra = sorted(set(table) - on_disk), sorted(on_disk - set(table))
    if missing or extra:
        raise ValueError(f"{path}: files missing {missing}, unexpected {extra} (partly written?)")
    for rel, entry in table.items():
        size = os.path.getsize(os.path.join(path, rel))
        if size != entry["size"]:
            raise ValueError(
                f"{path}: {rel} has {size} bytes, the manifest says {entry['size']} "
                "(truncated or partly written checkpoint)"
            )


def verify_hashes(path: str | os.PathLike, manifest: Mapping[str, Any]) -> None:
    """Refuse (ValueError naming the file) a version whose files' bytes differ from the
    manifest's hashes, once ``verify_layout`` has passed."""
    path, scheme = os.fspath(path), manifest["digest_scheme"]
    table, segment, key = manifest["files"], manifest["segment_bytes"], FILE_SCHEMES[scheme][0]
    got = _checksum_files(path, table, segment, scheme)
    for rel, entry in table.items():
        want = list(entry[key])
        bad = [i for i, c in enumerate(got[rel][key]) if i >= len(want) or c != want[i]]
        if bad:
            raise ValueError(
                f"{path}: {rel} damaged: {key} mismatch in segment(s) {bad} of "
                f"{segment} bytes (digest mismatch; corrupt checkpoint)"
            )


# ---- the manifest ------------------------------------------------------------------------------
def validate_manifest(
    manifest: Mapping[str, Any],
    config: Any = None,
    *,
    version: int | None = None,
) -> Any:
    """Check a manifest before any tensor is loaded; returns its ``Qwen2Config``
    (``config``: the served model's ``Qwen2Config``, or None).

    Refuses (ValueError naming the problem) a wrong format or version, a config different from
    ``config``, and any missing, unexpected or wrongly shaped parameter.
    """
    from bapo_jax.models.config import Qwen2Config
    from bapo_jax.rollout import weight_sync as ws

    fmt = manifest.get("format")
    if fmt not in (*ws.ORBAX_FORMATS, ws.SAFETENSORS_FORMAT):
        raise ValueError(
            f"manifest format must be one of {[*ws.ORBAX_FORMATS, ws.SAFETENSORS_FORMAT]}, "
            f"got {fmt!r}"
        )
    if version is not None and manifest.get("version") != version:
        raise ValueError(f"manifest version is {manifest.get('version')!r}, expected {version}")
    own = Qwen2Config.from_hf(manifest["config"])
    if config is not None and own != config:
        raise ValueError(f"manifest config {own} differs from the served model's {config}")
    expected = (ws.expected_hf_shapes if fmt == ws.ORBAX_HF_FORMAT else ws.expected_param_shapes)(
        own
    )
    got = {k: tuple(v["shape"]) for k, v in manifest["params"].items()}
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    wrong = sorted(
        f"{k}: {got[k]} != expected {expected[k]}"
        for k in set(got) & set(expected)
        if got[k] != expected[k]
    )
    if missing or unexpected or wrong:
        raise ValueError(
            f"checkpoint version {manifest.get('version')} refused: missing parameters "
            f"{missing}, unexpected {unexpected}, wrong shapes {wrong}"
        )
    return own


def check_restored(path: str, manifest: Mapping[str, Any], flat: Mapping[str, np.ndarray]) -> None:
    """Refuse (ValueError) restored arrays whose names, shapes or dtypes differ from the
    manifest's, or whose value digest (if the manifest has one) does not match."""
    scheme = manifest.get("digest_scheme")
    want = manifest["params"]
    if sorted(flat) != sorted(want):
        raise ValueError(
            f"{path}: restored parameters {sorted(flat)} differ from the manifest's {sorted(want)}"
        )
    for k, v in flat.items():
        if list(v.shape) != want[k]["shape"] or v.dtype.name != want[k]["dtype"]:
            raise ValueError(
                f"{path}: {k} restored as {v.shape} {v.dtype}, manifest says "
                f"{want[k]['shape']} {want[k]['dtype']}"
            )
    checks = []  # (stored digest, how to recompute it)
    if scheme not in FILE_SCHEMES and manifest.get("digest") is not None:
        checks.append((manifest["digest"], digest_arrays if scheme else _digest_bytes_v0))
    if manifest.get("value_digest") is not None:
        if manifest.get("value_digest_scheme") != DIGEST_SCHEME:
            raise ValueError(
                f"{path}: unknown value_digest_scheme {manifest.get('value_digest_scheme')!r}"
            )
        checks.append((manifest["value_digest"], digest_arrays))
    for stored, recompute in checks:
        if recompute(flat) != stored:
            raise ValueError(f"{path}: digest mismatch (corrupt or partially written checkpoint)")
