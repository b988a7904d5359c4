"""Run checkpoints: bit-exact round trips, resharding restore, keep-N, and SIGKILL safety.

Run as a script (``python -m tests.train.test_checkpoint MODE DIR``) this module is the child
process the kill tests start and SIGKILL.
"""

from __future__ import annotations

import functools
import os
import signal
import stat
import subprocess
import sys
import time

import chex
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from bapo_jax.models import Qwen2Config
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.train import optim
from bapo_jax.train.checkpoint import RunCheckpointer, with_shardings
from bapo_jax.train.state import abstract_train_state, init_train_state, state_shardings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = Qwen2Config.preset("tiny")
OPTIMIZER = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=2))
TMP_SUFFIX = ".orbax-checkpoint-tmp"


@functools.cache
def _fresh_state():
    return init_train_state(CONFIG, OPTIMIZER, seed=0)[1]


def make_state(step: int):
    """A TrainState with params from init and random (non-zero) optimizer moments, so every
    leaf carries information; deterministic in `step`."""
    rng = np.random.default_rng(step)
    leaves, treedef = jax.tree.flatten(_fresh_state())
    out = []
    for x in leaves:
        if jnp.issubdtype(x.dtype, jnp.floating):
            noise = rng.standard_normal(x.shape).astype(x.dtype)
            out.append(x + jnp.asarray(noise))
        else:
            out.append(jnp.full(x.shape, step, x.dtype))
    return jax.tree.unflatten(treedef, out)


def make_host(step: int) -> dict:
    return {
        "iteration": step,
        "data": {"epoch": 1, "position": [step, 17], "exhausted": False},
        "seeds": {"rollout": 1234 + step},
        "config": {"optimizer": {"learning_rate": 1e-6, "max_grad_norm": None}, "name": "run"},
        "ratio": 0.125,
    }


def make_arrays(step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + step)
    return {
        "queue/token_ids.0": rng.integers(0, 2**40, size=(3, 7), dtype=np.int64),
        "queue/finished": rng.random(3) < 0.5,
        "partial/behavior_logp": rng.standard_normal((2, 5)).astype(np.float32),
        "partial/versions": np.arange(10, dtype=np.uint8).reshape(2, 5),
        "replay/empty": np.zeros((0, 4), np.int32),
        "scalar": np.asarray(step * 0.5, np.float64),
        "bf16": rng.standard_normal(4).astype(ml_dtypes.bfloat16),
    }


def assert_arrays_equal(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype, name
        chex.assert_shape(got[name], value.shape)
        np.testing.assert_array_equal(got[name], value, err_msg=name)


def assert_state_equal(got, want) -> None:
    chex.assert_trees_all_equal_structs(got, want)
    assert jax.tree.structure(got) == jax.tree.structure(want)
    chex.assert_trees_all_equal(jax.device_get(got), jax.device_get(want))


def _abstract():
    return abstract_train_state(CONFIG, OPTIMIZER)[1]


def _mesh(name: str):
    cfg = mesh_lib.mesh_preset(name)
    return mesh_lib.make_mesh(cfg, jax.devices()[: cfg.num_devices])


# ---- in-process tests --------------------------------------------------------------------------
def test_round_trip_is_bit_exact_and_keeps_param_metadata(tmp_path):
    state, host, arrays = make_state(3), make_host(3), make_arrays(3)
    with RunCheckpointer(tmp_path, keep=3, async_save=True) as ckpt:
        assert ckpt.latest_step() is None
        ckpt.save(3, state, host, arrays)
        ckpt.wait()
        assert ckpt.latest_step() == 3
        got_state, got_host, got_arrays = ckpt.restore(3, _abstract())
    assert_state_equal(got_state, state)
    assert isinstance(got_state.params, nnx.State)
    assert got_host == host
    assert_arrays_equal(got_arrays, arrays)
    # The Params' logical axes survived: state_shardings reads them from the restored tree.
    mesh = _mesh("cpu-fsdp8")
    got_shardings = jax.tree.leaves(state_shardings(got_state, mesh))
    assert got_shardings == jax.tree.leaves(state_shardings(state, mesh))
    assert any(s.spec != jax.sharding.PartitionSpec() for s in got_shardings)


def test_sync_save_is_complete_when_save_returns(tmp_path):
    with RunCheckpointer(tmp_path, keep=1, async_save=False) as ckpt:
        ckpt.save(0, make_state(0), make_host(0), {})
        assert ckpt.latest_step() == 0
        _, host, arrays = ckpt.restore(0, _abstract())
    assert host == make_host(0)
    assert arrays == {}


def test_restore_into_sharded_targets_without_retracing(tmp_path):
    fsdp8 = _mesh("cpu-fsdp8")
    abstract = _abstract()
    shardings8 = state_shardings(abstract, fsdp8)
    state = jax.device_put(make_state(5), shardings8)
    with RunCheckpointer(tmp_path) as ckpt:
        ckpt.save(5, state, make_host(5), make_arrays(5))
        ckpt.wait()
        same, _, _ = ckpt.restore(5, with_shardings(abstract, shardings8))
        mixed = _mesh("cpu-fsdp4-tp2")
        shardings_mixed = state_shardings(abstract, mixed)
        resharded, _, _ = ckpt.restore(5, with_shardings(abstract, shardings_mixed))

    assert_state_equal(same, state)
    assert_state_equal(resharded, state)
    for got, target, mesh in ((same, shardings8, fsdp8), (resharded, shardings_mixed, mixed)):
        want = jax.tree.leaves(target)
        assert [x.sharding for x in jax.tree.leaves(got)] == want
        assert jax.tree.leaves(state_shardings(got, mesh)) == want  # Param metadata survived
    # a sharded Param really is split: fsdp4 x tp2 shards of q_proj are 1/8 of it
    q_proj = resharded.params["layers"]["q_proj"].get_value()
    assert q_proj.addressable_shards[0].data.size * 8 == q_proj.size

    traces = []

    @jax.jit
    def step_fn(s):
        traces.append(1)
        return jax.tree.map(lambda x: x + 1 if jnp.issubdtype(x.dtype, jnp.floating) else x, s)

    jax.block_until_ready(step_fn(state))
    jax.block_until_ready(step_fn(same))
    assert len(traces) == 1


def test_keep_n_removes_older_steps(tmp_path):
    state = make_state(1)
    with RunCheckpointer(tmp_path, keep=2) as ckpt:
        for step in (1, 2, 3, 4):
            ckpt.save(step, state, make_host(step), make_arrays(step))
        ckpt.wait()
        assert ckpt.all_steps() == [3, 4]
        assert sorted(os.listdir(tmp_path)) == ["3", "4"]
        with pytest.raises(ValueError, match=r"step 1 .*complete steps: \[3, 4\]"):
            ckpt.restore(1, _abstract())
        _, host, arrays = ckpt.restore(3, _abstract())
    assert host == make_host(3)
    assert_arrays_equal(arrays, make_arrays(3))


def test_save_snapshots_its_inputs(tmp_path):
    """After save returns, device buffers may be deleted (donated) and host arrays reused."""
    want_state, want_arrays = make_state(2), make_arrays(2)
    state = jax.tree.map(jnp.copy, want_state)
    arrays = {k: v.copy() for k, v in want_arrays.items()}
    host = make_host(2)
    with RunCheckpointer(tmp_path) as ckpt:
        ckpt.save(2, state, host, arrays)
        for x in jax.tree.leaves(state):
            x.delete()
        for value in arrays.values():
            value[...] = 0
        host["iteration"] = -1
        ckpt.wait()
        got_state, got_host, got_arrays = ckpt.restore(2, _abstract())
    assert_state_equal(got_state, want_state)
    assert got_host == make_host(2)
    assert_arrays_equal(got_arrays, want_arrays)


def test_a_created_directory_is_owner_only_unless_asked_otherwise(tmp_path):
    """The checkpoint holds the whole model: a directory the checkpointer creates (parents
    included) gets exactly ``dir_mode`` whatever the umask, 0o700 by default; an existing one
    keeps its mode; a mode that is no permission mode is refused."""
    old_umask = os.umask(0o002)  # would leave a plain mkdir group-writable and world-readable
    try:
        with RunCheckpointer(tmp_path / "run" / "checkpoints", async_save=False) as ckpt:
            ckpt.save(1, make_state(1), make_host(1), {})
        with RunCheckpointer(tmp_path / "shared", async_save=False, dir_mode=0o750):
            pass
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "checkpoints").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(tmp_path / "shared").st_mode) == 0o750
    existing = tmp_path / "existing"
    existing.mkdir()
    existing.chmod(0o755)
    with RunCheckpointer(existing, async_save=False):
        pass
    assert stat.S_IMODE(os.stat(existing).st_mode) == 0o755
    with pytest.raises(ValueError, match="dir_mode must be a permission mode like 0o700"):
        RunCheckpointer(tmp_path / "bad", dir_mode="700")
    assert not (tmp_path / "bad").exists()


def test_bad_inputs_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="keep must be an int >= 1, got 0"):
        RunCheckpointer(tmp_path, keep=0)
    state = make_state(1)
    with RunCheckpointer(tmp_path) as ckpt:
        with pytest.raises(ValueError, match=r"host\['data'\]\['position'\] is a tuple"):
            ckpt.save(1, state, {"data": {"position": (1, 2)}}, {})
        with pytest.raises(ValueError, match="host has a non-str key 3"):
            ckpt.save(1, state, {3: "x"}, {})
        with pytest.raises(ValueError, match=r"arrays\['names'\] has dtype <U1"):
            ckpt.save(1, state, {}, {"names": np.asarray(["a"])})
        with pytest.raises(ValueError, match=r"arrays\['x'\] must be a host numpy array"):
            ckpt.save(1, state, {}, {"x": jnp.zeros(3)})
        ckpt.save(1, state, {}, {})
        with pytest.raises(ValueError, match="step 1 is not newer than the last saved step 1"):
            ckpt.save(1, state, {}, {})
        ckpt.wait()
        wrong = abstract_train_state(Qwen2Config.preset("tiny-hd64"), OPTIMIZER)[1]
        with pytest.raises(ValueError, match=r"does not match the restore target.*embed_tokens"):
            ckpt.restore(1, wrong)
        with pytest.raises(ValueError, match=r"no complete checkpoint for step 7.*\[1\]"):
            ckpt.restore(7, _abstract())


# ---- SIGKILL tests -----------------------------------------------------------------------------
BIG_ARRAYS_MB = 384  # incompressible bytes, so the save of step 2 takes a while


def _start_child(mode: str, directory) -> subprocess.Popen:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, "-m", "tests.train.test_checkpoint", mode, os.fspath(directory)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _check_resumable(directory, expect_step: int) -> None:
    """A fresh checkpointer sees `expect_step` as latest and restores it exactly, and can save
    the next step; by then the temp dir of the killed save is gone."""
    with RunCheckpointer(directory) as ckpt:
        assert ckpt.latest_step() == expect_step
        state, host, arrays = ckpt.restore(expect_step, _abstract())
        assert_state_equal(state, make_state(expect_step))
        assert host == make_host(expect_step)
        assert_arrays_equal(arrays, make_arrays(expect_step))
        ckpt.save(expect_step + 1, make_state(4), make_host(4), make_arrays(4))
        ckpt.wait()
        assert ckpt.latest_step() == expect_step + 1
        assert not [n for n in os.listdir(directory) if TMP_SUFFIX in n]
        state, host, _ = ckpt.restore(expect_step + 1, _abstract())
    assert_state_equal(state, make_state(4))
    assert host == make_host(4)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_sigkill_mid_save_leaves_previous_step_latest(tmp_path):
    child = _start_child("mid-save", tmp_path)
    deadline = time.monotonic() + 180
    try:
        while not any(n.startswith("2" + TMP_SUFFIX) for n in os.listdir(tmp_path)):
            assert child.poll() is None, child.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the child never started saving step 2"
            time.sleep(0.001)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.communicate()
    assert child.returncode == -signal.SIGKILL
    names = os.listdir(tmp_path)
    # the kill landed mid-save: step 2 exists only as Orbax's temp dir
    assert "2" not in names and any(n.startswith("2" + TMP_SUFFIX) for n in names), names
    _check_resumable(tmp_path, expect_step=1)


def test_sigkill_after_save_returned_keeps_a_complete_step(tmp_path):
    """Killed after save(2) returned, before wait(): step 2 is all there or not at all."""
    child = _start_child("after-save-returned", tmp_path)
    _, err = child.communicate(timeout=300)
    assert child.returncode == -signal.SIGKILL, err[-3000:]
    with RunCheckpointer(tmp_path) as ckpt:
        latest = ckpt.latest_step()
    assert latest in (1, 2)
    _check_resumable(tmp_path, expect_step=latest)


def _child(mode: str, directory: str) -> None:
    ckpt = RunCheckpointer(directory, keep=3, async_save=True)
    ckpt.save(1, make_state(1), make_host(1), make_arrays(1))
    ckpt.wait()
    arrays = make_arrays(2)
    if mode == "mid-save":
        rng = np.random.default_rng(0)
        for i in range(BIG_ARRAYS_MB // 16):
            arrays[f"replay/{i}"] = rng.integers(0, 2**63, size=2**21, dtype=np.int64)
    ckpt.save(2, make_state(2), make_host(2), arrays)
    if mode == "after-save-returned":
        os.kill(os.getpid(), signal.SIGKILL)
    ckpt.wait()
    time.sleep(600)  # the parent kills us; finishing here would fail its mid-save assertion


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
