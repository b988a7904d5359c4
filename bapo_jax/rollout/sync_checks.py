"""Integrity checks of synced weights (the why: ``weight_sync``'s module doc).

FILES_SCHEME   XXH3-64 per 64 MiB segment of every checkpoint file (~12 GB/s a core here,
               catches truncated and damaged files), and blake2b-128 over that table.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
import xxhash

__all__ = [
    "FILES_SCHEME",
    "SEGMENT_BYTES",
    "check_header",
    "file_fields",
    "validate_manifest",
    "verify_hashes",
    "verify_layout",
]

FILES_SCHEME = "bapo-files-xxh3-v1"
SEGMENT_BYTES = 64 << 20  # hash granularity: 16 segments per GB spread over the threads
_PARTIAL_TABLE = ".files.process_{}.json"  # one process's checksums, before the merge


# ---- file checksums (FILES_SCHEME) ---------------------------------------------------------
def _segment_hash(path: str, offset: int, length: int) -> int:
    """The XXH3-64 of ``length`` bytes of ``path`` from ``offset`` (a multiple of the
    page size), hashed where the page cache holds them (a read-only mapping: no copy; the
    hash releases the GIL, so threads overlap). Callers know the file is that long
    (``verify_layout``, or the writer's own files): a mapped file truncated while it is
    hashed would fault the process."""
    hasher = xxhash.xxh3_64()
    if length:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < offset + length:
                raise ValueError(f"{path}: shorter than {offset + length} bytes while hashing")
            mapped = mmap.mmap(f.fileno(), length, offset=offset, access=mmap.ACCESS_READ)
            with mapped, memoryview(mapped) as view:
                hasher.update(view)
    return hasher.intdigest()


def _checksum_files(
    base: str, rels: Iterable[str], segment: int = SEGMENT_BYTES
) -> dict[str, dict[str, Any]]:
    """``{rel: {"size", "xxh3": [one XXH3-64 per segment]}}`` for files under ``base``; the
    segments of all files are spread over up to 4 threads."""
    sizes = {rel: os.path.getsize(os.path.join(base, rel)) for rel in sorted(rels)}
    jobs = [(rel, off) for rel, size in sizes.items() for off in range(0, size, segment)]
    with ThreadPoolExecutor(max(1, min(4, os.cpu_count() or 1, len(jobs)))) as ex:
        hashes = list(
            ex.map(
                lambda j: _segment_hash(
                    os.path.join(base, j[0]), j[1], min(segment, sizes[j[0]] - j[1])
                ),
                jobs,
            )
        )
    table: dict[str, dict[str, Any]] = {rel: {"size": n, "xxh3": []} for rel, n in sizes.items()}
    for (rel, _), value in zip(jobs, hashes, strict=True):
        table[rel]["xxh3"].append(value)
    return table


def _files_under(base: str, sub: str) -> list[str]:
    """Paths (relative to ``base``) of the files below ``base/sub``."""
    out = []
    for d, _, names in os.walk(os.path.join(base, sub)):
        out += [os.path.relpath(os.path.join(d, n), base) for n in names]
    return sorted(out)


def _table_digest(table: Mapping[str, Any], segment: int) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{FILES_SCHEME}|{segment}".encode())
    for rel in sorted(table):
        h.update(f"|{rel}|{table[rel]['size']}|{table[rel]['xxh3']}".encode())
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


def file_fields(tmp: str) -> dict[str, Any]:
    """The manifest fields of the version being written in ``tmp``: the table of every file
    under ``tmp/params`` (``_file_table``), its digest, the scheme and the segment size."""
    table = _file_table(tmp)
    return {
        "files": table,
        "digest": _table_digest(table, SEGMENT_BYTES),
        "digest_scheme": FILES_SCHEME,
        "segment_bytes": SEGMENT_BYTES,
    }


def verify_layout(path: str | os.PathLike, manifest: Mapping[str, Any]) -> None:
    """Refuse (ValueError naming the file) a version whose ``params/`` files are not those of
    the manifest's ``files`` table: missing, extra, truncated or grown. Cheap (the table's
    digest and a ``stat`` per file): it runs before anything reads the files."""
    path = os.fspath(path)
    scheme = manifest.get("digest_scheme")
    table, segment = manifest.get("files"), manifest.get("segment_bytes")
    if scheme != FILES_SCHEME:
        raise ValueError(f"{path}: digest_scheme must be {FILES_SCHEME!r}, got {scheme!r}")
    if (
        not isinstance(table, Mapping)
        or not isinstance(segment, int)
        or segment <= 0
        or segment % mmap.ALLOCATIONGRANULARITY
    ):
        raise ValueError(
            f"{path}: manifest has files={type(table).__name__} and segment_bytes={segment!r} "
            f"(want a table and a positive multiple of {mmap.ALLOCATIONGRANULARITY})"
        )
    if _table_digest(table, segment) != manifest.get("digest"):
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


def verify_hashes(
    path: str | os.PathLike,
    manifest: Mapping[str, Any],
    hashes: Mapping[str, list[int]] | None = None,
) -> None:
    """Refuse (ValueError naming the file) a version whose files' bytes differ from the
    manifest's hashes, once ``verify_layout`` has passed. hashes: ``{file: [XXH3-64 per
    segment]}`` already computed (``sync_read`` hashes as it reads); None: hashed here."""
    path, table, segment = os.fspath(path), manifest["files"], manifest["segment_bytes"]
    if hashes is None:
        hashes = {rel: e["xxh3"] for rel, e in _checksum_files(path, table, segment).items()}
    for rel in sorted(table):
        want, got = list(table[rel]["xxh3"]), list(hashes[rel])
        bad = [i for i in range(max(len(want), len(got))) if want[i : i + 1] != got[i : i + 1]]
        if bad:
            raise ValueError(
                f"{path}: {rel} damaged: xxh3 mismatch in segment(s) {bad} of "
                f"{segment} bytes (digest mismatch; corrupt checkpoint)"
            )


# ---- the manifest ------------------------------------------------------------------------------
def check_header(
    manifest: Mapping[str, Any], fmt: str, config: Any = None, *, version: int | None = None
) -> Any:
    """The manifest's ``Qwen2Config``, once its format is ``fmt``, its version ``version`` and
    its config ``config`` (the served model's; None: any); ValueError naming the field else."""
    from bapo_jax.models.config import Qwen2Config

    if (got := manifest.get("format")) != fmt:
        raise ValueError(f"manifest format must be {fmt!r}, got {got!r}")
    if version is not None and manifest.get("version") != version:
        raise ValueError(f"manifest version is {manifest.get('version')!r}, expected {version}")
    own = Qwen2Config.from_hf(manifest["config"])
    if config is not None and own != config:
        raise ValueError(f"manifest config {own} differs from the served model's {config}")
    return own


def validate_manifest(
    manifest: Mapping[str, Any],
    config: Any = None,
    *,
    version: int | None = None,
) -> Any:
    """Check a ``FORMAT`` manifest before any tensor is loaded (``check_header``, then any
    missing, unexpected or wrongly shaped tensor refused, naming it); returns its
    ``Qwen2Config``."""
    from bapo_jax.rollout import weight_sync as ws

    own = check_header(manifest, ws.FORMAT, config, version=version)
    expected = ws.expected_hf_shapes(own)
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
    manifest's."""
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
