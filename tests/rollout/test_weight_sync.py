"""The weight-sync format (Orbax in HF layout): round trip, bf16 default, atomicity, keep-K,
manifest validation, the file checksums (a truncated, damaged, missing or extra file is refused
before Orbax reads it; against xxhash itself), two processes writing one version, and the
worker's HF tensors (without vLLM)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import time

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import xxhash
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bapo_jax.models import PRESETS, init_model, iter_hf_tensors
from bapo_jax.rollout import manifest_auth, sync_checks
from bapo_jax.rollout import weight_sync as ws
from bapo_jax.rollout.vllm_worker import hf_tensors_from_hf_layout
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
        _params(model), tmp_path, version=3, step=30, config=CONFIG, dtype=None, timings=written
    )
    assert path == ws.version_dir(tmp_path, 3)
    assert set(written) == {"cast_s", "save_s", "checksum_s"} and min(written.values()) >= 0
    manifest = ws.read_manifest(path)
    assert (manifest["version"], manifest["step"], manifest["format"]) == (3, 30, ws.FORMAT)
    assert manifest["dtype"] == "float32"
    assert ws.validate_manifest(manifest, CONFIG, version=3) == CONFIG
    timings = {}
    flat = ws.restore_orbax(path, timings=timings)
    assert set(timings) == {"verify_s", "read_s"} and min(timings.values()) >= 0
    want = ws.hf_layout(ws.flatten_params(_params(model)), CONFIG, None)
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


def test_checksums_per_segment_match_xxhash(tmp_path):
    # 3 MiB: the 1 MiB read pieces of a 2 MiB segment are hashed as one stream
    data = np.random.default_rng(0).integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "empty").write_bytes(b"")
    table = sync_checks._checksum_files(str(tmp_path), ["a", "empty"], 2 << 20)
    reference = xxhash.xxh3_64_intdigest
    assert table == {
        "a": {"size": 3 << 20, "xxh3": [reference(data[: 2 << 20]), reference(data[2 << 20 :])]},
        "empty": {"size": 0, "xxh3": []},
    }


def test_a_segment_size_that_cannot_be_mapped_is_refused(model, tmp_path):
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG)
    manifest = ws.read_manifest(path)
    manifest["segment_bytes"] = 1000
    with open(os.path.join(path, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match=r"segment_bytes=1000 \(want a table and a positive mult"):
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
    assert ws.read_manifest(ws.version_dir(tmp_path, 4))["format"] == ws.FORMAT
    want = dict(iter_hf_tensors(model, dtype=jnp.bfloat16))["model.layers.1.mlp.up_proj.weight"]
    np.testing.assert_array_equal(flat["model/layers/mlp/up_proj/weight"][1], want)


@pytest.mark.parametrize("keep, during", [(3, [2, 3]), (2, [3]), (1, [1, 2, 3])])
def test_a_write_makes_room_first_and_never_removes_the_newest(model, tmp_path, keep, during):
    for v in range(4):
        ws.write_orbax(_params(model), tmp_path, version=v, step=v, config=CONFIG, keep=3)
    seen = []

    def fill(tmp):  # what a reader sees while version 4 is being written
        seen.extend(ws.list_versions(tmp_path))
        return {"format": ws.FORMAT, "version": 4}

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
    """A version written from wrong arrays (``write_arrays`` checks nothing) is refused by the
    manifest check, naming the tensor; ``write_orbax`` refuses the same fault in a tree."""
    tree = ws.flatten_params(_params(model))
    flat = ws.hf_layout(tree, CONFIG, None)
    k_bias, norm = "model/layers/self_attn/k_proj/bias", "model/norm/weight"
    if fault == "missing":
        flat.pop(k_bias)
        tree.pop("layers/k_bias")
        pattern = rf"missing parameters \['{k_bias}'\]"
    elif fault == "shape":
        flat[norm] = flat[norm][:-1]
        tree["norm"] = tree["norm"][:-1]
        pattern = rf"wrong shapes \['{norm}: \(63,\) != expected \(64,\)'\]"
    else:
        flat["extra"] = tree["extra"] = flat[norm]
        pattern = r"unexpected \['extra'\]"
    path = ws.write_arrays(flat, tmp_path, version=1, step=1, config=CONFIG)
    with pytest.raises(ValueError, match=pattern):
        ws.validate_manifest(ws.read_manifest(path), CONFIG)
    with pytest.raises(ValueError, match="params do not match the config"):
        ws.write_orbax(ws.unflatten_params(tree), tmp_path, version=2, step=2, config=CONFIG)


def test_manifest_config_and_version_checked(model, tmp_path):
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG)
    with pytest.raises(ValueError, match="manifest version is 1, expected 2"):
        ws.validate_manifest(ws.read_manifest(path), CONFIG, version=2)
    with pytest.raises(ValueError, match="differs from the served model"):
        ws.validate_manifest(ws.read_manifest(path), PRESETS["tiny-tied"])
    with pytest.raises(ValueError, match="version must be an int in"):
        ws.write_orbax(_params(model), tmp_path, version=-1, step=0, config=CONFIG)


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied"])
def test_hf_layout_checkpoint_holds_what_save_pretrained_writes(tmp_path, preset):
    """The default (HF layout) checkpoint, restored and split per layer as the worker does,
    is bit-equal to save_pretrained's bf16 tensors (same names, shapes, layout), and every
    tensor the worker hands vLLM is contiguous."""
    config = PRESETS[preset]
    model = init_model(config, seed=2)
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=config)
    manifest = ws.read_manifest(path)
    assert manifest["format"] == ws.FORMAT
    assert ws.validate_manifest(manifest, config, version=1) == config
    expected = ws.expected_hf_shapes(config)
    assert {k: tuple(v["shape"]) for k, v in manifest["params"].items()} == expected
    fed = dict(t for g in hf_tensors_from_hf_layout(ws.restore_orbax(path), config) for t in g)
    written = dict(iter_hf_tensors(model, dtype=jnp.bfloat16))
    assert sorted(fed) == sorted(written)
    assert ("lm_head.weight" in fed) == (not config.tie_word_embeddings)
    assert all(a.flags["C_CONTIGUOUS"] for a in fed.values())
    chex.assert_trees_all_equal(fed, written)


def test_hf_layout_keeps_fp32_and_refuses_bad_input(model):
    flat = ws.flatten_params(_params(model))
    out = ws.hf_layout(flat, CONFIG, None)
    assert {jnp.dtype(v.dtype).name for v in out.values()} == {"float32"}
    np.testing.assert_array_equal(
        np.asarray(out["model/layers/self_attn/o_proj/weight"][0]),
        dict(iter_hf_tensors(model))["model.layers.0.self_attn.o_proj.weight"],
    )
    with pytest.raises(ValueError, match=r"missing \['norm'\], unexpected \[\], wrong shapes"):
        ws.hf_layout({k: v for k, v in flat.items() if k != "norm"}, CONFIG)


def test_other_formats_and_schemes_are_refused(model, tmp_path):
    """One format, one file check: anything else is refused, naming what it found."""
    path = ws.write_orbax(_params(model), tmp_path, version=1, step=1, config=CONFIG)
    manifest = ws.read_manifest(path)
    with pytest.raises(ValueError, match="format must be 'bapo-orbax-hf-v1', got 'bapo-orbax"):
        ws.validate_manifest(dict(manifest, format="bapo-orbax-params-v1"), CONFIG)
    manifest["digest_scheme"] = "bapo-files-crc32-v1"
    with open(os.path.join(path, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(ValueError, match="digest_scheme must be 'bapo-files-xxh3-v1', got 'bapo"):
        ws.restore_orbax(path)


# ---- signed manifests (manifest_auth) and owner-only directories --------------------------------
KEY = b"k" * 32  # a manifest key (a run's: run_secret.manifest_key(secret))


def _all_bytes(root) -> bytes:
    out = b""
    for d, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(d, name), "rb") as f:
                out += f.read()
    return out


def test_a_signed_version_restores_with_its_key_only(model, tmp_path):
    """The manifest carries the HMAC (hex), never the key; the reader with the key accepts it
    and so does one without (it cannot check it), one with another key refuses it. The HMAC
    covers the canonical JSON of the fields, not the file's bytes: a manifest re-serialised
    with other key order and spacing still verifies, a changed step does not."""
    path = ws.write_orbax(
        _params(model), tmp_path, version=1, step=1, config=CONFIG, manifest_key=KEY
    )
    manifest = ws.read_manifest(path)
    assert manifest[manifest_auth.HMAC_FIELD] == manifest_auth.manifest_hmac(manifest, KEY)
    assert len(manifest["hmac"]) == 64 and int(manifest["hmac"], 16) >= 0
    everything = _all_bytes(tmp_path)
    assert KEY not in everything and KEY.hex().encode() not in everything
    want = ws.restore_orbax(path)
    chex.assert_trees_all_equal(ws.restore_orbax(path, manifest_key=KEY), want)
    with pytest.raises(ValueError, match="manifest HMAC mismatch"):
        ws.restore_orbax(path, manifest_key=b"o" * 32)
    with open(os.path.join(path, ws.MANIFEST), "w") as f:
        json.dump(dict(reversed(list(manifest.items()))), f, indent=4)
    chex.assert_trees_all_equal(ws.restore_orbax(path, manifest_key=KEY), want)
    with open(os.path.join(path, ws.MANIFEST), "w") as f:
        json.dump(dict(manifest, step=2), f)  # digest and files intact
    with pytest.raises(ValueError, match="manifest HMAC mismatch"):
        ws.restore_orbax(path, manifest_key=KEY)
    with pytest.raises(ValueError, match="manifest_key must be bytes of length >= 16"):
        ws.write_orbax(
            _params(model), tmp_path, version=2, step=2, config=CONFIG, manifest_key=b"x"
        )


def _forge(path, params, scratch, hmac: str) -> dict:
    """What a third party who can write into the sync directory does: replace the version's
    tensor files with its own (here: Orbax's files for ``params``) and the manifest with one
    whose XXH3 table and digest are right for them; ``hmac``: "missing" (dropped), "stale"
    (the genuine manifest's, for other contents), "other-key" (a key not the run's). Returns
    the forged arrays."""
    fake = ws.write_orbax(params, scratch, version=1, step=1, config=CONFIG)
    manifest = ws.read_manifest(fake)
    if hmac == "stale":
        manifest["hmac"] = ws.read_manifest(path)["hmac"]
    elif hmac == "other-key":
        manifest = manifest_auth.sign_manifest(manifest, b"o" * 32)
    shutil.rmtree(os.path.join(path, "params"))
    shutil.copytree(os.path.join(fake, "params"), os.path.join(path, "params"))
    with open(os.path.join(path, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    return ws.restore_orbax(fake)


@pytest.mark.parametrize("hmac", ["missing", "stale", "other-key"])
def test_a_forged_version_is_refused_with_the_key_and_read_without(model, tmp_path, hmac):
    path = ws.write_orbax(
        _params(model), tmp_path / "sync", version=1, step=1, config=CONFIG, manifest_key=KEY
    )
    genuine = ws.restore_orbax(path, manifest_key=KEY)
    forged = _forge(path, _params(init_model(CONFIG, seed=9)), tmp_path / "scratch", hmac)
    pattern = "has no 'hmac'" if hmac == "missing" else "manifest HMAC mismatch"
    with pytest.raises(ValueError, match=pattern):
        ws.restore_orbax(path, manifest_key=KEY)
    got = ws.restore_orbax(path)  # without the key the file table is all there is: it passes
    chex.assert_trees_all_equal(got, forged)
    embed = "model/embed_tokens/weight"
    assert not np.array_equal(got[embed], genuine[embed])  # other weights, served if not signed


def test_a_created_sync_root_is_owner_only_unless_asked_otherwise(model, tmp_path):
    old_umask = os.umask(0o002)  # would leave a plain mkdir group-writable, world-readable
    try:
        path = ws.write_orbax(
            _params(model), tmp_path / "a" / "sync", version=1, step=1, config=CONFIG
        )
        ws.write_orbax(
            _params(model), tmp_path / "b", version=1, step=1, config=CONFIG, dir_mode=0o750
        )
    finally:
        os.umask(old_umask)
    mode = lambda p: stat.S_IMODE(os.stat(p).st_mode)
    assert mode(tmp_path / "a" / "sync") == 0o700 and mode(path) == 0o700
    assert mode(tmp_path / "b") == 0o750
    existing = tmp_path / "existing"
    existing.mkdir()
    existing.chmod(0o755)
    ws.write_orbax(_params(model), existing, version=1, step=1, config=CONFIG)
    assert mode(existing) == 0o755  # not ours to change


# ---- two processes write one version -------------------------------------------------------------
def _sharded_values() -> dict[str, np.ndarray]:
    """Arrays of several ranks and dtypes whose dims split over a (2, 4) mesh."""
    rng = np.random.default_rng(0)
    return {
        "embed": rng.standard_normal((16, 24), np.float32),
        "layers/w": rng.standard_normal((4, 8, 12)).astype(jnp.bfloat16),
        "norm": rng.standard_normal(8).astype(np.float32),
        "scale": np.asarray(0.5, np.float32),
    }


_SPLITS = [("x", "y"), ("y", "x"), (("x", "y"),)]  # per variant: the mesh axes of dims 0, 1
_AXIS_SIZE = {"x": 2, "y": 4, ("x", "y"): 8}


def _spec(shape: tuple[int, ...], variant: int) -> P:
    """A different split of each array per variant (a dim that does not divide: replicated)."""
    axes = [
        ax if shape[d] % _AXIS_SIZE[ax] == 0 else None
        for d, ax in enumerate(_SPLITS[variant][: len(shape)])
    ]
    return P(*axes)


NUM_PROCESSES = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _multiprocess_writer(root: str) -> None:
    """One of two processes (4 CPU devices each): write `_sharded_values`, split over all 8
    devices and cast to bf16 there, as version 3, and print the path it got."""
    from jax.experimental import multihost_utils

    from bapo_jax.sharding import distributed

    if not distributed.maybe_initialize():
        raise RuntimeError("the launcher environment did not ask for a multi-process run")
    mesh = jax.make_mesh((2, 4), ("x", "y"))
    flat = {}
    for k, v in _sharded_values().items():
        sharding = NamedSharding(mesh, _spec(v.shape, 0))
        array = jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
        flat[k] = array.astype(jnp.bfloat16)
    path = ws.write_arrays(flat, root, version=3, step=3, config=CONFIG)
    multihost_utils.sync_global_devices("write-test-done")
    print(json.dumps({"path": path, "process": jax.process_index()}), flush=True)
    jax.distributed.shutdown()


@pytest.mark.slow
def test_two_processes_write_one_version(tmp_path):
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
    want = {
        k: np.asarray(jnp.asarray(v).astype(jnp.bfloat16)) for k, v in _sharded_values().items()
    }
    manifest = ws.read_manifest(path)
    # one file table for both processes' files, and no partial table left behind
    files = _params_files(path)
    assert sorted(manifest["files"]) == files
    for i in range(NUM_PROCESSES):
        assert any(f"ocdbt.process_{i}" in f for f in files)
    assert sorted(os.listdir(path)) == ["manifest.json", "params"]
    chex.assert_trees_all_equal(ws.restore_orbax(path), want)  # checks every file


if __name__ == "__main__":  # a writer process of the two-process test
    if sys.argv[1:2] != ["--write"] or len(sys.argv) != 3:
        raise SystemExit(f"usage: {sys.argv[0]} --write ROOT")
    _multiprocess_writer(sys.argv[2])
