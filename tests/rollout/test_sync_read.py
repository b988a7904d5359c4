"""The direct reader of synced versions (``sync_read``): arrays of one chunk, of many (a
sharded write: one chunk per shard) and inline ones, against what was written; buffers from
the caller; a damaged data file refused naming it; a layout it does not copy refused."""

from __future__ import annotations

import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bapo_jax.models import PRESETS
from bapo_jax.rollout import sync_read
from bapo_jax.rollout import weight_sync as ws

CONFIG = PRESETS["tiny"]


def _values() -> dict[str, np.ndarray]:
    shapes = ws.expected_hf_shapes(CONFIG)
    rng = np.random.default_rng(0)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}


def _write(root, values, mesh=None, dim=0) -> str:
    flat = {}
    for k, v in values.items():
        array = jnp.asarray(v)
        if mesh is not None and v.ndim > dim and v.shape[dim] % 8 == 0:  # 8 chunks: a shard each
            spec = P(*([None] * dim), "x", *([None] * (v.ndim - dim - 1)))
            array = jax.device_put(array, NamedSharding(mesh, spec))
        flat[k] = array.astype(jnp.bfloat16)
    return ws.write_arrays(flat, root, version=1, step=1, config=CONFIG)


# dim 0: each shard's chunk is one run of its array's bytes (copied a segment at a time);
# dim 1: a shard cut along an inner dimension (copied whole, after the file's hash pass)
@pytest.mark.parametrize("dim", [None, 0, 1], ids=["one-chunk", "rows", "inner"])
@pytest.mark.parametrize("drop_cache", [False, True])
def test_reads_what_was_written(tmp_path, dim, drop_cache):
    mesh = jax.make_mesh((8,), ("x",)) if dim is not None else None
    values = _values()
    path = _write(tmp_path, values, mesh, dim or 0)
    arrays = sync_read._locate(os.path.join(path, "params"))
    chunks = {k.replace(".", "/"): len(a.inline) + len(a.stored) for k, a in arrays.items()}
    if dim is not None:  # the sharded arrays are stored as 8 chunks, the others as one
        split = [k for k, v in values.items() if v.ndim > dim and v.shape[dim] % 8 == 0]
        assert split and {chunks[k] for k in split} == {8}
    assert any(a.inline for a in arrays.values())  # small chunks live in the index itself
    assert any(a.stored for a in arrays.values())
    got, timings = sync_read.read_version(path, ws.read_manifest(path), drop_cache=drop_cache)
    want = {k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16)) for k, v in values.items()}
    chex.assert_trees_all_equal(got, want)
    assert timings["read_s"] >= timings["verify_s"] >= 0


def test_buffers_from_the_caller_and_dropped_cache(tmp_path):
    values = _values()
    path = _write(tmp_path, values)
    total = sum(v.size * 2 for v in values.values())
    block = np.zeros(total, np.uint8)
    used: list[str] = []

    def allocate(name, shape, dtype):  # views of one block, as a node's shared buffer
        start = sum(values[n].size * 2 for n in used)
        used.append(name)
        return (
            block[start : start + int(np.prod(shape)) * dtype.itemsize].view(dtype).reshape(shape)
        )

    got, _ = sync_read.read_version(
        path, ws.read_manifest(path), allocate=allocate, drop_cache=True
    )
    assert sorted(used) == sorted(values)
    for name, array in got.items():
        assert np.shares_memory(array, block)
        np.testing.assert_array_equal(
            array, np.asarray(jnp.asarray(values[name]).astype(jnp.bfloat16))
        )


def test_a_damaged_data_file_is_refused_naming_it(tmp_path):
    path = _write(tmp_path, _values())
    manifest = ws.read_manifest(path)
    rel = max(manifest["files"], key=lambda r: manifest["files"][r]["size"])  # a data file
    with open(os.path.join(path, rel), "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ValueError, match=f"{rel} damaged: xxh3 mismatch in segment"):
        sync_read.read_version(path, manifest)


def test_a_compressed_array_is_refused_naming_the_field():
    raw = json.dumps(
        {"zarr_format": 2, "compressor": {"id": "zstd"}, "filters": None, "order": "C",
         "shape": [4], "chunks": [4], "dtype": "<f4"}
    ).encode()  # fmt: skip
    with pytest.raises(ValueError, match=r"'w': compressor=\{'id': 'zstd'\}, this reader needs"):
        sync_read._zarray("w", raw)
    assert sync_read._location("value:ocdbt.process_1/:d/ab12:4096:77") == (
        "ocdbt.process_1/d/ab12",
        4096,
        77,
    )


@pytest.mark.parametrize("dim", [None, 1], ids=["one-chunk", "inner"])
def test_files_of_many_segments(tmp_path, dim):
    """4 KiB segments: every data file spans many, each chunk is copied segment by segment
    (or whole, for a shard cut along an inner dimension), each segment's pages dropped."""
    from bapo_jax.rollout import sync_checks

    values = _values()
    path = _write(tmp_path, values, jax.make_mesh((8,), ("x",)) if dim else None, dim or 0)
    manifest = ws.read_manifest(path)
    manifest["files"] = sync_checks._checksum_files(path, manifest["files"], 4096)
    manifest["segment_bytes"] = 4096
    assert max(len(e["xxh3"]) for e in manifest["files"].values()) > 10
    got, _ = sync_read.read_version(path, manifest, drop_cache=True)
    want = {k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16)) for k, v in values.items()}
    chex.assert_trees_all_equal(got, want)


def test_a_scalar_beside_a_sharded_array(tmp_path):
    """A 0-d array (its one chunk's zarr key is "0") beside an array of one chunk per shard."""
    mesh = jax.make_mesh((8,), ("x",))
    values = {"scale": np.float32(1.5), "w": np.arange(8 * 5, dtype=np.float32).reshape(8, 5)}
    flat = {
        "scale": jnp.asarray(values["scale"]),
        "w": jax.device_put(jnp.asarray(values["w"]), NamedSharding(mesh, P("x", None))),
    }
    path = ws.write_arrays(flat, tmp_path, version=1, step=1, config=CONFIG)
    got, _ = sync_read.read_version(path, ws.read_manifest(path))
    assert got["scale"].shape == () and float(got["scale"]) == 1.5
    np.testing.assert_array_equal(got["w"], values["w"])
