"""The vLLM rollout engine: an HTTP client for one or more vLLM servers (data parallel).

Generation: one ``POST /v1/completions`` per prompt with token-id prompt, ``n`` samples,
``logprobs: 0`` (the log-prob of the sampled token only), ``return_token_ids``,
``return_tokens_as_token_ids``, a per-prompt seed derived from the call's seed, and every
sampling field explicit. Prompts are spread over the servers (least in-flight first) by a
bounded thread pool over pooled keep-alive connections.

Failures. Connection errors, timeouts, 502 and 503 are retried with exponential backoff
(``backoff_s * 2^k``, capped) on any healthy server, at most ``max_attempts`` times and
within ``deadline_s``; 4xx and other 5xx are never retried (a clear ``RolloutRequestError``).
A request lost to a server restart (connection reset) is resubmitted whole, so no prompt is
lost: ``generate`` returns every prompt's samples or raises. A timed-out or 503 server is
asked ``/is_paused``; a server left paused by a crashed trainer is recovered (the last good
version reloaded if its worker is poisoned or on another version, then resumed).

Weight update (``update_weights``), on every server: pause (mode wait | abort | keep) ->
validate the manifest -> load through ``/collective_rpc`` (``BapoWorkerExtension.bapo_load``)
-> ``/update_weight_version`` -> ``/reset_prefix_cache`` -> resume. A checkpoint refused
before loading leaves the server on its old weights (it is resumed, the error raised); a load
that fails part-way poisons the server: the last good version is reloaded before resuming,
and if that fails too the server stays paused and is taken out of rotation.

Policy versions. Each server's version is tracked (a server whose load failed stays on the
old one). New requests wait while an update runs; pause mode "wait" also drains this client's
in-flight requests first, so every token is tagged exactly. In "abort" mode aborted samples
are resubmitted (or, with ``partial_rollouts``, continued from their tokens so far, which keep
their old version). A reply received before any resume reached its server carries the
version the server had when the request started; one that outlived a resume without being
aborted (possible in "abort" and "keep" modes: held by the paused server, or frozen) is tagged
-1 (unknown), since ``/v1/completions`` does not say where the switch fell. In "keep" mode the
prefix-cache reset also preempts the frozen requests so their KV is recomputed with the new
weights.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import hashlib
import json
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import requests
from requests.adapters import HTTPAdapter

from bapo_jax.rollout.types import Rollout, Sample, SamplingParams, validate_prompts

__all__ = [
    "RolloutRequestError",
    "ServerUnavailableError",
    "VLLMClientConfig",
    "VLLMEngine",
    "WeightSyncError",
]

PauseMode = Literal["wait", "abort", "keep"]
_RETRY_STATUS = (502, 503)


class RolloutRequestError(RuntimeError):
    """A request the server refused (4xx, non-retryable 5xx, malformed reply)."""


class ServerUnavailableError(RuntimeError):
    """No server answered within the retry budget."""


class WeightSyncError(RuntimeError):
    """A weight update was refused or failed (the message says which server and why)."""


@dataclasses.dataclass(frozen=True)
class VLLMClientConfig:
    """urls:               base URLs of the vLLM servers, e.g. ("http://127.0.0.1:8000",).
    model:              served model name (the ``--served-model-name`` or model path).
    connect_timeout_s:  TCP connect timeout.
    request_timeout_s:  read timeout of one completion request.
    rpc_timeout_s:      read timeout of a weight-load RPC.
    max_attempts:       attempts per request (>= 1) over all servers.
    backoff_s / backoff_max_s: first retry delay, doubled each retry, capped.
    deadline_s:         wall-clock bound of one generate() or update_weights() call.
    max_inflight_per_server: concurrent requests per server (the pool size).
    pause_mode:         wait | abort | keep (see module doc).
    partial_rollouts:   in abort mode, continue aborted samples instead of resubmitting.
    sync_format:        orbax | safetensors; a check that versions come in the expected form.
    """

    urls: tuple[str, ...]
    model: str
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    rpc_timeout_s: float = 900.0
    max_attempts: int = 6
    backoff_s: float = 0.25
    backoff_max_s: float = 8.0
    deadline_s: float = 3600.0
    max_inflight_per_server: int = 16
    pause_mode: PauseMode = "wait"
    partial_rollouts: bool = False
    sync_format: Literal["orbax", "safetensors"] = "orbax"

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", tuple(u.rstrip("/") for u in self.urls))
        if not self.urls:
            raise ValueError("VLLMClientConfig.urls must name at least one server, got ()")
        for u in self.urls:
            if not u.startswith(("http://", "https://")):
                raise ValueError(f"VLLMClientConfig.urls: {u!r} is not an http(s) URL")
        for name in (
            "connect_timeout_s",
            "request_timeout_s",
            "rpc_timeout_s",
            "deadline_s",
            "backoff_s",
            "backoff_max_s",
        ):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"VLLMClientConfig.{name} must be > 0, got {value!r}")
        for name in ("max_attempts", "max_inflight_per_server"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VLLMClientConfig.{name} must be an int >= 1, got {value!r}")
        if self.pause_mode not in ("wait", "abort", "keep"):
            raise ValueError(
                f"VLLMClientConfig.pause_mode must be wait|abort|keep, got {self.pause_mode!r}"
            )
        if self.sync_format not in ("orbax", "safetensors"):
            raise ValueError(
                f"VLLMClientConfig.sync_format must be orbax|safetensors, got {self.sync_format!r}"
            )


def prompt_seed(seed: int, prompt_index: int) -> int:
    """Per-prompt seed in [0, 2^53): vLLM gives sample j of a request the seed ``s + j``."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 11


@dataclasses.dataclass
class _Server:
    url: str
    session: requests.Session
    version: int = 0  # weights it serves (as last set by this client)
    resumes: int = 0  # resumes sent by this client (a request that saw none kept its weights)
    inflight: int = 0
    down_until: float = 0.0
    recovering: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    retired: str | None = None  # why it is out of rotation


@dataclasses.dataclass
class _Reply:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str


class _Retry(Exception):
    def __init__(self, server: _Server, why: str):
        super().__init__(why)
        self.server, self.why = server, why


class VLLMEngine:
    """``RolloutEngine`` over vLLM servers; see the module doc."""

    def __init__(
        self,
        config: VLLMClientConfig,
        *,
        initial_version: int = 0,
        initial_checkpoint: str | None = None,
        expected_config: Any = None,
    ):
        """initial_version: the version the servers boot with (their ``--model`` weights).
        initial_checkpoint: a synced version dir to fall back to on a failed load (optional).
        expected_config: the trainer's ``Qwen2Config``; manifests must match it."""
        self.config = config
        self._expected = expected_config
        self._version = int(initial_version)
        self._last_good: str | None = initial_checkpoint
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._updating = False
        self._inflight = 0
        self._servers = [self._new_server(u, self._version) for u in config.urls]
        # url -> the worker's reply to the last load (timings: restore_s, load_s)
        self.last_update: dict[str, dict[str, Any]] = {}

    def _new_server(self, url: str, version: int) -> _Server:
        session = requests.Session()
        adapter = HTTPAdapter(
            pool_connections=1, pool_maxsize=self.config.max_inflight_per_server, max_retries=0
        )
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        return _Server(url, session, version=version)

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def servers(self) -> list[str]:
        return [s.url for s in self._servers if s.retired is None]

    def close(self) -> None:
        for s in self._servers:
            s.session.close()

    # ---- HTTP primitives -----------------------------------------------------------------------
    def _timeout(self, read: float) -> tuple[float, float]:
        return (self.config.connect_timeout_s, read)

    def _post(
        self,
        server: _Server,
        path: str,
        body: Any = None,
        *,
        read_timeout: float,
        params: dict | None = None,
    ) -> requests.Response:
        return server.session.post(
            server.url + path, json=body, params=params, timeout=self._timeout(read_timeout)
        )

    def _control(
        self,
        server: _Server,
        method: str,
        path: str,
        body: Any = None,
        params: dict | None = None,
        read_timeout: float | None = None,
        attempts: int | None = None,
    ) -> Any:
        """A control call with bounded retries on connection errors and 502/503."""
        cfg = self.config
        read = read_timeout or cfg.request_timeout_s
        attempts = attempts or cfg.max_attempts
        last = ""
        for attempt in range(attempts):
            try:
                if method == "GET":
                    r = server.session.get(
                        server.url + path, params=params, timeout=self._timeout(read)
                    )
                else:
                    r = self._post(server, path, body, read_timeout=read, params=params)
            except (requests.ConnectionError, requests.Timeout) as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code in _RETRY_STATUS:
                    last = f"HTTP {r.status_code}"
                elif r.status_code >= 400:
                    raise RolloutRequestError(
                        f"{server.url}{path}: HTTP {r.status_code}: {r.text[:500]}"
                    )
                else:
                    return r.json() if r.content else None
            time.sleep(min(cfg.backoff_s * 2**attempt, cfg.backoff_max_s))
        raise ServerUnavailableError(
            f"{server.url}{path}: no answer after {attempts} attempts ({last})"
        )

    def _rpc(self, server: _Server, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        out = self._control(
            server,
            "POST",
            "/collective_rpc",
            {"method": method, "args": [json.dumps(payload)], "timeout": self.config.rpc_timeout_s},
            read_timeout=self.config.rpc_timeout_s,
        )
        results = (out or {}).get("results")
        if not results:
            raise RolloutRequestError(f"{server.url}: collective_rpc {method} gave {out!r}")
        bad = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
        return bad[0] if bad else results[0]

    # ---- generation ----------------------------------------------------------------------------
    def _pick(self, avoid: _Server | None) -> _Server:
        now = time.monotonic()
        live = [s for s in self._servers if s.retired is None]
        if not live:
            raise ServerUnavailableError(
                "every vLLM server is out of rotation: "
                + "; ".join(f"{s.url}: {s.retired}" for s in self._servers)
            )
        up = (
            [s for s in live if s.down_until <= now and s is not avoid]
            or [s for s in live if s.down_until <= now]
            or live
        )
        return min(up, key=lambda s: s.inflight)

    def _enter(self, deadline: float) -> None:
        """Wait for no update to run; count the request in."""
        with self._idle:
            while self._updating:
                if not self._idle.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise ServerUnavailableError("timed out waiting for a weight update to end")
            self._inflight += 1

    def _leave(self) -> None:
        with self._idle:
            self._inflight -= 1
            self._idle.notify_all()

    def _request(
        self, body: dict[str, Any], n: int, deadline: float
    ) -> tuple[list[_Reply], int, bool]:
        """One completion request with retries; returns (replies, the version the server
        served when the request started, whether that version is certain for the whole reply:
        no resume was sent to the server meanwhile, so no new weights can have sampled)."""
        cfg = self.config
        avoid: _Server | None = None
        last = ""
        for attempt in range(cfg.max_attempts):
            if time.monotonic() >= deadline:
                break
            self._enter(deadline)
            try:
                with self._lock:
                    server = self._pick(avoid)
                    server.inflight += 1
                    version, resumes = server.version, server.resumes
            except ServerUnavailableError:
                self._leave()
                raise
            try:
                replies = self._send(server, body, n, deadline)
                return replies, version, server.resumes == resumes
            except _Retry as e:
                last = f"{e.server.url}: {e.why}"
                avoid = e.server
                e.server.down_until = time.monotonic() + min(
                    cfg.backoff_s * 2**attempt, cfg.backoff_max_s
                )
                if "timeout" in e.why or "503" in e.why:
                    self._recover_if_paused(e.server)
            finally:
                with self._lock:
                    server.inflight -= 1
                self._leave()
            time.sleep(
                min(
                    cfg.backoff_s * 2**attempt,
                    cfg.backoff_max_s,
                    max(0.0, deadline - time.monotonic()),
                )
            )
        raise ServerUnavailableError(
            f"request not served after {cfg.max_attempts} attempts / deadline: {last}"
        )

    def _send(self, server: _Server, body: dict[str, Any], n: int, deadline: float) -> list[_Reply]:
        read = min(self.config.request_timeout_s, max(0.1, deadline - time.monotonic()))
        try:
            r = self._post(server, "/v1/completions", body, read_timeout=read)
        except requests.ConnectTimeout as e:
            raise _Retry(server, f"connection error ({e})") from e
        except requests.Timeout as e:
            raise _Retry(server, f"timeout ({e})") from e
        except requests.ConnectionError as e:  # refused, reset by a restart, ...
            raise _Retry(server, f"connection error ({e})") from e
        if r.status_code in _RETRY_STATUS:
            raise _Retry(server, f"HTTP {r.status_code}")
        if r.status_code != 200:
            raise RolloutRequestError(
                f"{server.url}/v1/completions: HTTP {r.status_code}: {r.text[:500]}"
            )
        return _parse_choices(r.json(), n, server.url)

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seed: int,
    ) -> Rollout:
        prompts = validate_prompts(prompt_ids, n)
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        deadline = time.monotonic() + self.config.deadline_s
        workers = min(len(prompts), len(self._servers) * self.config.max_inflight_per_server)
        with cf.ThreadPoolExecutor(max(1, workers), thread_name_prefix="vllm-gen") as pool:
            futures = [
                pool.submit(
                    self._generate_prompt, p, ids, n, sampling, prompt_seed(seed, p), deadline
                )
                for p, ids in enumerate(prompts)
            ]
            samples = [s for f in futures for s in f.result()]
        return Rollout(prompts, n, tuple(samples))

    def _body(
        self,
        ids: Sequence[int],
        n: int,
        sampling: SamplingParams,
        seed: int,
        max_tokens: int | None = None,
    ) -> dict[str, Any]:
        body = {
            "model": self.config.model,
            "prompt": [list(ids)],
            "n": n,
            "seed": seed,
            "logprobs": 0,
            "echo": False,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
            "stream": False,
            **sampling.to_vllm(),
        }
        if max_tokens is not None:
            body["max_tokens"] = max_tokens
            body["min_tokens"] = min(sampling.min_tokens, max_tokens)
        return body

    def _generate_prompt(
        self,
        p: int,
        ids: tuple[int, ...],
        n: int,
        sampling: SamplingParams,
        seed: int,
        deadline: float,
    ) -> list[Sample]:
        replies, version, certain = self._request(self._body(ids, n, sampling, seed), n, deadline)
        out = []
        for j, reply in enumerate(replies):
            tokens = list(reply.token_ids)
            logps = list(reply.logprobs)
            # Aborted tokens were sampled before the pause: the old version. Otherwise a reply
            # that outlived a resume (pause modes abort/keep) may hold new-weight tokens.
            known = certain or reply.finish_reason == "abort"
            vers = [version if known else -1] * len(tokens)
            finish = reply.finish_reason
            for round_ in range(self.config.max_attempts):
                if finish != "abort":
                    break
                # Aborted by a weight update: continue (partial rollouts) or start over.
                if not self.config.partial_rollouts:
                    tokens, logps, vers = [], [], []
                left = sampling.max_tokens - len(tokens)
                if left <= 0:
                    finish = "length"
                    break
                body = self._body(
                    ids + tuple(tokens), 1, sampling, seed + n + round_ * n + j, max_tokens=left
                )
                (more,), v, sure = self._request(body, 1, deadline)
                tokens += more.token_ids
                logps += more.logprobs
                vers += [v if sure or more.finish_reason == "abort" else -1] * len(more.token_ids)
                finish = more.finish_reason
            if finish == "abort":
                raise ServerUnavailableError(
                    f"prompt {p} sample {j} kept being aborted ({self.config.max_attempts} tries)"
                )
            out.append(
                Sample(
                    prompt_index=p,
                    sample_index=j,
                    token_ids=np.asarray(tokens, np.int32),
                    logprobs=np.asarray(logps, np.float32),
                    versions=np.asarray(vers, np.int64),
                    finish_reason=finish,
                )
            )
        return out

    # ---- weight update -------------------------------------------------------------------------
    def update_weights(self, version: int, checkpoint: str | None = None) -> None:
        """Load the synced version dir ``checkpoint`` (written by ``weight_sync``) on every
        server; see the module doc for the protocol and the failure handling."""
        from bapo_jax.rollout import weight_sync as ws

        if checkpoint is None:
            raise ValueError("VLLMEngine.update_weights needs the version directory (checkpoint)")
        checkpoint = os.path.abspath(checkpoint)
        manifest = ws.read_manifest(checkpoint)
        want = ws.ORBAX_FORMAT if self.config.sync_format == "orbax" else ws.SAFETENSORS_FORMAT
        if manifest.get("format") != want:
            raise WeightSyncError(
                f"{checkpoint}: format {manifest.get('format')!r}, this client syncs {want!r}"
            )
        ws.validate_manifest(manifest, self._expected, version=version)  # before any pause
        deadline = time.monotonic() + self.config.deadline_s
        with self._idle:
            self._updating = True
            if self.config.pause_mode == "wait":
                while self._inflight:
                    if not self._idle.wait(timeout=max(0.0, deadline - time.monotonic())):
                        self._updating = False
                        self._idle.notify_all()
                        raise WeightSyncError("timed out draining in-flight requests")
        errors: list[str] = []
        try:
            live = [s for s in self._servers if s.retired is None]
            with cf.ThreadPoolExecutor(max(1, len(live))) as pool:
                for s, err in zip(
                    live,
                    pool.map(lambda s: self._update_server(s, version, checkpoint), live),
                    strict=True,
                ):
                    if err:
                        errors.append(f"{s.url}: {err}")
            if len(errors) < len(live):  # at least one server switched
                self._version = version
                self._last_good = checkpoint
        finally:
            with self._idle:
                self._updating = False
                self._idle.notify_all()
        if errors:
            raise WeightSyncError(
                f"weight update to version {version} failed: " + " | ".join(errors)
            )

    def _update_server(self, server: _Server, version: int, checkpoint: str) -> str | None:
        """The per-server protocol; returns None on success or the error (the server is then
        back on the previous good version and resumed, or paused and out of rotation)."""
        try:
            self._control(
                server,
                "POST",
                "/pause",
                params={"mode": self.config.pause_mode, "clear_cache": "true"},
            )
            result = self._rpc(server, "bapo_load", {"path": checkpoint, "version": version})
            self.last_update[server.url] = result
        except (RolloutRequestError, ServerUnavailableError) as e:
            return self._repair(server, f"{e}")  # the load may have half-happened
        if not result.get("ok"):
            err = f"load refused at stage {result.get('stage')}: {result.get('error')}"
            if result.get("stage") != "validate":
                return self._repair(server, err)
            try:  # refused before loading: the old weights are intact
                self._finish(server, self._version)
            except (RolloutRequestError, ServerUnavailableError) as e:
                return self._repair(server, f"{err}; then {e}")
            return err
        try:
            self._finish(server, version)
        except (RolloutRequestError, ServerUnavailableError) as e:
            return f"loaded version {version} but could not resume: {e}"
        return None

    def _repair(self, server: _Server, err: str) -> str:
        """Never serve from a half-loaded model: reload the last good version, then resume;
        if that fails, leave the server paused and take it out of rotation."""
        try:
            self._restore_last_good(server)
            self._finish(server, self._version)
        except (RolloutRequestError, ServerUnavailableError, WeightSyncError) as e2:
            server.retired = f"failed load and failed recovery ({e2})"
            return f"{err}; recovery failed, server out of rotation: {e2}"
        return f"{err} (server restored to version {self._version})"

    def _finish(self, server: _Server, version: int) -> None:
        """Tag the version, reset the prefix cache, resume."""
        self._control(server, "POST", "/update_weight_version", {"new_version": str(version)})
        for _ in range(self.config.max_attempts):
            # keep mode: frozen requests hold KV of the old weights; preempt them so it is
            # recomputed with the new ones.
            params = {"reset_running_requests": "true"} if self.config.pause_mode == "keep" else {}
            reply = self._control(server, "POST", "/reset_prefix_cache", params=params)
            if (reply or {}).get("success", True):
                break
            time.sleep(self.config.backoff_s)
        else:
            raise RolloutRequestError(f"{server.url}: prefix cache could not be reset")
        with self._lock:
            server.version = version
            server.resumes += 1  # before the resume: later replies may be new-weight ones
        self._control(server, "POST", "/resume")

    def _restore_last_good(self, server: _Server) -> None:
        if self._last_good is None:
            state = self._rpc(server, "bapo_state", {})
            if state.get("poisoned"):
                raise WeightSyncError(
                    f"{server.url} is poisoned and no last good checkpoint is known"
                )
            return
        result = self._rpc(server, "bapo_load", {"path": self._last_good, "version": self._version})
        if not result.get("ok"):
            raise WeightSyncError(f"{server.url}: reloading last good version failed: {result}")

    def _recover_if_paused(self, server: _Server) -> bool:
        """Resume a server left paused by someone else (e.g. a crashed trainer)."""
        if self._updating:
            return False
        with server.recovering:  # one recovery per server, however many requests timed out
            return self._recover_locked(server)

    def _recover_locked(self, server: _Server) -> bool:
        try:
            reply = self._control(server, "GET", "/is_paused", read_timeout=10.0, attempts=1)
            paused = (reply or {}).get("is_paused")
            if not paused:
                return False
            state = self._rpc(server, "bapo_state", {})
            if state.get("poisoned") or (
                state.get("version") is not None and state.get("version") != self._version
            ):
                self._restore_last_good(server)
            self._finish(server, self._version)
            return True
        except (RolloutRequestError, ServerUnavailableError, WeightSyncError):
            return False

    def recover(self) -> list[str]:
        """Resume every server left paused (call at trainer start); returns the URLs resumed."""
        return [s.url for s in self._servers if s.retired is None and self._recover_if_paused(s)]


def _parse_choices(payload: dict[str, Any], n: int, url: str) -> list[_Reply]:
    choices = sorted(payload.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise RolloutRequestError(f"{url}: expected {n} choices, got {len(choices)}")
    out = []
    for c in choices:
        ids = c.get("token_ids")
        lp = (c.get("logprobs") or {}).get("token_logprobs")
        toks = (c.get("logprobs") or {}).get("tokens")
        if ids is None or lp is None:
            raise RolloutRequestError(f"{url}: reply lacks token_ids or logprobs: {c}")
        if len(lp) != len(ids) or (toks is not None and toks != [f"token_id:{i}" for i in ids]):
            raise RolloutRequestError(f"{url}: token ids and log-probs disagree in {c}")
        if any(x is None for x in lp):
            raise RolloutRequestError(f"{url}: a sampled token has no log-prob in {c}")
        finish = c.get("finish_reason")
        if finish not in ("stop", "length", "abort"):
            raise RolloutRequestError(f"{url}: unknown finish_reason {finish!r}")
        out.append(_Reply([int(i) for i in ids], [float(x) for x in lp], finish))
    return out
