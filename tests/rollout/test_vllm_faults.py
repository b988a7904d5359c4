"""Fault handling of the vLLM client against scripted local servers (tests/rollout/fake_vllm.py):
connection refused, 502/503, 4xx, timeouts, resets (a restart), aborts, a server left paused,
and weight loads that fail at each stage. Every case ends in a retry that succeeds or a clear
error, and no prompt is lost."""

from __future__ import annotations

import json
import os
import socket
import threading
import time

import numpy as np
import pytest

from bapo_jax.models import PRESETS
from bapo_jax.rollout import weight_sync as ws
from bapo_jax.rollout.types import SamplingParams
from bapo_jax.rollout.vllm_client import (
    RolloutRequestError,
    ServerUnavailableError,
    VLLMClientConfig,
    VLLMEngine,
    WeightSyncError,
    prompt_seed,
)

from .fake_vllm import FakeVLLM, expected_ids

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12], [13]]
SAMPLING = SamplingParams(max_tokens=5, temperature=1.0)
CONFIG = PRESETS["tiny"]


@pytest.fixture
def fakes():
    servers = [FakeVLLM(), FakeVLLM()]
    yield servers
    for s in servers:
        s.close()


def _dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _engine(urls, **kw) -> VLLMEngine:
    kw = {
        "backoff_s": 0.01,
        "backoff_max_s": 0.05,
        "request_timeout_s": 5.0,
        "deadline_s": 30.0,
        "connect_timeout_s": 1.0,
        **kw,
    }
    return VLLMEngine(
        VLLMClientConfig(tuple(urls), model="m", **kw),
        expected_config=CONFIG,
        initial_checkpoint="/good/v0",
    )


def _assert_complete(rollout, n=2, seed=0, version=0):
    """Every prompt is there with exactly the tokens the fake samples for it."""
    assert len(rollout.samples) == len(PROMPTS) * n
    for s in rollout.samples:
        prompt = PROMPTS[s.prompt_index]
        want = expected_ids(
            prompt, prompt_seed(seed, s.prompt_index), s.sample_index, SAMPLING.max_tokens
        )
        np.testing.assert_array_equal(s.token_ids, want)
        np.testing.assert_allclose(s.logprobs, -(np.arange(len(want)) + 1) / 10, rtol=1e-6)
        np.testing.assert_array_equal(s.versions, np.full(len(want), version))


def _manifest_dir(tmp_path, version: int) -> str:
    """A version directory with a valid manifest (the fakes never read the tensors)."""
    d = ws.version_dir(tmp_path, version)
    os.makedirs(d, exist_ok=True)
    shapes = ws.expected_param_shapes(CONFIG)
    manifest = {
        "format": ws.ORBAX_FORMAT, "version": version, "step": version, "dtype": "bfloat16",
        "config": CONFIG.to_hf_dict(), "digest": "0" * 32,
        "params": {k: {"shape": list(v), "dtype": "bfloat16"} for k, v in shapes.items()},
    }  # fmt: skip
    with open(os.path.join(d, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    return d


def test_requests_spread_over_servers_with_pooled_connections(fakes):
    eng = _engine([f.url for f in fakes], max_inflight_per_server=2)
    rollout = eng.generate(PROMPTS * 3, 2, SAMPLING, seed=0)
    assert len(rollout.samples) == 3 * len(PROMPTS) * 2
    counts = [f.count("/v1/completions") for f in fakes]
    assert sum(counts) == 3 * len(PROMPTS) and min(counts) >= 3, counts
    for f, c in zip(fakes, counts, strict=True):
        assert f.connections <= 2 < c  # keep-alive: at most the pool size per server
    eng.close()


def test_every_sampling_field_explicit_and_per_prompt_seeds(fakes):
    eng = _engine([fakes[0].url])
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0))
    bodies = sorted(fakes[0].bodies("/v1/completions"), key=lambda b: b["prompt"][0])
    for body in bodies:
        p = PROMPTS.index(body["prompt"][0])
        assert body["seed"] == prompt_seed(0, p)
        assert body["max_tokens"] == 5 and body["n"] == 2 and body["logprobs"] == 0
        assert body["return_token_ids"] is True and body["return_tokens_as_token_ids"] is True
        for key, value in SAMPLING.to_vllm().items():
            assert body[key] == value, key
    assert len({b["seed"] for b in bodies}) == len(PROMPTS)


def test_connection_refused_goes_to_another_server(fakes):
    eng = _engine([_dead_url(), fakes[0].url])
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0))
    assert fakes[0].count("/v1/completions") == len(PROMPTS)


def test_all_servers_refusing_is_a_clear_bounded_error():
    eng = _engine([_dead_url(), _dead_url()], max_attempts=3)
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=r"after 3 attempts.*connection error"):
        eng.generate(PROMPTS[:2], 1, SAMPLING, seed=0)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("status", ["503", "502"])
def test_retryable_status_then_success(fakes, status):
    fakes[0].plan = [status, status]
    eng = _engine([fakes[0].url])
    _assert_complete(eng.generate(PROMPTS[:1] * 0 + PROMPTS, 2, SAMPLING, seed=0))
    assert fakes[0].count("/v1/completions") == len(PROMPTS) + 2


@pytest.mark.parametrize("status", ["400", "500"])
def test_4xx_and_500_are_never_retried(fakes, status):
    fakes[0].plan = [status]
    eng = _engine([fakes[0].url])
    with pytest.raises(RolloutRequestError, match=f"HTTP {status}"):
        eng.generate(PROMPTS[:1], 2, SAMPLING, seed=0)
    assert fakes[0].count("/v1/completions") == 1


def test_timeout_is_retried(fakes):
    fakes[0].plan = ["sleep:1.5"]
    eng = _engine([fakes[0].url], request_timeout_s=0.4)
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0))
    assert fakes[0].count("/v1/completions") == len(PROMPTS) + 1


def test_request_lost_to_a_restart_is_resubmitted(fakes):
    fakes[0].plan = ["reset", "ok", "reset"]
    eng = _engine([fakes[0].url])
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0))
    assert fakes[0].count("/v1/completions") == len(PROMPTS) + 2


def test_server_left_paused_by_a_crashed_trainer_is_resumed(fakes):
    fakes[0].paused = True  # the crashed trainer never called /resume
    eng = _engine([fakes[0].url], request_timeout_s=0.5)
    _assert_complete(eng.generate(PROMPTS[:2] + PROMPTS[2:], 2, SAMPLING, seed=0))
    assert not fakes[0].paused and fakes[0].count("/resume") == 1
    assert fakes[0].count("/reset_prefix_cache") == 1
    assert fakes[0].bodies("/update_weight_version")[-1] == {"new_version": "0"}


def test_paused_and_poisoned_server_reloads_last_good_before_resuming(fakes):
    fakes[0].paused, fakes[0].poisoned = True, True
    eng = _engine([fakes[0].url])
    assert eng.recover() == [fakes[0].url]
    loads = [
        json.loads(b["args"][0])
        for b in fakes[0].bodies("/collective_rpc")
        if b["method"] == "bapo_load"
    ]
    assert loads == [{"path": "/good/v0", "version": 0}]
    assert not fakes[0].paused and not fakes[0].poisoned


@pytest.mark.parametrize("partial", [False, True])
def test_aborted_samples_are_resubmitted_or_continued(fakes, partial):
    fakes[0].plan = ["abort:2"]
    eng = _engine([fakes[0].url], pause_mode="abort", partial_rollouts=partial)
    rollout = eng.generate(PROMPTS[:1], 2, SAMPLING, seed=0)
    bodies = fakes[0].bodies("/v1/completions")
    assert len(bodies) == 3  # the aborted request, then one per aborted sample
    for s in rollout.samples:
        assert len(s.token_ids) == SAMPLING.max_tokens and s.finish_reason == "length"
    if partial:  # the first 2 tokens are kept; the prompt of the continuation includes them
        first = expected_ids(PROMPTS[0], prompt_seed(0, 0), 0, 5)[:2]
        assert bodies[1]["prompt"][0] == PROMPTS[0] + first and bodies[1]["max_tokens"] == 3
        np.testing.assert_array_equal(rollout.samples[0].token_ids[:2], first)
    else:
        assert bodies[1]["prompt"][0] == PROMPTS[0] and bodies[1]["max_tokens"] == 5


def test_update_protocol_order_and_versions(fakes, tmp_path):
    eng = _engine([f.url for f in fakes])
    eng.update_weights(1, _manifest_dir(tmp_path, 1))
    for f in fakes:
        order = [p for p, _ in f.calls if p != "/health"]
        assert order == [
            "/pause",
            "/collective_rpc",
            "/update_weight_version",
            "/reset_prefix_cache",
            "/resume",
        ]
        assert f.weight_version == "1" and f.version == 1 and not f.paused
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0), version=1)


def test_500_on_load_restores_last_good_and_resumes(fakes, tmp_path):
    fakes[0].load_plan = [500]
    eng = _engine([f.url for f in fakes], max_attempts=2)
    with pytest.raises(WeightSyncError, match=r"HTTP 500.*restored to version 0"):
        eng.update_weights(1, _manifest_dir(tmp_path, 1))
    loads = [
        json.loads(b["args"][0])
        for b in fakes[0].bodies("/collective_rpc")
        if b["method"] == "bapo_load"
    ]
    assert loads[-1] == {"path": "/good/v0", "version": 0}  # the last good version
    assert not fakes[0].paused and fakes[0].weight_version == "0"
    assert fakes[1].version == 1  # the healthy server moved on
    assert eng.policy_version == 1


def test_checkpoint_refused_before_loading_keeps_old_weights(fakes, tmp_path):
    fakes[0].load_plan = [{"ok": False, "stage": "validate", "error": "wrong shape"}]
    eng = _engine([fakes[0].url])
    with pytest.raises(WeightSyncError, match="stage validate: wrong shape"):
        eng.update_weights(1, _manifest_dir(tmp_path, 1))
    methods = [b["method"] for b in fakes[0].bodies("/collective_rpc")]
    assert methods == ["bapo_load"]  # nothing to repair: no reload
    assert not fakes[0].paused and fakes[0].weight_version == "0" and eng.policy_version == 0


def test_poisoned_server_whose_recovery_fails_leaves_rotation(fakes, tmp_path):
    bad = {"ok": False, "stage": "load", "error": "died half way"}
    fakes[0].load_plan = [bad, bad]  # the update, then the reload of the last good version
    eng = _engine([f.url for f in fakes])
    with pytest.raises(WeightSyncError, match="out of rotation"):
        eng.update_weights(1, _manifest_dir(tmp_path, 1))
    assert fakes[0].paused  # never resumed on half-loaded weights
    assert eng.servers == [fakes[1].url]
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0), version=1)
    assert fakes[0].count("/v1/completions") == 0


def test_client_side_manifest_validation_never_pauses(fakes, tmp_path):
    d = _manifest_dir(tmp_path, 1)
    with open(os.path.join(d, ws.MANIFEST)) as f:
        manifest = json.load(f)
    del manifest["params"]["layers/q_proj"]
    with open(os.path.join(d, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    eng = _engine([fakes[0].url])
    with pytest.raises(ValueError, match=r"missing parameters \['layers/q_proj'\]"):
        eng.update_weights(1, d)
    with pytest.raises(ValueError, match="manifest version is 1, expected 2"):
        eng.update_weights(2, _manifest_dir(tmp_path / "other", 1))
    assert fakes[0].count("/pause") == 0


def test_generation_waits_for_an_update_and_tags_versions(fakes, tmp_path):
    """pause_mode wait: requests issued during an update are held, then tagged with the new
    version; requests in flight when it starts are drained first and keep the old one."""
    fakes[0].plan = ["sleep:0.5"]
    eng = _engine([fakes[0].url])
    results = {}
    t = threading.Thread(
        target=lambda: results.update(old=eng.generate(PROMPTS[:1], 2, SAMPLING, seed=0))
    )
    t.start()
    time.sleep(0.2)
    eng.update_weights(1, _manifest_dir(tmp_path, 1))
    t.join(10)
    np.testing.assert_array_equal(results["old"].samples[0].versions, np.zeros(5))
    new = eng.generate(PROMPTS[:1], 2, SAMPLING, seed=0)
    np.testing.assert_array_equal(new.samples[0].versions, np.ones(5))


def test_keep_mode_reply_that_outlives_a_resume_is_tagged_unknown(fakes, tmp_path):
    fakes[0].plan = ["sleep:1.0"]
    eng = _engine([fakes[0].url], pause_mode="keep")
    results = {}
    t = threading.Thread(
        target=lambda: results.update(r=eng.generate(PROMPTS[:1], 2, SAMPLING, seed=0))
    )
    t.start()
    time.sleep(0.2)
    eng.update_weights(1, _manifest_dir(tmp_path, 1))  # not drained: the request straddles
    t.join(10)
    for s in results["r"].samples:
        np.testing.assert_array_equal(s.versions, np.full(5, -1))
    assert fakes[0].count("/resume") == 1 and fakes[0].count("/reset_prefix_cache") == 1
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0), version=1)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1, got 0"):
        SamplingParams(max_tokens=0, temperature=1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(max_tokens=4, temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match=r"temperature must be > 0, got 0\.0"):
        SamplingParams(max_tokens=4, temperature=0.0)
    with pytest.raises(ValueError, match=r"pause_mode must be wait\|abort\|keep"):
        VLLMClientConfig(("http://127.0.0.1:1",), model="m", pause_mode="drop")
    eng = _engine([_dead_url()])
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        eng.generate([[1], []], 1, SAMPLING, seed=0)
