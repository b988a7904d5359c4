"""Orbax / safetensors weight-sync format: round trip (HF and tree layouts), bf16 default,
atomicity, keep-K, manifest validation, the file checksums (a truncated, damaged, missing or
extra file is refused before Orbax reads it), the value digest (against a numpy reference,
under any sharding, from two processes), and the worker's HF mapping (without vLLM)."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import time
import zlib

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xxhash
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bapo_jax.models import PRESETS, init_model, iter_hf_tensors, load_pretrained
from bapo_jax.rollout import sync_checks
from bapo_jax.rollout import weight_sync as ws
from bapo_jax.rollout.vllm_worker import hf_tensors_from_flat, hf_tensors_from_hf_layout
from tests.child_env import child_env

CONFIG = PRESETS["tiny"]
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=1)


def _params(model):
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _params_files(path) -> list[str]:
    return sorted(
        os.path.relpath(os.path.join(d, f), path)
        for d, _, fs in os.walk(os.path.join(path, "params"))
        for f in fs
    )


def test_orbax_round_trip_fp32_and_manifest(model, tmp_path):
    written = {}
    path = ws.write_orbax(
        _params(model),
        tmp_path,
        version=3,
        step=30,
        config=CONFIG,
        dtype=None,
        value_digest=True,
        layout="tree",
        timings=written,
    )
    assert path == ws.version_dir(tmp_path, 3)
    assert set(written) == {"cast_s", "save_s", "checksum_s"} and min(written.values()) >= 0
    manifest = ws.read_manifest(path)
    assert (manifest["version"], manifest["step"], manifest["format"]) == (3, 30, ws.ORBAX_FORMAT)
    assert ws.validate_manifest(manifest, CONFIG, version=3) == CONFIG
    timings = {}
    flat = ws.restore_orbax(path, timings=timings)
    assert set(timings) == {"verify_s", "read_s"} and min(timings.values()) >= 0
    want = ws.flatten_params(_params(model))
    assert sorted(flat) == sorted(want) == sorted(manifest["params"])
    chex.assert_trees_all_equal(flat, {k: np.asarray(v) for k, v in want.items()})
    # the file table covers every file Orbax wrote, with the XXH3-64 of each segment
    assert manifest["digest_scheme"] == ws.FILES_SCHEME
    assert sorted(manifest["files"]) == _params_files(path)
    for rel, entry in manifest["files"].items():
        with open(os.path.join(path, rel), "rb") as f:
            data = f.read()
        seg = manifest["segment_bytes"]
        assert entry["size"] == len(data)
        hashes = [xxhash.xxh3_64_intdigest(data[i : i + seg]) for i in range(0, len(data), seg)]
        assert entry["xxh3"] == hashes
    assert manifest["value_digest"] == ws.digest_arrays(flat) == ws.digest_arrays(want)
    assert manifest["value_digest_scheme"] == ws.DIGEST_SCHEME


@pytest.mark.parametrize(
    "scheme, key, reference",
    [
        (sync_checks.FILES_SCHEME, "xxh3", xxhash.xxh3_64_intdigest),
        (sync_checks.FILES_CRC32_SCHEME, "crc32", zlib.crc32),
    ],
)
def test_checksums_per_segment_match_the_libraries(tmp_path, scheme, key, reference):
    # 3 MiB: the 1 MiB read pieces of a 2 MiB segment are hashed as one stream
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    table = sync_checks._checksum_files(str(tmp_path), ["a", "empty"], 2 << 20, scheme)
    assert table == {
        "a": {"size": 3 << 20, key: [reference(data[: 2 << 20]), reference(data[2 << 20 :])]},
        "empty": {"size": 0, key: []},
    }


def test_a_segment_size_that_cannot_be_mapped_is_refused(model, tmp_path):
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG)
    manifest = ws.read_manifest(path)
    manifest["segment_bytes"] = 1000
    with open(os.path.join(path, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match=r"segment_bytes=1000 \(want a table and a positive mult"):
        ws.restore_orbax(path)


def test_a_crc32_manifest_of_an_older_writer_is_still_checked(model, tmp_path):
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG)
    manifest = ws.read_manifest(path)
    old = sync_checks.FILES_CRC32_SCHEME
    table = sync_checks._checksum_files(path, manifest["files"], manifest["segment_bytes"], old)
    digest = sync_checks._table_digest(table, manifest["segment_bytes"], old)
    manifest.update(files=table, digest_scheme=old, digest=digest)
    with open(os.path.join(path, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    chex.assert_trees_all_equal(ws.restore_orbax(path), ws.restore_orbax(path))
    _damage(path, "flipped")
    with pytest.raises(ValueError, match=r"damaged: crc32 mismatch in segment\(s\) \[0\]"):
        ws.restore_orbax(path)


def _damage(path, how: str) -> None:
    files = [os.path.join(path, f) for f in _params_files(path)]
    largest = max(files, key=os.path.getsize)
    if how == "truncated":
        with open(largest, "r+b") as f:
            f.truncate(os.path.getsize(largest) // 2)
    elif how == "flipped":  # one bit in the middle of the data: same size
        with open(largest, "r+b") as f:
            f.seek(os.path.getsize(largest) // 2)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x10]))
    elif how == "missing":
        os.remove(largest)
    elif how == "extra":
        with open(os.path.join(path, "params", "stray"), "wb") as f:
            f.write(b"x")
    elif how == "table":  # the manifest's own table altered
        manifest = ws.read_manifest(path)
        entry = manifest["files"][os.path.relpath(largest, path)]
        entry["xxh3"][0] ^= 1
        with open(os.path.join(path, ws.MANIFEST), "w") as f:
            json.dump(manifest, f)


@pytest.mark.parametrize(
    "how,pattern",
    [
        ("truncated", r"has \d+ bytes, the manifest says \d+ \(truncated"),
        ("flipped", r"damaged: xxh3 mismatch in segment\(s\) \[0\]"),
        ("missing", r"files missing \['params/.+'\], unexpected \[\]"),
        ("extra", r"files missing \[\], unexpected \['params/stray'\]"),
        ("table", r"digest mismatch \(the manifest's file table is damaged\)"),
    ],
)
def test_damaged_checkpoint_is_refused_before_reading(model, tmp_path, how, pattern):
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG)
    ws.restore_orbax(path)  # intact: restores
    _damage(path, how)
    with pytest.raises(ValueError, match=pattern):
        ws.restore_orbax(path)


def test_bf16_default_and_keep_last_k(model, tmp_path):
    for v in range(5):
        ws.write_orbax(_params(model), tmp_path, version=v, step=v, config=CONFIG, keep=2)
    assert ws.list_versions(tmp_path) == [3, 4]
    ws.wait_pruned()  # the pruned versions are deleted in the background
    assert sorted(os.listdir(tmp_path)) == ["v00000003", "v00000004"]  # no temp dirs left
    flat = ws.restore_orbax(ws.version_dir(tmp_path, 4))
    assert {a.dtype.name for a in flat.values()} == {"bfloat16"}
    assert ws.read_manifest(ws.version_dir(tmp_path, 4))["format"] == ws.ORBAX_HF_FORMAT
    want = dict(iter_hf_tensors(model, dtype=jnp.bfloat16))["model.layers.1.mlp.up_proj.weight"]
    np.testing.assert_array_equal(flat["model/layers/mlp/up_proj/weight"][1], want)


@pytest.mark.parametrize("keep, during", [(3, [2, 3]), (2, [3]), (1, [1, 2, 3])])
def test_a_write_makes_room_first_and_never_removes_the_newest(model, tmp_path, keep, during):
    for v in range(4):
        ws.write_orbax(_params(model), tmp_path, version=v, step=v, config=CONFIG, keep=3)
    seen = []

    def fill(tmp):  # what a reader sees while version 4 is being written
        seen.extend(ws.list_versions(tmp_path))
        return {"format": ws.ORBAX_HF_FORMAT, "version": 4}

    ws._write_version(tmp_path, 4, 4, keep, fill)
    assert seen == during
    assert ws.list_versions(tmp_path) == [4, 3, 2][:keep][::-1]


def test_digest_mismatch_is_refused(model, tmp_path):
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG)
    manifest = ws.read_manifest(path)
    manifest["digest"] = "f" * 32
    with open(os.path.join(path, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match="digest mismatch"):
        ws.restore_orbax(path)


@pytest.mark.parametrize("fault", ["missing", "shape", "unexpected"])
def test_manifest_validation_names_the_problem(model, tmp_path, fault):
    flat = ws.flatten_params(_params(model))
    if fault == "missing":
        flat.pop("layers/k_bias")
        pattern = r"missing parameters \['layers/k_bias'\]"
    elif fault == "shape":
        flat["norm"] = flat["norm"][:-1]
        pattern = r"wrong shapes \['norm: \(63,\) != expected \(64,\)'\]"
    else:
        flat["extra"] = flat["norm"]
        pattern = r"unexpected \['extra'\]"
    path = ws.write_orbax(
        ws.unflatten_params(flat), tmp_path, version=1, step=1, config=CONFIG, layout="tree"
    )
    with pytest.raises(ValueError, match=pattern):
        ws.validate_manifest(ws.read_manifest(path), CONFIG)
    with pytest.raises(ValueError, match="params do not match the config"):
        ws.write_orbax(ws.unflatten_params(flat), tmp_path, version=2, step=2, config=CONFIG)


def test_manifest_config_and_version_checked(model, tmp_path):
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG)
    with pytest.raises(ValueError, match="manifest version is 1, expected 2"):
        ws.validate_manifest(ws.read_manifest(path), CONFIG, version=2)
    with pytest.raises(ValueError, match="differs from the served model"):
        ws.validate_manifest(ws.read_manifest(path), PRESETS["tiny-tied"])
    with pytest.raises(ValueError, match="version must be an int in"):
        ws.write_orbax(_params(model), tmp_path, version=-1, step=0, config=CONFIG)


def test_worker_hf_mapping_equals_save_pretrained_layout(model):
    """What the worker feeds vLLM equals what save_pretrained writes (same names, layout)."""
    flat = {k: np.asarray(v) for k, v in ws.flatten_params(_params(model)).items()}
    fed = dict(t for group in hf_tensors_from_flat(flat, CONFIG) for t in group)
    written = dict(iter_hf_tensors(model))
    assert sorted(fed) == sorted(written)
    chex.assert_trees_all_equal(fed, written)


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied"])
def test_hf_layout_checkpoint_holds_what_save_pretrained_writes(tmp_path, preset):
    """The default (HF layout) checkpoint, restored and split per layer as the worker does,
    is bit-equal to save_pretrained's bf16 tensors (same names, shapes, layout), and every
    tensor the worker hands vLLM is contiguous."""
    config = PRESETS[preset]
    model = init_model(config, seed=2)
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=config)
    manifest = ws.read_manifest(path)
    assert manifest["format"] == ws.ORBAX_HF_FORMAT
    assert ws.validate_manifest(manifest, config, version=1) == config
    expected = ws.expected_hf_shapes(config)
    assert {k: tuple(v["shape"]) for k, v in manifest["params"].items()} == expected
    fed = dict(t for g in hf_tensors_from_hf_layout(ws.restore_orbax(path), config) for t in g)
    written = dict(iter_hf_tensors(model, dtype=jnp.bfloat16))
    assert sorted(fed) == sorted(written)
    assert ("lm_head.weight" in fed) == (not config.tie_word_embeddings)
    assert all(a.flags["C_CONTIGUOUS"] for a in fed.values())
    chex.assert_trees_all_equal(fed, written)


def test_hf_layout_keeps_fp32_and_refuses_bad_input(model, tmp_path):
    flat = ws.flatten_params(_params(model))
    out = ws.hf_layout(flat, CONFIG, None)
    assert {jnp.dtype(v.dtype).name for v in out.values()} == {"float32"}
    np.testing.assert_array_equal(
        np.asarray(out["model/layers/self_attn/o_proj/weight"][0]),
        dict(iter_hf_tensors(model))["model.layers.0.self_attn.o_proj.weight"],
    )
    with pytest.raises(ValueError, match=r"missing \['norm'\], unexpected \[\], wrong shapes"):
        ws.hf_layout({k: v for k, v in flat.items() if k != "norm"}, CONFIG)
    with pytest.raises(ValueError, match="layout must be one of \\['hf', 'tree'\\], got 'torch'"):
        ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG, layout="torch")


def test_safetensors_export_loads_back(model, tmp_path):
    path = ws.write_safetensors(model, tmp_path, version=2, step=2, dtype=jnp.float32)
    manifest = ws.read_manifest(path)
    assert manifest["format"] == ws.SAFETENSORS_FORMAT
    ws.validate_manifest(manifest, CONFIG, version=2)
    back = load_pretrained(os.path.join(path, "hf"))
    chex.assert_trees_all_equal(
        jax.tree.map(np.asarray, _params(back)), jax.tree.map(np.asarray, _params(model))
    )


# ---- the digest ----------------------------------------------------------------------------------
def _digest_values() -> dict[str, np.ndarray]:
    """Arrays of several ranks and dtypes whose dims split over a (2, 4) mesh."""
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((16, 24), np.float32),
        "layers/w": rng.standard_normal((4, 8, 12)).astype(jnp.bfloat16),
        "norm": rng.standard_normal(8).astype(np.float32),
        "count": np.arange(5, dtype=np.int32),
        "scale": np.asarray(0.5, np.float32),
    }


def _fmix32(x: np.ndarray) -> np.ndarray:
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x85EBCA6B)
    x = x ^ (x >> np.uint32(13))
    x = x * np.uint32(0xC2B2AE35)
    return x ^ (x >> np.uint32(16))


def _reference_digest(flat: dict[str, np.ndarray]) -> str:
    """The scheme of weight_sync's module doc, written out in numpy (<= 32-bit dtypes)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(ws.DIGEST_SCHEME.encode())
    with np.errstate(over="ignore"):
        for name in sorted(flat):
            a = np.asarray(flat[name])
            unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
            words = a.view(unsigned).astype(np.uint32)
            folded = np.zeros(words.shape, np.uint32)
            for d in range(words.ndim):
                shape = [1] * words.ndim
                shape[d] = words.shape[d]
                coord = np.arange(words.shape[d], dtype=np.uint32).reshape(shape)
                folded = (folded + coord) * np.uint32(0x9E3779B1)
            seed = np.frombuffer(hashlib.blake2b(name.encode(), digest_size=4).digest(), "<u4")
            pos = _fmix32(folded + seed[0])
            e = _fmix32(words * np.uint32(0x85EBCA77) + pos)
            lanes = [
                np.sum(e, dtype=np.uint32),
                np.sum(_fmix32(e ^ np.uint32(0x27D4EB2F)), dtype=np.uint32),
            ]
            h.update(f"{name}|{a.shape}|{a.dtype.name}|".encode())
            h.update(np.asarray(lanes, "<u4").tobytes())
    return h.hexdigest()


_SPLITS = [("x", "y"), ("y", "x"), (("x", "y"),)]  # per variant: the mesh axes of dims 0, 1
_AXIS_SIZE = {"x": 2, "y": 4, ("x", "y"): 8}


def _spec(shape: tuple[int, ...], variant: int) -> P:
    """A different split of each array per variant (a dim that does not divide: replicated)."""
    axes = [
        ax if shape[d] % _AXIS_SIZE[ax] == 0 else None
        for d, ax in enumerate(_SPLITS[variant][: len(shape)])
    ]
    return P(*axes)


def test_digest_matches_the_reference_under_any_sharding():
    values = _digest_values()
    want = _reference_digest(values)
    assert ws.digest_arrays(values) == want
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    for variant in range(3):
        sharded = {
            k: jax.device_put(v, NamedSharding(mesh, _spec(v.shape, variant)))
            for k, v in values.items()
        }
        assert any(
            len(x.sharding.device_set) == 8 and not x.is_fully_replicated for x in sharded.values()
        )
        assert ws.digest_arrays(sharded) == want, f"sharding variant {variant}"


def test_digest_sees_every_kind_of_change():
    values = _digest_values()
    base = ws.digest_arrays(values)
    flipped = dict(values, embed=values["embed"].copy())
    flipped["embed"].view(np.uint32)[3, 5] ^= 1  # one bit of one element
    swapped = dict(values, norm=values["norm"][[1, 0, *range(2, 8)]])  # two elements swap
    renamed = {("norm2" if k == "norm" else k): v for k, v in values.items()}
    retyped = dict(values, count=values["count"].view(np.float32))  # same bits, other dtype
    digests = [ws.digest_arrays(t) for t in (flipped, swapped, renamed, retyped)]
    assert len({base, *digests}) == 5


def test_value_digest_mismatch_is_refused(model, tmp_path):
    """The opt-in value digest is checked after restoring (here: the manifest's is wrong)."""
    path = ws.write_orbax(
        _params(model), tmp_path, version=1, step=1, config=CONFIG, value_digest=True
    )
    manifest = ws.read_manifest(path)
    manifest["value_digest"] = "0" * 32
    with open(os.path.join(path, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match="digest mismatch \\(corrupt or partially written"):
        ws.restore_orbax(path)


def test_older_manifests_still_restore_and_unknown_schemes_are_refused(model, tmp_path):
    """Manifests from before FILES_SCHEME: the value digest as ``digest``, or (no scheme) a
    blake2b over the raw bytes; both are still checked."""
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG)
    flat = ws.restore_orbax(path)
    manifest = ws.read_manifest(path)
    for key in ("files", "segment_bytes"):
        del manifest[key]
    for scheme, digest in (
        (ws.DIGEST_SCHEME, ws.digest_arrays(flat)),
        (None, sync_checks._digest_bytes_v0(flat)),
    ):
        manifest["digest_scheme"], manifest["digest"] = scheme, digest
        with open(os.path.join(path, ws.MANIFEST), "w") as f:
            json.dump(manifest, f)
        chex.assert_trees_all_equal(ws.restore_orbax(path), flat)
        manifest["digest"] = "f" * 32
        with open(os.path.join(path, ws.MANIFEST), "w") as f:
            json.dump(manifest, f)
        with pytest.raises(ValueError, match="digest mismatch"):
            ws.restore_orbax(path)
    manifest["digest_scheme"] = "md5-of-the-moon"
    with open(os.path.join(path, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match="unknown digest_scheme 'md5-of-the-moon'"):
        ws.restore_orbax(path)


# ---- two processes write one version -------------------------------------------------------------
NUM_PROCESSES = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _multiprocess_writer(root: str) -> None:
    """One of two processes (4 CPU devices each): write `_digest_values`, split over all 8
    devices, as version 3 with the default bf16 cast, and print the digest it computed."""
    from jax.experimental import multihost_utils

    from bapo_jax.sharding import distributed

    if not distributed.maybe_initialize():
        raise RuntimeError("the launcher environment did not ask for a multi-process run")
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    flat = {}
    for k, v in _digest_values().items():
        sharding = NamedSharding(mesh, _spec(v.shape, 0))
        flat[k] = jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
    path = ws.write_orbax(
        ws.unflatten_params(flat),
        root,
        version=3,
        step=3,
        config=CONFIG,
        value_digest=True,
        layout="tree",
    )
    multihost_utils.sync_global_devices("digest-test-done")
    print(json.dumps({"path": path, "process": jax.process_index()}), flush=True)
    jax.distributed.shutdown()


@pytest.mark.slow
def test_two_processes_write_one_version_with_the_single_process_digest(tmp_path):
    from bapo_jax.sharding import distributed

    port, procs = _free_port(), []
    for i in range(NUM_PROCESSES):
        env = child_env(
            4,
            PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **{
                distributed.COORDINATOR_ENV: f"127.0.0.1:{port}",
                distributed.NUM_PROCESSES_ENV: str(NUM_PROCESSES),
                distributed.PROCESS_ID_ENV: str(i),
            },
        )
        cmd = [sys.executable, os.path.abspath(__file__), "--write", str(tmp_path / "sync")]
        procs.append(
            subprocess.Popen(
                cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    deadline, outs = time.monotonic() + 600, []
    try:
        for p in procs:
            out, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, f"writer failed:\n{err[-4000:]}"
            outs.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    path = ws.version_dir(tmp_path / "sync", 3)
    assert {o["path"] for o in outs} == {path} and sorted(o["process"] for o in outs) == [0, 1]
    assert ws.list_versions(tmp_path / "sync") == [3]
    assert not [d for d in os.listdir(tmp_path / "sync") if d.startswith(".")]
    want = {k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16)) for k, v in _digest_values().items()}
    manifest = ws.read_manifest(path)
    assert manifest["value_digest"] == ws.digest_arrays(want) == _reference_digest(want)
    # one file table for both processes' files, and no partial table left behind
    files = _params_files(path)
    assert sorted(manifest["files"]) == files
    for i in range(NUM_PROCESSES):
        assert any(f"ocdbt.process_{i}" in f for f in files)
    assert sorted(os.listdir(path)) == ["manifest.json", "params"]
    chex.assert_trees_all_equal(ws.restore_orbax(path), want)  # checks files and digest


if __name__ == "__main__":  # a writer process of the two-process test
    if sys.argv[1:2] != ["--write"] or len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} --write ROOT")
    _multiprocess_writer(sys.argv[2])
