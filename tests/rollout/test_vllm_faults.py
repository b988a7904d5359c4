"""Fault handling of the vLLM client against scripted local servers (tests/rollout/fake_vllm.py):
connection refused, 502/503, 4xx, timeouts, resets (a restart), aborts, a server left paused,
weight loads that fail at each stage, and a poisoned server restarted on the last good version.
Every case ends in a retry that succeeds or a clear error, and no prompt is lost. Also: the
generate route's per-token versions, and the launcher's in-place restart (with a stub server)."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest

from bapo_jax.models import PRESETS
from bapo_jax.rollout import serve
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
from bapo_jax.rollout.vllm_http import Ask, generate_body, parse_generate, span_versions

from .fake_vllm import FakeVLLM, expected_ids

PROMPTS = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12], [13]]
SAMPLING = SamplingParams(max_tokens=5, temperature=1.0)
CONFIG = PRESETS["tiny"]


def _dead_url() -> str:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _engine(urls, restart=None, checkpoint="/good/v0", **kw) -> VLLMEngine:
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
        initial_checkpoint=checkpoint,
        restart=restart,
    )


def _requests(fake) -> list[dict]:
    """Generation requests a fake received, as {prompt, n, seed, max_tokens, ...}."""
    bodies = fake.bodies("/inference/v1/generate")
    return [{"prompt": body["token_ids"], **body["sampling_params"]} for body in bodies]


def _loads(fake, since: int = 0) -> list[dict]:
    return [
        json.loads(b["args"][0])
        for p, b in fake.calls[since:]
        if p == "/collective_rpc" and b["method"] == "bapo_load"
    ]


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
    shapes = ws.expected_hf_shapes(CONFIG)
    manifest = {
        "format": ws.FORMAT, "version": version, "step": version, "dtype": "bfloat16",
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
    counts = [f.count_generation() for f in fakes]
    assert sum(counts) == 3 * len(PROMPTS) and min(counts) >= 3, counts
    for f, c in zip(fakes, counts, strict=True):
        assert f.connections <= 2 < c  # keep-alive: at most the pool size per server
    eng.close()


def test_a_sequence_budget_keeps_single_sample_calls_as_full_as_groups(fakes):
    """sequences_per_server: a call of n samples keeps budget // n requests at a server (an
    evaluation's single samples fill it as the training groups do); without: the request cap."""
    eng = _engine([fakes[0].url], max_inflight_per_server=2, sequences_per_server=8)
    assert (eng.requests_per_server(4), eng.requests_per_server(1)) == (2, 8)
    assert eng.requests_per_server(16) == 1
    rollout = eng.generate(PROMPTS * 4, 1, SAMPLING, seed=0)
    assert len(rollout.samples) == 4 * len(PROMPTS)
    assert fakes[0].connections <= 8
    eng.close()
    plain = _engine([fakes[0].url], max_inflight_per_server=2)
    assert plain.requests_per_server(1) == plain.requests_per_server(4) == 2
    plain.close()
    with pytest.raises(ValueError, match="sequences_per_server must be an int >= 1, got 0"):
        VLLMClientConfig(("http://x:1",), model="m", sequences_per_server=0)


def test_every_sampling_field_explicit_and_per_prompt_seeds(fakes):
    eng = _engine([fakes[0].url])
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0))
    route = "/inference/v1/generate"
    assert fakes[0].count_generation() == fakes[0].count(route) == len(PROMPTS)
    for body in fakes[0].bodies(route):
        fields = body["sampling_params"]
        assert fields["logprobs"] == 0 and fields["skip_special_tokens"] is False
        assert body["output_mode"] == "tokens" and fields["detokenize"] is False
    reqs = sorted(_requests(fakes[0]), key=lambda b: b["prompt"])
    for req in reqs:
        p = PROMPTS.index(req["prompt"])
        assert req["seed"] == prompt_seed(0, p) and req["n"] == 2 and req["max_tokens"] == 5
        for key, value in SAMPLING.to_vllm().items():
            assert req[key] == value, key
    assert len({r["seed"] for r in reqs}) == len(PROMPTS)


def test_greedy_asks_for_vllm_argmax_and_keeps_every_other_field():
    ask = Ask((1, 2, 3), 1, SAMPLING, seed=4, greedy=True)
    body = generate_body("m", ask)["sampling_params"]
    assert body["temperature"] == 0.0 and body["seed"] == 4
    for key, value in SAMPLING.to_vllm().items():
        assert key == "temperature" or body[key] == value, key
    assert generate_body("m", Ask((1,), 1, SAMPLING, seed=4))["sampling_params"]["temperature"] == 1


def test_a_server_without_the_generate_route_is_a_clear_error():
    fake = FakeVLLM(generate_api=False)  # a vLLM launched without --enable-scale-out
    try:
        with pytest.raises(RolloutRequestError, match=r"no such route; launch vLLM >= 0\.32 with"):
            _engine([fake.url]).generate(PROMPTS[:1], 2, SAMPLING, seed=0)
        assert fake.count("/inference/v1/generate") == 1  # not retried
    finally:
        fake.close()


def test_connection_refused_goes_to_another_server(fakes):
    eng = _engine([_dead_url(), fakes[0].url])
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0))
    assert fakes[0].count_generation() == len(PROMPTS)


def test_all_servers_refusing_is_a_clear_bounded_error():
    eng = _engine([_dead_url(), _dead_url()], max_attempts=3)
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=r"after 3 attempts.*connection error"):
        eng.generate(PROMPTS[:2], 1, SAMPLING, seed=0)
    assert time.monotonic() - start < 10


def test_refused_by_a_live_process_backs_off_between_attempts():
    """A killed server's process can still look alive while its port already refuses (it is
    exiting): the client must not resubmit at once and spend every attempt in a moment (a
    CI flake of the real server-kill test), but back off as for any connection error."""
    url, alive_calls, restarts = _dead_url(), [], []
    eng = VLLMEngine(
        VLLMClientConfig((url,), model="m", max_attempts=4, backoff_s=0.2, backoff_max_s=0.2),
        expected_config=CONFIG,
        initial_checkpoint="/good/v0",
        restart=restarts.append,
        alive=lambda u: alive_calls.append(u) is None,  # always "still running"
    )
    start = time.monotonic()
    with pytest.raises(ServerUnavailableError, match=r"after 4 attempts.*connection error"):
        eng.generate(PROMPTS[:1], 1, SAMPLING, seed=0)
    assert time.monotonic() - start >= 3 * 0.2  # a backoff after each failed attempt
    assert len(alive_calls) == 4 and restarts == []  # asked each time; alive: not restarted


@pytest.mark.parametrize("status", ["503", "502"])
def test_retryable_status_then_success(fakes, status):
    fakes[0].plan = [status, status]
    eng = _engine([fakes[0].url])
    _assert_complete(eng.generate(PROMPTS[:1] * 0 + PROMPTS, 2, SAMPLING, seed=0))
    assert fakes[0].count_generation() == len(PROMPTS) + 2


@pytest.mark.parametrize("status", ["400", "500"])
def test_4xx_and_500_are_never_retried(fakes, status):
    fakes[0].plan = [status]
    eng = _engine([fakes[0].url])
    with pytest.raises(RolloutRequestError, match=f"HTTP {status}"):
        eng.generate(PROMPTS[:1], 2, SAMPLING, seed=0)
    assert fakes[0].count_generation() == 1


def test_timeout_is_retried(fakes):
    fakes[0].plan = ["hold"]  # never answers in time: held until the fixture closes the fake
    eng = _engine([fakes[0].url], request_timeout_s=0.4)
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0))
    assert fakes[0].count_generation() == len(PROMPTS) + 1


def test_request_lost_to_a_restart_is_resubmitted(fakes):
    fakes[0].plan = ["reset", "ok", "reset"]
    eng = _engine([fakes[0].url])
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0))
    assert fakes[0].count_generation() == len(PROMPTS) + 2


def test_server_left_paused_by_a_crashed_trainer_is_resumed(fakes):
    fakes[0].paused = True  # the crashed trainer never called /resume
    eng = _engine([fakes[0].url], request_timeout_s=0.5)
    _assert_complete(eng.generate(PROMPTS[:2] + PROMPTS[2:], 2, SAMPLING, seed=0))
    assert not fakes[0].paused and fakes[0].count("/resume") == 1
    assert fakes[0].count("/reset_prefix_cache") == 1
    assert fakes[0].bodies("/update_weight_version")[-1] == {"new_version": "0"}


def test_paused_and_poisoned_server_reloads_last_good_before_resuming(fakes):
    fakes[0].paused, fakes[0].poisoned = True, True
    eng = _engine([fakes[0].url], request_timeout_s=0.5)
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0), version=0)
    assert _loads(fakes[0]) == [{"path": "/good/v0", "version": 0}]
    assert not fakes[0].paused and not fakes[0].poisoned


def test_an_aborted_reply_is_requested_again_whole(fakes):
    """Someone else paused the server in mode abort: the request is sent again, same seed."""
    fakes[0].plan = ["abort:2"]
    eng = _engine([fakes[0].url])
    rollout = eng.generate(PROMPTS[:1], 2, SAMPLING, seed=0)
    reqs = _requests(fakes[0])
    assert len(reqs) == 2 and reqs[0] == reqs[1]  # the aborted request, then the same again
    for s in rollout.samples:
        assert len(s.token_ids) == SAMPLING.max_tokens and s.finish_reason == "length"
        np.testing.assert_array_equal(s.versions, np.zeros(SAMPLING.max_tokens))


def test_update_protocol_order_and_versions(fakes, tmp_path):
    eng = _engine([f.url for f in fakes])
    eng.load_checkpoint(1, _manifest_dir(tmp_path, 1))
    for f in fakes:
        order = [p for p, _ in f.calls if p != "/health"]  # no generation yet
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
        eng.load_checkpoint(1, _manifest_dir(tmp_path, 1))
    assert _loads(fakes[0])[-1] == {"path": "/good/v0", "version": 0}  # the last good version
    assert not fakes[0].paused and fakes[0].weight_version == "0"
    assert fakes[1].version == 1  # the healthy server moved on
    assert eng.policy_version == 1


def test_checkpoint_refused_before_loading_keeps_old_weights(fakes, tmp_path):
    fakes[0].load_plan = [{"ok": False, "stage": "validate", "error": "wrong shape"}]
    eng = _engine([fakes[0].url])
    with pytest.raises(WeightSyncError, match="stage validate: wrong shape"):
        eng.load_checkpoint(1, _manifest_dir(tmp_path, 1))
    methods = [b["method"] for b in fakes[0].bodies("/collective_rpc")]
    assert methods == ["bapo_load"]  # nothing to repair: no reload
    assert not fakes[0].paused and fakes[0].weight_version == "0" and eng.policy_version == 0


def test_poisoned_server_whose_recovery_fails_leaves_rotation(fakes, tmp_path):
    bad = {"ok": False, "stage": "load", "error": "died half way"}
    fakes[0].load_plan = [bad, bad]  # the update, then the reload of the last good version
    eng = _engine([f.url for f in fakes])
    with pytest.raises(WeightSyncError, match="out of rotation"):
        eng.load_checkpoint(1, _manifest_dir(tmp_path, 1))
    assert fakes[0].paused  # never resumed on half-loaded weights
    assert eng.servers == [fakes[1].url]
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0), version=1)
    assert fakes[0].count_generation() == 0


def test_client_side_manifest_validation_never_pauses(fakes, tmp_path):
    d = _manifest_dir(tmp_path, 1)
    with open(os.path.join(d, ws.MANIFEST)) as f:
        manifest = json.load(f)
    del manifest["params"]["model/layers/self_attn/q_proj/weight"]
    with open(os.path.join(d, ws.MANIFEST), "w") as f:
        json.dump(manifest, f)
    eng = _engine([fakes[0].url])
    q_proj = r"missing parameters \['model/layers/self_attn/q_proj/weight'\]"
    with pytest.raises(ValueError, match=q_proj):
        eng.load_checkpoint(1, d)
    with pytest.raises(ValueError, match="manifest version is 1, expected 2"):
        eng.load_checkpoint(2, _manifest_dir(tmp_path / "other", 1))
    assert fakes[0].count("/pause") == 0


def test_an_update_does_not_wait_for_running_requests(fakes, tmp_path):
    """No drain: the update goes ahead while a request runs (the pause freezes it); its tokens
    carry the version the server reports for them (here all sampled after the switch)."""
    fakes[0].plan = ["hold"]  # runs until released below
    # No client timeout can end the held request first, however long the update takes.
    eng = _engine([fakes[0].url], request_timeout_s=60.0, deadline_s=60.0)
    results = {}
    t = threading.Thread(
        target=lambda: results.update(r=eng.generate(PROMPTS[:1], 2, SAMPLING, seed=0))
    )
    t.start()
    assert fakes[0].wait_until(lambda: fakes[0].waiting == 1)  # the request runs on the server
    eng.load_checkpoint(1, _manifest_dir(tmp_path, 1))
    assert t.is_alive()  # the update is done, the request still runs
    fakes[0].release_held()
    t.join(10)
    assert fakes[0].count_generation() == 1  # answered, not retried
    np.testing.assert_array_equal(results["r"].samples[0].versions, np.ones(5))
    assert fakes[0].queries == [  # running requests freeze, then are preempted (KV recomputed)
        ("/pause", {"mode": ["keep"], "clear_cache": ["true"]}),
        ("/reset_prefix_cache", {"reset_running_requests": ["true"]}),
    ]


def test_keep_mode_generate_tags_each_token_with_the_version_that_sampled_it(fakes, tmp_path):
    """The generate route reports where the switch fell: 2 tokens of v0, then 3 of v1."""
    fakes[0].plan = ["straddle:2"]
    eng = _engine([fakes[0].url])
    results = {}
    t = threading.Thread(
        target=lambda: results.update(r=eng.generate(PROMPTS[:1], 2, SAMPLING, seed=0))
    )
    t.start()
    # Its first 2 tokens are sampled (under label "0") before the update starts.
    assert fakes[0].wait_until(lambda: fakes[0].waiting == 1)
    eng.load_checkpoint(1, _manifest_dir(tmp_path, 1))
    t.join(10)
    for s in results["r"].samples:
        np.testing.assert_array_equal(s.versions, [0, 0, 1, 1, 1])
        assert s.finish_reason == "length"


def test_weight_version_spans_to_per_token_versions():
    spans = [
        {"version": "default", "start": 0, "end": 2},
        {"version": "7", "start": 2, "end": 3},
        {"version": "someone-else", "start": 3, "end": 5},
    ]
    assert span_versions(spans, 5, boot_version=4, url="u") == [4, 4, 7, -1, -1]
    assert span_versions(None, 3, boot_version=4, url="u") == [-1, -1, -1]  # not reported
    assert span_versions([], 0, boot_version=4, url="u") == []
    with pytest.raises(RolloutRequestError, match="do not tile the 6 output tokens"):
        span_versions(spans, 6, boot_version=4, url="u")
    with pytest.raises(RolloutRequestError, match="do not tile"):
        span_versions([spans[0], spans[2]], 5, boot_version=4, url="u")
    choice = {
        "index": 0,
        "finish_reason": "length",
        "token_ids": [5, 6],
        "weight_versions": [{"version": "3", "start": 0, "end": 2}],
        "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -1}]},
    }
    (reply,) = parse_generate({"choices": [choice]}, 1, "u", boot_version=0)
    assert (reply.token_ids, reply.logprobs, reply.versions) == ([5, 6], [-0.5, -1.0], [3, 3])
    unlabelled = {k: v for k, v in choice.items() if k != "weight_versions"}
    (reply,) = parse_generate({"choices": [unlabelled]}, 1, "u", boot_version=0)
    assert reply.versions == [-1, -1]  # unknown
    choice["logprobs"]["content"][1]["logprob"] = -9999.0  # vLLM's "no log-prob" stand-in
    with pytest.raises(RolloutRequestError, match="a sampled token has no log-prob"):
        parse_generate({"choices": [choice]}, 1, "u", boot_version=0)
    choice["logprobs"]["content"][1] = {"token_id": 9, "logprob": -1.0}
    with pytest.raises(RolloutRequestError, match="token ids and log-probs disagree"):
        parse_generate({"choices": [choice]}, 1, "u", boot_version=0)


# ---- restarting a server whose weights cannot be repaired ---------------------------------------
BAD_LOAD = {"ok": False, "stage": "load", "error": "died half way"}


def _restart_hook(fakes, calls: list[str] | None = None):
    by_url = {f.url: f for f in fakes}

    def restart(url: str) -> None:
        if calls is not None:
            calls.append(url)
        by_url[url].restart()

    return restart


def test_poisoned_server_whose_reload_fails_is_restarted_on_the_last_good_version(fakes, tmp_path):
    fakes[0].load_plan = [BAD_LOAD, BAD_LOAD]  # the update, then the reload of the last good
    hooked: list[str] = []
    eng = _engine([f.url for f in fakes], restart=_restart_hook(fakes, hooked))
    with pytest.raises(WeightSyncError, match="server restarted and restored to version 0"):
        eng.load_checkpoint(1, _manifest_dir(tmp_path, 1))
    assert hooked == eng.restarted == [fakes[0].url] and fakes[0].restarts == 1
    # After the boot: paused, the last good version loaded, tagged, cache reset, resumed.
    since = fakes[0].calls_at_restart
    assert [p for p, _ in fakes[0].calls[since:]] == [
        "/pause",
        "/collective_rpc",
        "/update_weight_version",
        "/reset_prefix_cache",
        "/resume",
    ]
    assert _loads(fakes[0], since) == [{"path": "/good/v0", "version": 0}]
    assert (fakes[0].version, fakes[0].weight_version) == (0, "0")
    assert not fakes[0].paused and not fakes[0].poisoned
    assert fakes[1].version == 1 and eng.policy_version == 1
    assert eng.servers == [f.url for f in fakes]  # back in rotation
    rollout = eng.generate(PROMPTS * 2, 2, SAMPLING, seed=0)
    assert fakes[0].count_generation() > 0 and fakes[1].count_generation() > 0
    versions = {int(v) for s in rollout.samples for v in s.versions}
    assert versions == {0, 1}  # each token tagged by the server that sampled it
    for s in rollout.samples:
        assert len(set(s.versions.tolist())) == 1


def test_restart_without_a_checkpoint_keeps_the_boot_weights(fakes, tmp_path):
    fakes[0].load_plan = [BAD_LOAD]  # poisoned; with no checkpoint, nothing to reload
    eng = _engine([fakes[0].url], restart=_restart_hook(fakes), checkpoint=None)
    with pytest.raises(WeightSyncError, match=r"no last good checkpoint.*restored to version 0"):
        eng.load_checkpoint(1, _manifest_dir(tmp_path, 1))
    assert [b["method"] for b in fakes[0].bodies("/collective_rpc")] == [
        "bapo_load",
        "bapo_state",
        "bapo_set_version",
    ]
    assert (fakes[0].version, fakes[0].weight_version, eng.policy_version) == (0, "0", 0)
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0), version=0)


def test_failed_restart_takes_the_server_out_of_rotation(fakes, tmp_path):
    def broken(url: str) -> None:
        raise RuntimeError("vLLM exited with code 1 while booting")

    fakes[0].load_plan = [BAD_LOAD, BAD_LOAD]
    eng = _engine([f.url for f in fakes], restart=broken)
    with pytest.raises(WeightSyncError, match=r"restart failed.*exited with code 1"):
        eng.load_checkpoint(1, _manifest_dir(tmp_path, 1))
    assert eng.servers == [fakes[1].url] and eng.restarted == []
    assert fakes[0].paused  # never resumed on half-loaded weights
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0), version=1)
    assert fakes[0].count_generation() == 0


def test_generation_waits_for_the_only_server_to_restart(fakes, tmp_path):
    """Requests issued while the only server restarts wait for it (none reaches it before)."""
    fakes[0].load_plan = [BAD_LOAD, BAD_LOAD]
    booting, issued = threading.Event(), threading.Event()

    def slow_restart(url: str) -> None:
        booting.set()
        # Down until the generation below is issued. A request that did not wait for the
        # restart would then reach the old server at once: give it the chance (the one wait
        # bounded by time here: that nothing arrives cannot be waited for otherwise). A
        # request that waits, as it must, lets the restart go on when this times out.
        assert issued.wait(10)
        fakes[0].wait_until(lambda: fakes[0].count_generation() > 0, timeout=0.5)
        fakes[0].restart()

    eng = _engine([fakes[0].url], restart=slow_restart)
    errors = []

    def update():
        try:
            eng.load_checkpoint(1, _manifest_dir(tmp_path, 1))
        except WeightSyncError as e:
            errors.append(str(e))

    t = threading.Thread(target=update)
    t.start()
    assert booting.wait(10)
    issued.set()
    rollout = eng.generate(PROMPTS, 2, SAMPLING, seed=0)
    t.join(10)
    assert "restored to version 0" in errors[0]
    _assert_complete(rollout, version=0)
    first = min(i for i, (p, _) in enumerate(fakes[0].calls) if p == "/inference/v1/generate")
    assert first > fakes[0].calls_at_restart


def test_a_paused_poisoned_server_that_cannot_reload_is_restarted(fakes):
    fakes[0].paused, fakes[0].poisoned = True, True
    fakes[0].load_plan = [BAD_LOAD]
    eng = _engine([fakes[0].url], request_timeout_s=0.5, restart=_restart_hook(fakes))
    _assert_complete(eng.generate(PROMPTS, 2, SAMPLING, seed=0), version=0)
    assert fakes[0].restarts == 1 and eng.restarted == [fakes[0].url]
    assert (fakes[0].version, fakes[0].weight_version) == (0, "0") and not fakes[0].paused


STUB_SERVER = """#!{python}
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"pid": os.getpid(), "argv": argv}}) + "\\n")
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), H).serve_forever()
"""


def _free_ports(k: int) -> int:
    """A first port p with p .. p+k-1 free (checked once; fine on a test machine)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        try:
            socks = [socket.socket() for _ in range(k)]
            for i, s in enumerate(socks):
                s.bind(("127.0.0.1", port + i))
            return port
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def test_server_group_restarts_one_server_in_place(tmp_path, monkeypatch):
    """The launcher's restart with a stub in place of vLLM's interpreter: same command, same
    port, a new process, healthy again; the other server untouched."""
    stub = tmp_path / "python"
    stub.write_text(STUB_SERVER.format(python=sys.executable))
    stub.chmod(0o755)
    log = tmp_path / "starts.jsonl"
    monkeypatch.setenv("STUB_LOG", str(log))
    model = tmp_path / "hf0"
    model.mkdir()
    settings = serve.ServerSettings(port=_free_ports(2), python=str(stub))
    spec = serve.ServerSpec(str(model), 4096, settings)
    group = serve.ServerGroup(spec, 2, log_dir=str(tmp_path / "logs"), boot_timeout_s=30)
    try:
        group.wait_healthy()
        old = [p.pid for p in group.procs]
        group.restart(group.urls[1] + "/")
        assert group.procs[0].pid == old[0] and group.procs[1].pid != old[1]
        assert group.restarts == [0, 1]
        with urllib.request.urlopen(group.urls[1] + "/health", timeout=5) as r:
            assert r.status == 200
        starts = [json.loads(line) for line in log.read_text().splitlines()]
        assert [s["pid"] for s in starts[2:]] == [group.procs[1].pid]
        argv = starts[2]["argv"]
        assert argv == next(s["argv"] for s in starts[:2] if s["pid"] == old[1])
        assert "--enable-scale-out" in argv and argv[argv.index("--port") + 1] == str(
            settings.port + 1
        )
        with pytest.raises(ValueError, match="is not one of"):
            group.restart("http://127.0.0.1:1")
    finally:
        group.stop()
    assert all(p.poll() is not None for p in group.procs)
    for url in group.urls:  # nothing left listening
        with pytest.raises(OSError):
            urllib.request.urlopen(url + "/health", timeout=2)


def test_sampling_params_validation():
    with pytest.raises(ValueError, match="max_tokens must be an int >= 1, got 0"):
        SamplingParams(max_tokens=0, temperature=1.0)
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1.5"):
        SamplingParams(max_tokens=4, temperature=1.0, top_p=1.5)
    with pytest.raises(ValueError, match=r"temperature must be > 0, got 0\.0"):
        SamplingParams(max_tokens=4, temperature=0.0)
    eng = _engine([_dead_url()])
    with pytest.raises(ValueError, match=r"prompt_ids\[1\] is empty"):
        eng.generate([[1], []], 1, SAMPLING, seed=0)
