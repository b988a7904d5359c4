"""In-flight weight updates (`offpolicy.inflight`): the loop loads version i + 1 while the next
batch is still generating; what it measures of that overlap; the teacher log-probs under each
token's own version; and the refusals where in-flight updates cannot work."""

from __future__ import annotations

import json
import os
import threading

import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.rollout.types import Rollout, Sample
from bapo_jax.train import overlap
from bapo_jax.train.behaviour import TeacherLogprobs
from bapo_jax.train.config import OffPolicyConfig
from bapo_jax.train.producer import RolloutProducer
from tests.train.loop_fixtures import make_trainer, small_config


def test_hidden_generation_sums_the_overlap_with_every_update():
    """Two batches generating over three iterations' updates (hand-computed)."""
    batches = [
        type("B", (), {"generation_spans": [(0.0, 4.0)]}),
        type("B", (), {"generation_spans": [(5.0, 6.0), (7.0, 11.0)]}),
    ]
    updates = [(1.0, 2.0), (3.0, 5.5), (8.0, 9.0)]
    # hidden: [0, 4] meets [1, 2] (1) and [3, 5.5] (1); [5, 6] meets [3, 5.5] (0.5);
    # [7, 11] meets [8, 9] (1): 3.5 of 9 generated seconds.
    got = overlap.hidden_generation(batches, updates)
    assert got == {
        "overlap/generation_s": 9.0,
        "overlap/hidden_s": 3.5,
        "overlap/hidden_share": 3.5 / 9,
    }
    one = overlap.hidden_generation(batches[:1], updates[1:2])  # the drained loop's one window
    assert one["overlap/hidden_s"] == 1.0
    assert overlap.hidden_generation([], updates) == {}


def _fake_logprob_fn(params, ids, mask):
    """log-prob of every position = the params' one scalar (so each version is recognisable)."""
    return jnp.full(ids.shape, params["v"], jnp.float32) * mask, None


def test_the_teacher_keeps_the_last_k_plus_1_versions():
    teacher = TeacherLogprobs(_fake_logprob_fn, width=8, pad_id=0, keep=2)
    for version in range(3):
        teacher.remember(version, {"v": jnp.float32(-version - 1)})
    contexts, tokens = [[1, 2]], [np.asarray([3, 4, 5], np.int32)]
    assert np.isnan(teacher(0, contexts, tokens)[0]).all()  # dropped: only 1 and 2 are kept
    np.testing.assert_array_equal(teacher(1, contexts, tokens)[0], [-2, -2, -2])
    np.testing.assert_array_equal(teacher(2, contexts, tokens)[0], [-3, -3, -3])


def test_teacher_logprobs_follow_each_tokens_reported_version():
    """A response whose tail a later version sampled is checked against that version's
    params token by token; an unknown tag (-1) is left out (NaN). Each version's pass scores
    only the rows that hold tokens of it."""
    calls = []

    def teacher(version, contexts, new_tokens):
        calls.append((version, [len(t) for t in new_tokens]))
        return [np.full(len(t), float(version), np.float32) for t in new_tokens]

    producer = RolloutProducer.__new__(RolloutProducer)
    producer.teacher = teacher
    samples = (
        Sample(0, 0, np.asarray([5, 6, 7, 8], np.int32), np.zeros(4, np.float32),
               np.asarray([3, 3, 4, -1]), "length"),
        Sample(0, 1, np.asarray([9, 9], np.int32), np.zeros(2, np.float32),
               np.asarray([4, 4]), "stop"),
    )  # fmt: skip
    out = producer._teacher(Rollout(((1, 2),), 2, samples), [(1, 2), (1, 2)])
    assert calls == [(3, [4]), (4, [4, 2])]  # one pass per version, over its rows
    np.testing.assert_array_equal(out[0], [3, 3, 4, np.nan])
    np.testing.assert_array_equal(out[1], [4, 4])


def test_inflight_is_refused_where_it_cannot_work(tmp_path):
    with pytest.raises(ValueError, match="inflight must be a bool, got 'yes'"):
        OffPolicyConfig(inflight="yes")
    config = small_config(steps=2, offpolicy=OffPolicyConfig(staleness=1, inflight=True))
    with pytest.raises(ValueError, match=r"offpolicy\.inflight: .* need an engine outside"):
        make_trainer(config, tmp_path)  # the embedded engine


class _RemoteLike:
    """The embedded engine seen from the loop as a remote one (not an `EmbeddedEngine`, so the
    loop treats it as vLLM). Its second generation call (batch 1) holds until `gate` is set,
    and records whether the sync of version 1 happened meanwhile."""

    restarted = ()

    def __init__(self, engine):
        self.inner, self.calls, self.gate = engine, 0, threading.Event()
        self.synced_while_generating = False

    @property
    def policy_version(self) -> int:
        return self.inner.policy_version

    def server_versions(self):
        return {}

    def generate(self, *args, **kwargs):
        self.calls += 1
        if self.calls == 2:
            assert self.gate.wait(timeout=120), "version 1 was never synced: the loop drained"
            self.synced_while_generating = True
        return self.inner.generate(*args, **kwargs)


class _Weights:
    """The embedded engine's own update, opening the gate once version 1 is loaded; `wrap`
    makes the loop's engine (`make_trainer(wrap=...)`)."""

    remote: _RemoteLike

    def wrap(self, engine) -> _RemoteLike:
        self.remote = _RemoteLike(engine)
        return self.remote

    def begin_update(self, version, params, *, step):
        return self.remote.inner.begin_update(version, params, step=step)

    def finish_update(self, handle, generating_until=None):
        timings = self.remote.inner.finish_update(handle, generating_until)
        if handle.version == 1:
            self.remote.gate.set()
        return timings

    def update_weights(self, version, params, *, step=0):
        return self.finish_update(self.begin_update(version, params, step=step))


def test_the_loop_syncs_while_the_next_batch_generates(tmp_path):
    """k = 1, in flight: version 1 is loaded while batch 1 is still generating (its engine
    call holds until then: with a drain the run would stall), batch 1 is then sampled by
    version 1, and the rows read back from metrics.jsonl show no drain before that sync, a
    staleness within k and no token older than scheduled."""
    config = small_config(steps=3, offpolicy=OffPolicyConfig(staleness=1, inflight=True))
    weights = _Weights()
    make_trainer(config, tmp_path, wrap=weights.wrap, weights=weights).run()
    assert weights.remote.synced_while_generating
    with open(os.path.join(tmp_path, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["sync/engine_version"] for r in rows] == [1, 2, 3]
    assert rows[0]["time/drain_rollout"] < 0.05  # iteration 0 ends without a checkpoint
    for r in rows:
        assert r["staleness/max"] <= 1 and r["version_mismatch/tokens"] == 0
    assert rows[1]["staleness/max"] == 0  # batch 1 was sampled by version 1, not 0
