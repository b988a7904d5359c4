"""`OrbaxSync` (the vLLM path's `WeightUpdater`) against the real worker extension.

The target here is one in-process ``BapoWorkerExtension`` (its staging thread, checks, Orbax
restore and HF grouping all run for real) whose vLLM model runner is replaced by a recorder
of the tensors vLLM's ``reload_weights`` would receive; the real vLLM path is in
tests/rollout/test_vllm_real.py and tests/experiments/test_cpu_arithmetic_vllm.py.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import types

import chex
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from bapo_jax.malloc import MALLOC_TUNABLES
from bapo_jax.models import PRESETS, init_model, iter_hf_tensors
from bapo_jax.rollout import manifest_auth, orbax_sync, run_secret
from bapo_jax.rollout import weight_sync as ws
from bapo_jax.rollout.orbax_sync import OrbaxSync
from bapo_jax.rollout.vllm_http import WeightSyncError
from bapo_jax.rollout.vllm_worker import SYNC_ROOT_ENV, BapoWorkerExtension, confine_to_sync_root
from bapo_jax.train import overlap

CONFIG = PRESETS["tiny"]  # untied: no head to re-tie in the recorder


class _Runner:
    """What the worker extension uses of vLLM's model runner: the served config, and the
    in-place reload (here: the tensors it was given, as numpy)."""

    def __init__(self, config):
        fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
        fields += ("num_attention_heads", "num_key_value_heads", "tie_word_embeddings")
        hf = types.SimpleNamespace(**{k: getattr(config, k) for k in fields})
        self.model_config = types.SimpleNamespace(hf_config=hf)
        self.weights: dict[str, np.ndarray] = {}

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        loaded = {}
        for name, tensor in weights_iterator:
            loaded[name] = tensor.float().numpy()  # vLLM copies into fp32 parameters
        self.weights = loaded


class _Worker(BapoWorkerExtension):
    def __init__(self, config):
        self.model_runner = _Runner(config)
        self.model_runner.get_model = lambda: torch.nn.Linear(8, 4)  # on the host (CPU)
        self.model_runner.model_config.dtype = torch.float32  # served in fp32


class _Engine:
    """One server's worth of `VLLMEngine`'s `SyncTarget` over the worker's JSON RPC methods:
    stage, then load (refusal -> WeightSyncError, the served weights unchanged)."""

    def __init__(self, config):
        self.worker = _Worker(config)
        self.servers = ["in-process"]
        self.policy_version = 0
        self.last_update: dict = {}
        self.staged: list[int] = []

    def reserve_sync_memory(self, checkpoint_bytes, parameters):
        request = json.dumps({"checkpoint_bytes": checkpoint_bytes, "parameters": parameters})
        return {"in-process": self.worker.bapo_reserve(request)}

    def stage_weights(self, version, checkpoint):
        self.staged.append(version)
        reply = self.worker.bapo_stage(json.dumps({"path": checkpoint, "version": version}))
        return {"in-process": reply}

    def load_checkpoint(self, version, checkpoint):
        reply = self.worker.bapo_load(json.dumps({"path": checkpoint, "version": version}))
        if not reply["ok"]:
            raise WeightSyncError(f"refused at stage {reply['stage']}: {reply['error']}")
        self.last_update = {"in-process": reply}
        self.policy_version = version
        return dict(self.last_update)


@pytest.fixture(autouse=True)
def sync_root(tmp_path, monkeypatch):
    """The worker's environment as ``serve`` sets it: the sync root it may load from (every
    test here writes under ``tmp_path``); no run secret (unsigned manifests) unless a test
    sets one."""
    monkeypatch.setenv(SYNC_ROOT_ENV, os.path.realpath(tmp_path))
    monkeypatch.delenv(run_secret.SECRET_FILE_ENV, raising=False)
    return tmp_path


@pytest.fixture(scope="module")
def model():
    return init_model(CONFIG, seed=3)


def _state(model):
    return nnx.state(model, nnx.Param)


def _served_equals(engine, model):
    want = {k: v.astype(np.float32) for k, v in iter_hf_tensors(model, dtype=jnp.bfloat16)}
    chex.assert_trees_all_equal(engine.worker.model_runner.weights, want)


def test_begin_writes_and_stages_in_the_background_and_finish_switches(model, tmp_path):
    engine = _Engine(CONFIG)
    sync = OrbaxSync(str(tmp_path), CONFIG, engine)
    handle = sync.begin_update(1, _state(model), step=10)
    assert isinstance(handle.thread, threading.Thread)
    handle.thread.join()  # the drain outlasts the write and the staged read
    engine.worker.bapo_staged.done.wait()
    assert engine.policy_version == 0 and engine.worker.bapo_version is None  # not switched
    timings = sync.finish_update(handle)
    assert engine.staged == [1] and engine.policy_version == 1
    reply = engine.last_update["in-process"]
    assert reply["staged"] and reply["version"] == 1 and reply["tensors"] > 0
    assert timings["attempts"] == 1 and timings["server_version"] == 1
    # all of the write and of the staged read ran before finish (no generating_until: now)
    assert timings["write_hidden_s"] == pytest.approx(timings["write_s"])
    assert timings["load_hidden_s"] == pytest.approx(reply["restore_s"])
    assert 0 < timings["load_hidden_s"] <= timings["load_s"]
    _served_equals(engine, model)
    assert ws.read_manifest(handle.path)["step"] == 10


def test_finish_right_away_hides_nothing_of_what_it_waited_for(model, tmp_path):
    engine = _Engine(CONFIG)
    sync = OrbaxSync(str(tmp_path), CONFIG, engine)
    timings = sync.finish_update(sync.begin_update(1, _state(model), step=1))
    assert 0 <= timings["write_hidden_s"] <= timings["write_s"]
    assert 0 <= timings["load_hidden_s"] <= timings["load_s"]
    _served_equals(engine, model)


def test_only_the_work_before_the_generation_ended_counts_as_hidden(model, tmp_path):
    """The loop passes when the drained generation ended: a sync begun after it hides
    nothing, however long the loop took to call finish."""
    engine = _Engine(CONFIG)
    sync = OrbaxSync(str(tmp_path), CONFIG, engine)
    ended = time.perf_counter()  # generation over before the update ended (k = 1, short)
    handle = sync.begin_update(1, _state(model), step=1)
    handle.thread.join()
    engine.worker.bapo_staged.done.wait()
    timings = sync.finish_update(handle, generating_until=ended)
    assert timings["write_hidden_s"] == timings["load_hidden_s"] == 0.0
    spans = [types.SimpleNamespace(generation_spans=[(0.0, 1.0), (2.0, 5.0)])]
    assert overlap.generation_end([*spans, types.SimpleNamespace(generation_spans=[])]) == 5.0
    assert overlap.generation_end([]) == 0.0


class _DamageFirstWrite(OrbaxSync):
    """Truncates the largest file of the first checkpoint after the write, before staging."""

    writes = 0

    def write(self, version, params, step):
        path = super().write(version, params, step)
        self.writes += 1
        if self.writes == 1:
            files = [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs]
            largest = max(files, key=os.path.getsize)
            with open(largest, "r+b") as f:
                f.truncate(os.path.getsize(largest) // 2)
        return path


def test_a_staged_read_of_a_damaged_checkpoint_is_refused_and_written_again(
    model, tmp_path, capsys
):
    engine = _Engine(CONFIG)
    sync = _DamageFirstWrite(str(tmp_path), CONFIG, engine)
    timings = sync.finish_update(sync.begin_update(1, _state(model), step=1))
    assert sync.writes == 2 and timings["attempts"] == 2
    out = capsys.readouterr().out
    assert "version 1 refused" in out and "staged read refused" in out and "truncated" in out
    reply = engine.last_update["in-process"]
    assert not reply["staged"]  # the second write is read at load time, every check again
    assert timings["load_hidden_s"] == 0.0
    _served_equals(engine, model)


def test_a_refused_staged_read_keeps_the_served_version(model, tmp_path):
    engine = _Engine(CONFIG)
    sync = OrbaxSync(str(tmp_path), CONFIG, engine, attempts=1)
    sync.finish_update(sync.begin_update(1, _state(model), step=1))
    served = dict(engine.worker.model_runner.weights)
    handle = sync.begin_update(2, _state(init_model(CONFIG, seed=4)), step=2)
    handle.thread.join()
    engine.worker.bapo_staged.done.wait()
    manifest = ws.read_manifest(handle.path)
    manifest["digest"] = "0" * 32
    with open(os.path.join(handle.path, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    with pytest.raises(WeightSyncError, match="stage validate"):
        sync.finish_update(handle)  # the digest changed since staging: read again, refused
    assert engine.policy_version == 1 and engine.worker.bapo_version == 1
    chex.assert_trees_all_equal(engine.worker.model_runner.weights, served)


def test_the_metrics_row_and_bad_arguments(model, tmp_path):
    engine = _Engine(CONFIG)
    sync = OrbaxSync(str(tmp_path), CONFIG, engine)
    handle = sync.begin_update(1, _state(model), step=1)
    row = overlap.sync_row(sync.finish_update(handle))
    assert handle.path == ws.version_dir(tmp_path, 1)
    assert set(row) == {
        "time/sync_write",
        "time/sync_load",
        "time/sync_write_hidden",
        "time/sync_load_hidden",
        "sync/attempts",
        "sync/engine_version",
    }
    assert row["sync/engine_version"] == 1
    for version, step, field in ((-1, 0, "version"), (1, 1.5, "step"), (True, 0, "version")):
        with pytest.raises(ValueError, match=f"{field} must be an int >= 0"):
            sync.begin_update(version, _state(model), step=step)
    with pytest.raises(ValueError, match="attempts must be >= 1, got 0"):
        OrbaxSync(str(tmp_path), CONFIG, engine, attempts=0)


def test_followers_reproduce_process_0s_load(model, tmp_path, monkeypatch):
    """A multi-process run's sync: process 0 loads through `BroadcastingTarget`, which sends
    the outcome; a `FollowerEngine` receives it and reproduces it (a refusal as the same
    `WeightSyncError`, so `OrbaxSync` retries on every process alike). The broadcast is a
    queue here: the two-process collective itself is `broadcast_bytes`' own test."""
    sent = []
    monkeypatch.setattr(
        "bapo_jax.sharding.distributed.broadcast_bytes",
        lambda data: sent.append(data) or data if data is not None else sent.pop(0),
    )
    engine = _Engine(CONFIG)
    primary = orbax_sync.BroadcastingTarget(engine)
    follower = orbax_sync.FollowerEngine(version=0)
    path = OrbaxSync(str(tmp_path), CONFIG, primary).write(1, _state(model), 1)
    assert primary.load_checkpoint(1, path)["in-process"]["version"] == 1
    replies = follower.load_checkpoint(1, path)
    assert follower.policy_version == 1 and follower.servers == [0]
    assert replies["in-process"]["version"] == 1 and replies == engine.last_update
    assert follower.stage_weights(1, path) == {}  # process 0 stages
    assert follower.reserve_sync_memory(10, 5) == {}  # and reserves
    assert primary.reserve_sync_memory(10, 5)["in-process"]["ok"]
    with pytest.raises(WeightSyncError):
        primary.load_checkpoint(2, path)  # the manifest says version 1
    with pytest.raises(WeightSyncError, match="on process 0: WeightSyncError"):
        follower.load_checkpoint(2, path)
    with pytest.raises(RuntimeError, match=r"engine\.generate called on process 0"):
        follower.generate([[1]], 1)


def test_workers_reserve_what_one_version_and_their_model_hold_once(model, tmp_path, monkeypatch):
    """`reserve_memory` asks for one version's bytes at the sync's dtype (those the writer
    stores, here bf16) and its parameter count; a CPU worker adds those parameters at its
    served dtype (fp32: what vLLM's reload re-materializes), grows the heap once and only by
    what is missing later; without the project's malloc setting it reserves nothing (freed
    memory would go back to the kernel) and says why."""
    engine = _Engine(CONFIG)
    sync = OrbaxSync(str(tmp_path), CONFIG, engine)
    stored = ws.read_manifest(sync.write(1, _state(model), 1))["params"]
    count = sum(int(np.prod(p["shape"])) for p in stored.values())
    assert ws.checkpoint_bytes(CONFIG) == 2 * count

    monkeypatch.setenv("GLIBC_TUNABLES", "")
    reply = sync.reserve_memory()["in-process"]
    assert reply["ok"] and reply["reserved_bytes"] == 0 and "bapo_jax.malloc" in reply["why"]

    monkeypatch.setenv("GLIBC_TUNABLES", MALLOC_TUNABLES)
    reply = sync.reserve_memory()["in-process"]
    assert reply["reserved_bytes"] == reply["added_bytes"] == 2 * count + 4 * count
    assert sync.reserve_memory()["in-process"]["added_bytes"] == 0  # once
    request = {"checkpoint_bytes": 2 * count + 100, "parameters": count}
    grown = engine.worker.bapo_reserve(json.dumps(request))
    assert grown["added_bytes"] == 100 and grown["reserved_bytes"] == 6 * count + 100
    refused = engine.worker.bapo_reserve(json.dumps({"checkpoint_bytes": -1, "parameters": 1}))
    assert not refused["ok"] and "must be >= 0" in refused["error"]


# ---- the worker loads only under its sync root -------------------------------------------------
@pytest.fixture()
def outside(tmp_path_factory, model):
    """A good version 2 (other weights) outside the sync root (another temp directory)."""
    params = nnx.to_pure_dict(_state(init_model(CONFIG, seed=5)))
    root = tmp_path_factory.mktemp("elsewhere")
    return ws.write_orbax(params, root, version=2, step=2, config=CONFIG)


def test_the_confinement_rule(sync_root, outside):
    """``..``, a symlink out of the root and an absolute path elsewhere are refused naming the
    path, what it resolves to and the root; a version under the root resolves to itself."""
    root = os.path.realpath(sync_root)
    good = os.path.join(root, "v00000002")
    assert confine_to_sync_root(good, root) == good
    assert confine_to_sync_root(os.path.join(root, "x", "..", "v00000002"), root) == good
    os.symlink(outside, os.path.join(root, "link"))
    parent, name = os.path.split(outside)
    for path in (
        os.path.join(root, "..", os.path.basename(parent), name),  # ../
        os.path.join(root, "link"),  # a symlink out of it
        outside,  # an absolute path elsewhere
        root,  # the root itself is no version
        os.path.relpath(outside),  # relative: against the working directory
    ):
        with pytest.raises(ValueError, match="loads only directories under its sync root") as info:
            confine_to_sync_root(path, root)
        assert repr(path) in str(info.value) and repr(root) in str(info.value)
    with pytest.raises(ValueError, match=f"started without \\${SYNC_ROOT_ENV}"):
        confine_to_sync_root(good, None)
    with pytest.raises(ValueError, match="want a version directory"):
        confine_to_sync_root(["v00000001"], root)


def test_the_worker_refuses_to_stage_or_load_outside_its_sync_root(model, sync_root, outside):
    """Stage and load of a good version outside the root (by ``..``, through a symlink in the
    root, by its absolute path) are refused at stage validate (a ``WeightSyncError`` for the
    sync, so `OrbaxSync` would write the version again); the worker keeps its version and
    weights, and the staged read of the version in the root is neither replaced nor taken:
    its load goes on."""
    engine = _Engine(CONFIG)
    sync = OrbaxSync(str(sync_root), CONFIG, engine, attempts=1)
    sync.finish_update(sync.begin_update(1, _state(model), step=1))
    served = dict(engine.worker.model_runner.weights)
    good = sync.write(2, _state(model), 2)
    assert engine.stage_weights(2, good)["in-process"]["ok"]
    staged = engine.worker.bapo_staged
    parent, name = os.path.split(outside)
    os.symlink(parent, os.path.join(sync_root, "link"))
    for path in (
        os.path.join(sync_root, "..", os.path.basename(parent), name),
        os.path.join(sync_root, "link", name),
        outside,
    ):
        request = json.dumps({"path": path, "version": 2})
        for method in (engine.worker.bapo_stage, engine.worker.bapo_load):
            reply = method(request)
            assert not reply["ok"] and reply["stage"] == "validate", reply
            assert "sync root" in reply["error"] and reply["version"] == 1
        assert engine.worker.bapo_staged is staged
        with pytest.raises(WeightSyncError, match=r"stage validate.*sync root"):
            engine.load_checkpoint(2, path)
    assert engine.worker.bapo_version == 1 and not engine.worker.bapo_poisoned
    chex.assert_trees_all_equal(engine.worker.model_runner.weights, served)
    assert engine.load_checkpoint(2, good)["in-process"]["staged"]
    assert engine.worker.bapo_version == 2


def test_a_worker_without_a_sync_root_loads_nothing(model, sync_root, monkeypatch):
    engine = _Engine(CONFIG)
    path = OrbaxSync(str(sync_root), CONFIG, engine).write(1, _state(model), 1)
    monkeypatch.delenv(SYNC_ROOT_ENV)
    for method in (engine.worker.bapo_stage, engine.worker.bapo_load):
        reply = method(json.dumps({"path": path, "version": 1}))
        assert not reply["ok"] and reply["stage"] == "validate"
        assert f"started without ${SYNC_ROOT_ENV}" in reply["error"]
    assert engine.worker.bapo_version is None and engine.worker.model_runner.weights == {}


# ---- signed manifests ----------------------------------------------------------------------------
class _ForgeFirstWrite(OrbaxSync):
    """After the first write, a third party replaces the version's tensor files and manifest
    with its own (other weights; the XXH3 table and digest right for them; no valid HMAC),
    before the servers stage it."""

    writes = 0

    def write(self, version, params, step):
        path = super().write(version, params, step)
        self.writes += 1
        if self.writes == 1:
            scratch = os.path.join(os.path.dirname(self.root), "forger")
            other = nnx.to_pure_dict(_state(init_model(CONFIG, seed=9)))
            fake = ws.write_orbax(other, scratch, version=version, step=step, config=CONFIG)
            shutil.rmtree(os.path.join(path, "params"))
            shutil.copytree(os.path.join(fake, "params"), os.path.join(path, "params"))
            shutil.copy(os.path.join(fake, ws.MANIFEST), os.path.join(path, ws.MANIFEST))
        return path


def _run_secret(tmp_path_factory, monkeypatch) -> bytes:
    """A run secret given to the worker as ``serve`` does; the trainer's manifest key."""
    path = run_secret.new_secret_file(tmp_path_factory.mktemp("secret"))
    monkeypatch.setenv(run_secret.SECRET_FILE_ENV, path)
    return run_secret.manifest_key(run_secret.read_secret(path))


def test_a_forged_version_is_refused_and_written_again(
    model, sync_root, tmp_path_factory, monkeypatch, capsys
):
    key = _run_secret(tmp_path_factory, monkeypatch)
    engine = _Engine(CONFIG)
    sync = _ForgeFirstWrite(str(sync_root / "sync"), CONFIG, engine, manifest_key=key)
    timings = sync.finish_update(sync.begin_update(1, _state(model), step=1))
    assert sync.writes == 2 and timings["attempts"] == 2
    out = capsys.readouterr().out
    assert "version 1 refused" in out and "stage validate" in out and "has no 'hmac'" in out
    assert engine.worker.bapo_version == 1
    _served_equals(engine, model)  # the trainer's weights, not the forger's
    manifest = ws.read_manifest(ws.version_dir(sync_root / "sync", 1))
    assert manifest_auth.manifest_hmac(manifest, key) == manifest["hmac"]


def test_a_worker_with_the_secret_refuses_unsigned_versions_and_takes_signed_ones(
    model, sync_root, tmp_path_factory, monkeypatch
):
    """A trainer that forgot the key is refused every time (nothing is served from it); the
    key never lands in the sync directory; a key that is no key is refused up front."""
    key = _run_secret(tmp_path_factory, monkeypatch)
    engine = _Engine(CONFIG)
    unsigned = OrbaxSync(str(sync_root), CONFIG, engine, attempts=2)
    with pytest.raises(WeightSyncError, match="has no 'hmac'"):
        unsigned.update_weights(1, _state(model), step=1)
    assert engine.worker.bapo_version is None and engine.worker.model_runner.weights == {}
    signed = OrbaxSync(str(sync_root), CONFIG, engine, manifest_key=key)
    assert signed.update_weights(2, _state(model), step=2)["attempts"] == 1
    _served_equals(engine, model)
    for d, _, names in os.walk(sync_root):
        for name in names:
            with open(os.path.join(d, name), "rb") as f:
                data = f.read()
            assert key not in data and key.hex().encode() not in data, name
    with pytest.raises(ValueError, match="manifest_key must be bytes of length >= 16"):
        OrbaxSync(str(sync_root), CONFIG, engine, manifest_key="not bytes")
