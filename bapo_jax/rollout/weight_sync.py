"""Policy weights from the trainer to the rollout servers, one directory per version
(docs/rollout.md, "Weight sync"). ``write_orbax(params, root, version=v, step=s,
config=cfg)`` writes

    root/v00000007/params/       params-only Orbax PyTree checkpoint in HF layout (``FORMAT``):
                                 programs on the trainer's devices do the transposes and the
                                 cast (bf16 by default); per-layer tensors are stacked,
                                 [L, *HF shape], named like ``model/layers/mlp/up_proj/weight``
    root/v00000007/manifest.json {format, version, step, dtype, config, params: {name: {shape,
                                  dtype}}, files: {path: {size, xxh3}}, digest, ...}

into a temp directory beside it (uncompressed: Orbax's default zstd cost more than it saves
on weights, ~25 % of the bytes at 2-4x the write and read time; files closed, not fsynced:
``_no_fsync_handlers``) and renames it into place, so a reader sees a whole version or none.
At most ``keep`` versions are on disk, the one being written included (``_prune``). The
manifest's ``files`` table and ``digest`` (``sync_checks.FILES_SCHEME``) catch damaged or
partly written files; ``manifest_key`` (never written) signs the manifest against an adversary
(``manifest_auth``). A sync root created here is owner-only (``dir_mode``), as is each version
directory (``mkdtemp``).

Multi-process (``jax.process_count() > 1``): every process calls ``write_orbax`` with the same
(global, sharded) tree and a shared ``root``; Orbax writes each process's shards, each process
checksums its own files, and process 0 alone writes the manifest, renames and prunes, between
barriers, so every process returns once the version is published.

Tree names (``flatten_params``) are the ``/``-joined keys of ``nnx.to_pure_dict(nnx.state(model,
nnx.Param))`` (e.g. ``layers/q_proj``); ``bapo_jax.models.weight_map`` ties them to HF tensors.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Shaped

from bapo_jax.models.config import Qwen2Config
from bapo_jax.models.hf import TensorMapping, weight_map
from bapo_jax.rollout.manifest_auth import sign_manifest, verify_manifest
from bapo_jax.rollout.sync_checks import (
    FILES_SCHEME,
    _barrier,
    check_restored,
    file_fields,
    validate_manifest,
    verify_layout,
)
from bapo_jax.rollout.sync_read import Allocate, read_version

__all__ = [
    "DIR_MODE",
    "FILES_SCHEME",
    "FORMAT",
    "MANIFEST",
    "expected_hf_shapes",
    "flatten_params",
    "hf_layout",
    "hf_layout_name",
    "list_versions",
    "read_manifest",
    "restore_orbax",
    "unflatten_params",
    "validate_manifest",
    "version_dir",
    "wait_pruned",
    "write_arrays",
    "write_orbax",
]

MANIFEST = "manifest.json"
FORMAT = "bapo-orbax-hf-v1"  # Orbax PyTree in HF layout, stacked over layers
DIR_MODE = 0o700  # a sync root this module creates: only the run's user reads the weights
_VERSION_DIR = re.compile(r"^v(\d{8})$")


def version_dir(root: str | os.PathLike, version: int) -> str:
    return os.path.join(os.fspath(root), f"v{version:08d}")


def list_versions(root: str | os.PathLike) -> list[int]:
    """Complete versions under ``root`` (directories with a manifest), ascending."""
    names = os.listdir(root) if os.path.isdir(root) else []
    return sorted(
        int(m.group(1))
        for name in names
        if (m := _VERSION_DIR.match(name)) and os.path.exists(os.path.join(root, name, MANIFEST))
    )


# ---- trees <-> flat names ----------------------------------------------------------------------
def flatten_params(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dict of arrays -> ``{"layers/q_proj": array, ...}`` (sorted by name)."""
    out: dict[str, Any] = {}
    for key in sorted(tree, key=str):
        value = tree[key]
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_params(value, name + "/"))
        elif value is not None:
            out[name] = value
    return dict(sorted(out.items()))


def unflatten_params(flat: Mapping[str, Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for name, value in flat.items():
        node = tree
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


@functools.lru_cache(maxsize=8)
def _tree_shapes(config: Qwen2Config) -> dict[str, tuple[int, ...]]:
    from flax import nnx

    from bapo_jax.models.qwen2 import abstract_model

    state = nnx.to_pure_dict(nnx.state(abstract_model(config), nnx.Param))
    return {k: tuple(v.shape) for k, v in flatten_params(state).items()}


# ---- HF layout (FORMAT) -----------------------------------------------------------------------
def hf_layout_name(mapping: TensorMapping) -> str:
    """The stored name of an HF tensor: its HF name with ``/`` for ``.`` and, when stacked,
    without the layer index (``model.layers.{i}.mlp.up_proj.weight`` ->
    ``model/layers/mlp/up_proj/weight``, one [L, ...] array of the per-layer HF tensors)."""
    return mapping.hf_name.replace(".{i}", "").replace(".", "/")


@functools.lru_cache(maxsize=8)
def _hf_programs(config: Qwen2Config, dtype: str | None) -> dict[str, tuple[str, Callable]]:
    """Stored name -> (tree name, jitted layout change + cast), one program per tensor: XLA
    runs them concurrently (faster than one program of all of them: docs/rollout.md)."""

    def program(m: TensorMapping) -> Callable:
        to_hf = jax.vmap(m.to_hf) if m.stacked else m.to_hf
        return jax.jit(lambda x: to_hf(x) if dtype is None else to_hf(x).astype(dtype))

    return {hf_layout_name(m): ("/".join(m.path), program(m)) for m in weight_map(config)}


def hf_layout(
    flat: Mapping[str, Shaped[Array, "*dims"]], config: Qwen2Config, dtype: Any = jnp.bfloat16
) -> dict[str, Shaped[Array, "*dims"]]:
    """Flat tree-layout params -> ``{hf_layout_name: array}`` in HF layout (each stacked
    parameter becomes [L, *HF tensor shape]), cast to ``dtype`` (None: keep), by programs on
    the params' devices (any sharding; every process calls it with a multi-process tree).
    Raises ValueError naming a missing, unexpected or wrongly shaped parameter."""
    want = _tree_shapes(config)
    got = {k: tuple(v.shape) for k, v in flat.items()}
    wrong = sorted(f"{k}: {got[k]} != {want[k]}" for k in set(got) & set(want) if got[k] != want[k])
    if set(got) != set(want) or wrong:
        raise ValueError(
            f"params do not match the config: missing {sorted(set(want) - set(got))}, "
            f"unexpected {sorted(set(got) - set(want))}, wrong shapes {wrong}"
        )
    programs = _hf_programs(config, None if dtype is None else jnp.dtype(dtype).name)
    return {name: fn(flat[path]) for name, (path, fn) in programs.items()}


def expected_hf_shapes(config: Qwen2Config) -> dict[str, tuple[int, ...]]:
    """Stored name -> shape of a ``FORMAT`` checkpoint for ``config`` (no memory allocated)."""
    tree = {k: jax.ShapeDtypeStruct(v, jnp.float32) for k, v in _tree_shapes(config).items()}
    programs = _hf_programs(config, None)
    return {k: tuple(jax.eval_shape(fn, tree[p]).shape) for k, (p, fn) in programs.items()}


def checkpoint_bytes(config: Qwen2Config, dtype: Any = jnp.bfloat16) -> int:
    """Bytes of the arrays of one ``FORMAT`` checkpoint of ``config`` stored as ``dtype``."""
    shapes = expected_hf_shapes(config).values()
    return sum(math.prod(s) for s in shapes) * jnp.dtype(dtype).itemsize


# ---- Orbax without fsync ----------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _no_fsync_handlers() -> Any:
    """A type-handler registry whose jax.Array handler writes with TensorStore's
    ``file_io_sync`` off. A version is read once, from the page cache or a shared filesystem
    (close() flushes to it), and refused if a byte differs from its hashes; surviving power loss
    buys nothing (a restarted run publishes its start version again), and the fsync was most
    of the save's time (``python -m benchmarks.weight_sync``)."""
    import copy

    import orbax.checkpoint as ocp
    import tensorstore as ts

    spec = {
        "file_io_concurrency": {"limit": 128},
        "file_io_sync": False,
        "cache_pool#ocdbt": {"total_bytes_limit": 100_000_000},
    }

    class NoFsyncArrayHandler(ocp.type_handlers.ArrayHandler):
        async def serialize(self, values, infos, args=None):
            infos = [copy.copy(info) for info in infos]
            for info in infos:
                info.ts_context = ts.Context(spec)
            return await super().serialize(values, infos, args)

    return ocp.type_handlers.create_type_handler_registry((jax.Array, NoFsyncArrayHandler()))


# ---- writing -----------------------------------------------------------------------------------
def _check_version(version: int, step: int) -> None:
    for name, value in (("version", version), ("step", step)):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 10**8:
            raise ValueError(f"{name} must be an int in [0, 1e8), got {value!r}")


def _publish(tmp: str, final: str) -> None:
    """Atomically move the finished ``tmp`` directory to ``final`` (replacing an old one)."""
    if os.path.exists(final):
        old = tempfile.mkdtemp(prefix=".old-", dir=os.path.dirname(final))
        os.rename(final, os.path.join(old, "x"))
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


_DELETER = ThreadPoolExecutor(1, thread_name_prefix="bapo-sync-prune")


def _prune(root: str, keep: int) -> None:
    """Drop all but the newest ``keep`` versions: each is renamed out of sight at once (a
    reader sees it whole or not at all) and deleted in the background; ``wait_pruned`` waits
    for the deletions. ``_write_version`` prunes to ``keep - 1`` before it writes (never the
    newest) and waits for that deletion, so the disk holds at most ``keep`` versions, the one
    being written included, and the new files reuse the page-cache memory the deleted ones
    free (docs/rollout.md: a write into fresh pages costs about twice as much here), and to
    ``keep`` after it publishes."""
    for v in list_versions(root)[:-keep]:
        trash = tempfile.mkdtemp(prefix=f".pruned-v{v:08d}-", dir=root)
        os.rename(version_dir(root, v), os.path.join(trash, "x"))
        _DELETER.submit(shutil.rmtree, trash, True)


def wait_pruned() -> None:
    """Wait until every version pruned so far is deleted."""
    _DELETER.submit(lambda: None).result()


def _write_version(
    root: str | os.PathLike,
    version: int,
    step: int,
    keep: int,
    fill: Callable[[str], dict[str, Any]],
    dir_mode: int = DIR_MODE,
) -> str:
    """Atomically publishes version ``version`` under ``root``: ``fill(tmp)`` writes the files
    into a temp dir and returns the manifest; then manifest, rename, prune to ``keep``. With
    several processes, all of them call it: ``fill`` runs everywhere (it may be collective),
    the directory bookkeeping on process 0 only, between barriers. A ``root`` created here
    gets exactly ``dir_mode``; an existing one keeps its mode."""
    _check_version(version, step)
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    root = os.path.abspath(os.fspath(root))
    multi, primary = jax.process_count() > 1, jax.process_index() == 0
    tag = f"bapo-weight-sync-v{version}"
    if primary:
        with contextlib.suppress(FileExistsError):
            os.makedirs(root, mode=dir_mode)
            os.chmod(root, dir_mode)  # the mode asked for, whatever the umask
        if keep > 1:  # room for the new one: keep - 1 old
            _prune(root, keep - 1)
            wait_pruned()  # its page-cache memory free before the new files take theirs
    if multi:  # every process must name the same directory
        tmp = os.path.join(root, f".v{version:08d}.tmp-multiprocess")
        if primary:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed run
            os.makedirs(tmp, mode=0o700)
        _barrier(tag + "-mkdir")
    else:
        tmp = tempfile.mkdtemp(prefix=f".v{version:08d}.tmp-", dir=root)
    final = version_dir(root, version)
    try:
        manifest = fill(tmp)
        _barrier(tag + "-written")
        if primary:
            with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
                f.write("\n")
            _publish(tmp, final)
    except BaseException:
        if primary:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if primary:
        _prune(root, keep)
    _barrier(tag + "-published")
    return final


def write_orbax(
    params: Mapping[str, Any],
    root: str | os.PathLike,
    *,
    version: int,
    step: int,
    config: Qwen2Config,
    dtype: Any = jnp.bfloat16,
    keep: int = 3,
    timings: dict[str, float] | None = None,
    manifest_key: bytes | None = None,
    dir_mode: int = DIR_MODE,
) -> str:
    """Write ``params`` (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``, possibly sharded) as
    version ``version``; returns the version directory. HF layout + ``dtype`` cast (None: keep)
    on the params' devices (``hf_layout``; the tree must match ``config``), then
    ``write_arrays``. ``timings`` receives ``cast_s``, ``save_s`` and ``checksum_s``."""
    timings = {} if timings is None else timings
    t0 = time.perf_counter()
    flat = jax.block_until_ready(hf_layout(flatten_params(params), config, dtype))
    timings["cast_s"] = time.perf_counter() - t0
    return write_arrays(
        flat, root, version=version, step=step, config=config, keep=keep, timings=timings,
        manifest_key=manifest_key, dir_mode=dir_mode,
    )  # fmt: skip


def write_arrays(
    flat: Mapping[str, Shaped[Array, "*dims"]],
    root: str | os.PathLike,
    *,
    version: int,
    step: int,
    config: Qwen2Config,
    keep: int = 3,
    timings: dict[str, float] | None = None,
    manifest_key: bytes | None = None,
    dir_mode: int = DIR_MODE,
) -> str:
    """Publish ``{stored name: jax array}`` (already in HF layout and the dtype to store) as
    version ``version``: Orbax OCDBT without fsync, the file hashes (``FILES_SCHEME``), the
    manifest, signed with ``manifest_key`` (None: unsigned; module doc; with several processes
    process 0's, which writes the manifest). Unchecked here (the readers check:
    ``validate_manifest``), so a test can publish a broken version. A ``root`` created here
    gets ``dir_mode``. ``timings`` receives ``save_s`` and ``checksum_s``."""
    import orbax.checkpoint as ocp

    timings = {} if timings is None else timings
    start = time.perf_counter()  # the pruning before the write included
    dtypes = {jnp.dtype(v.dtype).name for v in flat.values()}

    def fill(tmp: str) -> dict[str, Any]:
        handler = ocp.PyTreeCheckpointHandler(  # uncompressed (module doc)
            use_compression=False, type_handler_registry=_no_fsync_handlers()
        )
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(
                os.path.join(tmp, "params"), args=ocp.args.PyTreeSave(unflatten_params(flat))
            )
        saved = time.perf_counter()
        files = file_fields(tmp)
        timings.update(save_s=saved - start, checksum_s=time.perf_counter() - saved)
        manifest = {
            "format": FORMAT,
            "version": version,
            "step": step,
            "dtype": next(iter(dtypes)) if len(dtypes) == 1 else None,
            "config": config.to_hf_dict(),
            "params": {
                k: {"shape": list(v.shape), "dtype": jnp.dtype(v.dtype).name}
                for k, v in flat.items()
            },
            **files,
        }
        return sign_manifest(manifest, manifest_key)

    return _write_version(root, version, step, keep, fill, dir_mode)


# ---- reading -----------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    file = os.path.join(os.fspath(path), MANIFEST)
    if not os.path.exists(file):
        raise FileNotFoundError(f"no {MANIFEST} in {os.fspath(path)} (not a synced version)")
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def restore_orbax(
    path: str | os.PathLike,
    *,
    timings: dict[str, float] | None = None,
    manifest_key: bytes | None = None,
    allocate: Allocate | None = None,
    drop_cache: bool = False,
) -> dict[str, np.ndarray]:
    """Restore a version written by ``write_orbax`` as flat host numpy arrays (any device
    layout the trainer had is ignored). Every check passes before the arrays are returned:
    with ``manifest_key``, the manifest's HMAC (``manifest_auth``; None: unsigned accepted),
    the files' names and sizes against the manifest's table, then one pass per file that
    hashes it and copies its arrays out of the page cache (``sync_read``: into buffers from
    ``allocate``, default new arrays; ``drop_cache`` drops each file's cached pages after),
    then names, shapes and dtypes. ``timings`` (if given) receives ``verify_s`` (the hashing's
    share) and ``read_s`` (the whole pass)."""
    path = os.fspath(path)
    manifest = read_manifest(path)
    verify_manifest(path, manifest, manifest_key)  # before any of it is trusted
    verify_layout(path, manifest)  # names and sizes, before anything maps a file
    flat, spent = read_version(path, manifest, allocate=allocate, drop_cache=drop_cache)
    check_restored(path, manifest, flat)  # names, shapes, dtypes
    if timings is not None:
        timings.update(spent)
    return flat
