"""Multi-host RL loop: two processes x 2 CPU devices (jax.distributed on localhost, gloo) run
two RL iterations of the toy task on the embedded engine and match the single-process run on
4 devices: the same metrics rows, final params and checkpoint; only process 0 wrote metrics."""

from __future__ import annotations

import json
import os

import chex
import jax
import numpy as np
import pytest

from bapo_jax.train.checkpoint import RunCheckpointer
from tests import multihost_launch
from tests.train import multihost_loop_worker as worker

NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
TIMEOUT_S = 600
# Wall-clock measurements (and per-process compile counts): they differ between any two runs.
_TIMING_PREFIXES = ("time/", "overlap/", "compile/")  # compile/: per-process counts
_TIMING_KEYS = ("tokens_per_s", "model_flops_per_s", "mfu")
METRIC_FILES = ("metrics.jsonl", "summary.json", "tb", "plots")


def _rows(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [
        {
            k: v
            for k, v in row.items()
            if not k.startswith(_TIMING_PREFIXES) and k not in _TIMING_KEYS
        }
        for row in rows
    ]


def _without_timings(host: dict) -> dict:
    """The host dict of a checkpoint minus the run's paths and the queued batches' timings."""
    host = {k: v for k, v in host.items() if k != "config"}
    host["queue"] = {
        j: {**q, "metrics": {k: v for k, v in q["metrics"].items() if not k.startswith("time/")}}
        for j, q in host["queue"].items()
    }
    return host


@pytest.mark.slow
def test_two_processes_run_the_rl_loop_like_one(tmp_path):
    out = tmp_path / "multi"
    out.mkdir()
    procs = multihost_launch.start(
        os.path.abspath(worker.__file__),
        ["--out", str(out)],
        num_processes=NUM_PROCESSES,
        devices_per_process=DEVICES_PER_PROCESS,
    )
    try:  # the reference on this process's first 4 devices runs meanwhile
        devices = jax.devices()[: NUM_PROCESSES * DEVICES_PER_PROCESS]
        ref = worker.build_trainer(str(tmp_path / "ref"), str(tmp_path / "ref_ckpt"), devices)
        ref.run()
    finally:
        results = multihost_launch.wait(procs, TIMEOUT_S)
    multihost_launch.check_all_succeeded(results)
    ref_params = worker.flat_params(jax.device_get(ref.state.params))

    # Metrics: written by process 0 alone, row for row the single-process run's.
    for name in METRIC_FILES:
        assert not os.path.exists(out / "run.1" / name), f"process 1 wrote {name}"
    got_rows, ref_rows = _rows(out / "run.0"), _rows(tmp_path / "ref")
    assert [r["step"] for r in got_rows] == list(range(worker.STEPS))
    assert got_rows[-1]["kl_ref"] > 0  # the policy moved away from its frozen reference
    assert [sorted(r) for r in got_rows] == [sorted(r) for r in ref_rows]
    for got, want in zip(got_rows, ref_rows, strict=True):
        # Bounds come from a grid and counts are integers: equal, not merely close.
        exact = ("c_low", "c_high", "c_low/last", "c_high/last", "reward/mean", "optimizer_step")
        for key in exact:
            assert got.get(key) == want.get(key), (got["step"], key, got.get(key), want.get(key))
        chex.assert_trees_all_close(got, want, atol=1e-5, rtol=1e-4)
    assert os.path.exists(out / "run.0" / "summary.json")
    assert os.listdir(out / "run.0" / "tb") and os.listdir(out / "run.0" / "plots")

    # Final params: every process holds the same global params, those of the single run.
    for i in range(NUM_PROCESSES):
        with np.load(out / f"result.{i}.npz") as f:
            got = dict(f)
        assert int(got["meta/process_count"]) == NUM_PROCESSES
        assert int(got["meta/device_count"]) == NUM_PROCESSES * DEVICES_PER_PROCESS
        assert int(got["meta/local_device_count"]) == DEVICES_PER_PROCESS
        assert int(got["meta/optimizer_step"]) == int(ref.state.step)
        params = {k.removeprefix("params/"): v for k, v in got.items() if k.startswith("params/")}
        assert sorted(params) == sorted(ref_params)
        chex.assert_trees_all_close(params, ref_params, atol=1e-5, rtol=1e-4)

    # The checkpoint both processes wrote restores here to the single run's state and host data.
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), ref.state
    )
    with (
        RunCheckpointer(out / "checkpoints") as multi_ckpt,
        RunCheckpointer(tmp_path / "ref_ckpt") as ref_ckpt,
    ):
        assert multi_ckpt.all_steps() == ref_ckpt.all_steps() == [worker.STEPS]
        state, host, arrays = multi_ckpt.restore(worker.STEPS, abstract)
        _, ref_host, ref_arrays = ref_ckpt.restore(worker.STEPS, abstract)
    chex.assert_trees_all_close(
        worker.flat_params(jax.device_get(state.params)), ref_params, atol=1e-5, rtol=1e-4
    )
    assert _without_timings(host) == _without_timings(ref_host)
    assert sorted(arrays) == sorted(ref_arrays)
    for name in arrays:
        np.testing.assert_array_equal(arrays[name], ref_arrays[name], err_msg=name)


# ---- the helpers on one process (no collective is issued) ---------------------------------------
def _batch():
    from bapo_jax.data.pipeline import PromptExample
    from bapo_jax.train.buffers import new_group
    from bapo_jax.train.producer import ProducedBatch

    groups = []
    for uid in range(2):
        g = new_group(uid, 3, PromptExample(uid, f"p{uid}", "", "parity", (), (5, 6, 7)), 2)
        for k, r in enumerate(g.responses):
            n = 2 + k
            r.extend(
                np.arange(n, dtype=np.int32),
                np.linspace(-1.0, -0.1, n, dtype=np.float32),
                np.full(n, 3, np.int64),
                "stop",
                scheduled_version=3,
            )
        g.rewards = np.asarray([1.0, 0.0], np.float32)
        g.advantages = np.asarray([0.70710677, -0.70710677], np.float32)
        groups.append(g)
    return ProducedBatch(3, groups, [True, False], {"rollout/rounds": 1}, [(1.5, 2.5)])


def test_broadcast_batch_round_trips_on_one_process():
    from bapo_jax.train import multihost

    batch = _batch()
    got = multihost.broadcast_batch(batch)
    assert (got.index, got.active, got.metrics) == (3, [True, False], {"rollout/rounds": 1})
    assert got.generation_spans == [(1.5, 2.5)]
    for g, want in zip(got.groups, batch.groups, strict=True):
        assert (g.uid, g.prompt_ids, g.answer) == (want.uid, want.prompt_ids, want.answer)
        np.testing.assert_array_equal(g.rewards, want.rewards)
        np.testing.assert_array_equal(g.advantages, want.advantages)
        for r, w in zip(g.responses, want.responses, strict=True):
            for field in ("token_ids", "logprobs", "versions"):
                np.testing.assert_array_equal(getattr(r, field), getattr(w, field))
            assert r.finish_reason == w.finish_reason


def test_broadcast_helpers_on_one_process():
    from bapo_jax.train import multihost

    assert multihost.broadcast_bytes(b"") == b""
    assert multihost.broadcast_bytes(b"abc" * 100) == b"abc" * 100
    with pytest.raises(ValueError, match="process 0 must broadcast bytes, got str"):
        multihost.broadcast_bytes("abc")
    meta, arrays = multihost.broadcast_state({"a": [1, None]}, {"x/y": np.arange(3.0)})
    assert meta == {"a": [1, None]}
    np.testing.assert_array_equal(arrays["x/y"], np.arange(3.0))
    rewards = multihost.primary_rewards(lambda: [1.0, 0.0, 1.0, 1.0], (2, 2))
    np.testing.assert_array_equal(rewards, [[1.0, 0.0], [1.0, 1.0]])
    with pytest.raises(ValueError, match="reward_fn returned 3 rewards, expected \\(2, 2\\)"):
        multihost.primary_rewards(lambda: [1.0, 0.0, 1.0], (2, 2))


def test_broadcast_bytes_goes_in_chunks_of_bounded_programs(monkeypatch):
    """Payloads over one chunk (1 GiB; here 16 bytes) go as several broadcasts: an 8-byte
    length (2^31 bytes and more fit), full chunks, the last padded to a power of two."""
    from jax.experimental import multihost_utils

    from bapo_jax.sharding import distributed

    shapes = []
    real = multihost_utils.broadcast_one_to_all
    monkeypatch.setattr(distributed, "_CHUNK_BYTES", 16)
    monkeypatch.setattr(
        multihost_utils, "broadcast_one_to_all", lambda x: shapes.append(x.shape) or real(x)
    )
    data = bytes(range(37))
    assert distributed.broadcast_bytes(data) == data
    assert shapes == [(8,), (16,), (16,), (8,)]  # length, 16 + 16 + 5 (padded to 8)


def test_roles_and_inline_executor():
    from bapo_jax.train import multihost
    from bapo_jax.train.config import LoggingConfig
    from tests.train.loop_fixtures import small_config

    single = multihost.Roles(1, 0, engine_spans_processes=False)
    assert single.produces and single.evaluates and single.primary
    assert not (single.multi or single.inline_generation or single.broadcast_batches)
    remote_follower = multihost.Roles(2, 1, engine_spans_processes=False)
    assert not (remote_follower.produces or remote_follower.evaluates)
    assert remote_follower.broadcast_batches
    embedded_follower = multihost.Roles(2, 1, engine_spans_processes=True)
    assert embedded_follower.produces and embedded_follower.inline_generation
    assert not embedded_follower.broadcast_batches
    config = small_config(logging=LoggingConfig(logprob_agreement=True, progress=False))
    single.check(config)
    with pytest.raises(ValueError, match="logprob_agreement=True is not supported"):
        embedded_follower.check(config)

    executor = multihost.InlineExecutor()
    assert executor.submit(lambda x: x + 1, 2).result() == 3
    failed = executor.submit(lambda: 1 / 0)
    assert failed.done()
    with pytest.raises(ZeroDivisionError):
        failed.result()


def test_a_follower_has_no_vllm_client_and_gathers_whole_arrays():
    """A process other than 0 of a vLLM run gets a `FollowerEngine` from `run.build` (no
    client, no server launched: process 0 alone talks to the servers); it counts as a remote
    engine and any use but the weight sync names the mistake. `to_host` returns the whole array
    (on one process, a copy; across processes the all-gather runs in the two-process test,
    through the KL reference's log-probs)."""
    from bapo_jax.rollout.orbax_sync import FollowerEngine
    from bapo_jax.train import multihost

    engine = FollowerEngine()
    assert engine.servers == [] and engine.restarted == () and engine.policy_version == 0
    assert engine.server_versions() == {}  # process 0 asks the servers
    with pytest.raises(AttributeError):  # no forwarding: only what the engine declares
        engine.load_weights  # noqa: B018
    assert not multihost.roles_for(engine).engine_spans_processes
    with pytest.raises(RuntimeError, match=r"engine\.generate called on process 0: only process 0"):
        engine.generate([[1, 2]], 1)
    x = jax.numpy.arange(12.0).reshape(3, 4)
    got = multihost.to_host(x)
    assert isinstance(got, np.ndarray)
    np.testing.assert_array_equal(got, np.arange(12.0).reshape(3, 4))
