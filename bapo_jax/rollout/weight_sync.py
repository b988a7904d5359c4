"""Policy weights from the trainer to the rollout servers, one directory per version.

Orbax mode (default). ``write_orbax(params, root, version=v, step=s)`` writes

    root/v00000007/params/       params-only Orbax PyTree checkpoint (bf16 by default)
    root/v00000007/manifest.json {format, version, step, dtype, config, params: {name: {shape,
                                  dtype}}, digest}

into a temp directory beside it and renames it into place, so a reader sees a whole version
or none. Only the last ``keep`` versions stay on disk (the newest is never removed).

Digest (``digest_arrays``, scheme ``DIGEST_SCHEME``). For each parameter, two 32-bit lane sums

    lane_0 = sum over elements e of h_e,  lane_1 = sum over e of fmix32(h_e ^ S)  (mod 2^32),
    h_e    = fmix32(bits(e) * K + pos(e)),   pos(e) = fmix32(seed(name) + horner_g(coords(e))),

where ``bits(e)`` is the element's raw bit pattern, ``horner_g`` folds its coordinates with
the odd multiplier g (((c_0 g + c_1) g + c_2) g ...), K, S and g are fixed odd constants and
fmix32 is MurmurHash3's finalizer (for a fixed position, h_e is a bijection of the bits). The
manifest's ``digest`` is blake2b-128 over, in name order, each parameter's name, shape, dtype
and lanes. A sum of per-element terms does not depend on how the array is split: it is
computed where the array lives, by jit, with each process summing its addressable shards and
XLA's all-reduce combining them (integer sums are exact in any order), so a multi-process
trainer digests its sharded parameters without gathering them to a host, and the vLLM worker
gets the same digest from its full host copy, which it recomputes after restoring, refusing a
mismatch. It guards against corrupt or partly written files (a random change survives with
probability ~2^-64), not against an adversary.
Manifests from before the scheme (no ``digest_scheme``) carry blake2b over the raw bytes.

Multi-process (``jax.process_count() > 1``). ``write_orbax`` is called by every process with
the same (global, sharded) tree; ``root`` must be one shared filesystem path. The processes
agree on the temp directory (named by version), Orbax writes each process's shards, the digest
is computed collectively, and process 0 alone writes the manifest, renames the directory into
place and prunes, between barriers, so every process returns once the version is published.
``write_safetensors`` stays single-process (``save_pretrained`` reads every tensor on one host)
and says so.

Safetensors mode. ``write_safetensors(model, root, version=v)`` writes an HF checkpoint
(``bapo_jax.models.save_pretrained``) plus the same manifest, which vLLM reloads with its
built-in ``reload_weights``.

Parameter names are the ``/``-joined keys of ``nnx.to_pure_dict(nnx.state(model, nnx.Param))``
(e.g. ``layers/q_proj``); ``bapo_jax.models.weight_map`` ties them to HF tensors.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from bapo_jax.models.config import Qwen2Config

__all__ = [
    "DIGEST_SCHEME",
    "MANIFEST",
    "ORBAX_FORMAT",
    "SAFETENSORS_FORMAT",
    "digest_arrays",
    "expected_param_shapes",
    "flatten_params",
    "list_versions",
    "read_manifest",
    "restore_orbax",
    "unflatten_params",
    "validate_manifest",
    "version_dir",
    "write_orbax",
    "write_safetensors",
]

MANIFEST = "manifest.json"
ORBAX_FORMAT = "bapo-orbax-params-v1"
SAFETENSORS_FORMAT = "bapo-safetensors-v1"
DIGEST_SCHEME = "bapo-lanesum32x2-v1"
_VERSION_DIR = re.compile(r"^v(\d{8})$")


def version_dir(root: str | os.PathLike, version: int) -> str:
    return os.path.join(os.fspath(root), f"v{version:08d}")


def list_versions(root: str | os.PathLike) -> list[int]:
    """Complete versions under ``root`` (directories with a manifest), ascending."""
    root = os.fspath(root)
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _VERSION_DIR.match(name)
        if m and os.path.exists(os.path.join(root, name, MANIFEST)):
            out.append(int(m.group(1)))
    return sorted(out)


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


def expected_param_shapes(config: Qwen2Config) -> dict[str, tuple[int, ...]]:
    """Parameter name -> shape of the NNX tree for ``config`` (no memory allocated)."""
    from flax import nnx

    from bapo_jax.models.qwen2 import abstract_model

    state = nnx.to_pure_dict(nnx.state(abstract_model(config), nnx.Param))
    return {k: tuple(v.shape) for k, v in flatten_params(state).items()}


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


def _prune(root: str, keep: int) -> None:
    versions = list_versions(root)
    for v in versions[:-keep]:
        shutil.rmtree(version_dir(root, v), ignore_errors=True)


def _write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    with open(os.path.join(directory, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def _write_version(
    root: str | os.PathLike,
    version: int,
    step: int,
    keep: int,
    fill: Callable[[str], dict[str, Any]],
) -> str:
    """Atomically publishes version ``version`` under ``root``: ``fill(tmp)`` writes the files
    into a temp dir and returns the manifest; then manifest, rename, prune to ``keep``. With
    several processes, all of them call it: ``fill`` runs everywhere (it may be collective),
    the directory bookkeeping on process 0 only, between barriers."""
    _check_version(version, step)
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1, got {keep!r}")
    root = os.path.abspath(os.fspath(root))
    multi, primary = jax.process_count() > 1, jax.process_index() == 0
    tag = f"bapo-weight-sync-v{version}"
    if multi:  # every process must name the same directory
        tmp = os.path.join(root, f".v{version:08d}.tmp-multiprocess")
        if primary:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed run
            os.makedirs(tmp)
        _barrier(tag + "-mkdir")
    else:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".v{version:08d}.tmp-", dir=root)
    final = version_dir(root, version)
    try:
        manifest = fill(tmp)
        _barrier(tag + "-written")
        if primary:
            _write_manifest(tmp, manifest)
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
    compress: bool = False,
) -> str:
    """Write ``params`` (``nnx.to_pure_dict(nnx.state(model, nnx.Param))``, possibly sharded) as
    version ``version``; returns the version directory.

    The tree is cast to ``dtype`` on its devices (None keeps each leaf's dtype) and saved with
    Orbax (OCDBT; zstd compression only with ``compress``: it costs more time than the ~20%
    of bf16 weight bytes it saves on a write-once, read-once sync). Nothing here checks the
    tree against ``config`` (``validate_manifest`` does, on the reading side), so tests can
    write deliberately broken checkpoints.
    """
    import orbax.checkpoint as ocp

    flat = flatten_params(params)
    if dtype is not None:
        flat = {k: jnp.asarray(v).astype(dtype) for k, v in flat.items()}

    def fill(tmp: str) -> dict[str, Any]:
        handler = ocp.PyTreeCheckpointHandler(use_compression=compress)
        with ocp.Checkpointer(handler) as ckptr:
            ckptr.save(
                os.path.join(tmp, "params"), args=ocp.args.PyTreeSave(unflatten_params(flat))
            )
        return {
            "format": ORBAX_FORMAT,
            "version": version,
            "step": step,
            "dtype": None if dtype is None else jnp.dtype(dtype).name,
            "config": config.to_hf_dict(),
            "params": {
                k: {"shape": list(v.shape), "dtype": jnp.dtype(v.dtype).name}
                for k, v in flat.items()
            },
            "digest": digest_arrays(flat),
            "digest_scheme": DIGEST_SCHEME,
        }

    return _write_version(root, version, step, keep, fill)


def write_safetensors(
    model: Any,
    root: str | os.PathLike,
    *,
    version: int,
    step: int,
    dtype: Any = jnp.bfloat16,
    keep: int = 3,
) -> str:
    """Write ``model`` as an HF safetensors checkpoint (the alternative sync mode)."""
    from flax import nnx

    from bapo_jax.models.hf import save_pretrained

    def fill(tmp: str) -> dict[str, Any]:
        save_pretrained(model, os.path.join(tmp, "hf"), dtype=dtype)
        flat = flatten_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
        out_dtype = jnp.dtype(dtype) if dtype is not None else None
        return {
            "format": SAFETENSORS_FORMAT,
            "version": version,
            "step": step,
            "dtype": None if out_dtype is None else out_dtype.name,
            "config": model.config.to_hf_dict(),
            "params": {
                k: {"shape": list(v.shape), "dtype": (out_dtype or jnp.dtype(v.dtype)).name}
                for k, v in flat.items()
            },
            "digest": None,  # safetensors files carry no digest here; vLLM reads them as-is
        }

    return _write_version(root, version, step, keep, fill)


# ---- reading -----------------------------------------------------------------------------------
def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    file = os.path.join(os.fspath(path), MANIFEST)
    if not os.path.exists(file):
        raise FileNotFoundError(f"no {MANIFEST} in {os.fspath(path)} (not a synced version)")
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def validate_manifest(
    manifest: Mapping[str, Any],
    config: Qwen2Config | None = None,
    *,
    version: int | None = None,
) -> Qwen2Config:
    """Check a manifest before any tensor is loaded; returns its config.

    Refuses (ValueError naming the problem) a wrong format or version, a config different from
    ``config``, and any missing, unexpected or wrongly shaped parameter.
    """
    fmt = manifest.get("format")
    if fmt not in (ORBAX_FORMAT, SAFETENSORS_FORMAT):
        raise ValueError(
            f"manifest format must be {ORBAX_FORMAT!r} or {SAFETENSORS_FORMAT!r}, got {fmt!r}"
        )
    if version is not None and manifest.get("version") != version:
        raise ValueError(f"manifest version is {manifest.get('version')!r}, expected {version}")
    own = Qwen2Config.from_hf(manifest["config"])
    if config is not None and own != config:
        raise ValueError(f"manifest config {own} differs from the served model's {config}")
    expected = expected_param_shapes(own)
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


def restore_orbax(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Restore a version written by ``write_orbax`` as flat host numpy arrays (any device
    layout the trainer had is ignored), checking shapes, dtypes and digest against the
    manifest."""
    import orbax.checkpoint as ocp

    path = os.fspath(path)
    manifest = read_manifest(path)
    params_dir = os.path.join(path, "params")
    with ocp.PyTreeCheckpointer() as ckptr:
        meta = ckptr.metadata(params_dir)
        tree_meta = meta.item_metadata if hasattr(meta, "item_metadata") else meta
        tree_meta = getattr(tree_meta, "tree", tree_meta)
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree_meta)
        tree = ckptr.restore(params_dir, args=ocp.args.PyTreeRestore(restore_args=restore_args))
    flat = {k: np.asarray(v) for k, v in flatten_params(tree).items()}
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
    want_digest = manifest.get("digest")
    if want_digest is not None:
        scheme = manifest.get("digest_scheme")
        if scheme not in (None, DIGEST_SCHEME):
            raise ValueError(
                f"{path}: unknown digest_scheme {scheme!r} (this reader knows {DIGEST_SCHEME!r})"
            )
        got = digest_arrays(flat) if scheme == DIGEST_SCHEME else _digest_bytes_v0(flat)
        if got != want_digest:
            raise ValueError(f"{path}: digest mismatch (corrupt or partially written checkpoint)")
    return flat
