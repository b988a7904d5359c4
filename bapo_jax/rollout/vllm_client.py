"""The vLLM rollout engine: an HTTP client for one or more vLLM servers (data parallel).

Generation: one request per prompt with its token ids, ``n`` samples, ``logprobs: 0`` (the
log-prob of the sampled token only), a per-prompt seed derived from the call's seed, and every
sampling field explicit, to ``POST /inference/v1/generate`` (token ids in and out; each output
token comes with the weight version that sampled it) or ``POST /v1/completions``
(``return_token_ids``, ``return_tokens_as_token_ids``); see ``VLLMClientConfig.api``. Prompts
are spread over the servers (least in-flight first) by a bounded thread pool over pooled
keep-alive connections.

Greedy decoding (``generate(..., greedy=True)``, for evaluation) sends temperature 0, vLLM's
argmax; the other sampling fields stay as given.

Failures. Connection errors, timeouts, 502 and 503 are retried with exponential backoff on
any server in rotation, at most ``max_attempts`` times and within ``deadline_s``; 4xx and other
5xx are never retried (a clear ``RolloutRequestError``). A request lost to a server restart
(connection reset) is resubmitted whole, so no prompt is lost: ``generate`` returns every
prompt's samples or raises. A server whose process died (the ``alive`` hook, e.g.
``serve.ServerGroup.alive``, says so after a connection error) is restarted with the
``restart`` hook on the last good version, once, while the requests it lost wait for it; they
are then resubmitted with their own seeds. A timed-out or 503 server is asked
``/is_paused``; a server left paused by a crashed trainer is recovered (the last good version
reloaded if its worker is poisoned or on another version, then resumed).

Weight update. ``update_weights(version, params)`` (and its halves ``begin_update`` /
``finish_update``, the ``RolloutEngine`` interface) writes the params as an Orbax checkpoint and
has the servers stage it while they generate, then loads it: the engine's ``OrbaxSync``
(``rollout.orbax_sync``, also the retries and the multi-process sync). Loading a written
version directory (``load_checkpoint``), on every server in rotation: pause (mode wait | abort |
keep) -> validate the manifest -> load through ``/collective_rpc``
(``BapoWorkerExtension.bapo_load``) -> ``/update_weight_version`` -> ``/reset_prefix_cache`` ->
resume. A checkpoint refused before loading leaves the server on its old weights (it is
resumed, the error raised). A load that fails part-way poisons the server and is never served
from: the last good version (the one before this update) is reloaded before resuming. If that
fails too, the server's process is restarted with the ``restart`` hook (e.g.
``serve.ServerGroup.restart``): out of rotation meanwhile, it boots, is paused, loads the last
good version (or, with no checkpoint known, keeps its boot weights: ``initial_version``), is
tagged with it and rejoins the rotation. Without a hook, or if the restart fails, the server
stays out of rotation. ``load_checkpoint`` then raises ``WeightSyncError`` naming what
happened on each failing server; the other servers serve the new version. The reload /
restart / retire ladder is ``vllm_recovery.ServerRecovery``. Before the pause,
``stage_weights`` lets every worker read and check the version while generating.

Policy versions. Each server's version is tracked. With the generate endpoint every token is
tagged with the version vLLM's engine reports for the step that sampled it (vLLM attaches the
label given by ``/update_weight_version`` to each engine step; labels change only while the
server is paused), so tags are exact in every pause mode, also for a request that straddles an
update ("default", an untagged server, is ``initial_version``). With ``/v1/completions``
versions are inferred: new requests wait while an update runs; pause mode "wait" drains this
client's in-flight requests first, so every token is tagged exactly; in "abort" and "keep"
modes a reply that outlived a resume without being aborted is tagged -1 (unknown). In "abort"
mode aborted samples are resubmitted (or, with ``partial_rollouts``, continued from their
tokens so far, which keep their old version). In "keep" mode the prefix-cache reset also
preempts the frozen requests so their KV is recomputed with the new weights.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import requests

from bapo_jax.rollout.types import (
    Rollout,
    Sample,
    SamplingParams,
    SyncTimings,
    validate_prompts,
)
from bapo_jax.rollout.vllm_http import (
    COMPLETIONS_PATH,
    GENERATE_PATH,
    RETRY_STATUS,
    Ask,
    Reply,
    RolloutRequestError,
    Server,
    ServerUnavailableError,
    VLLMClientConfig,
    WeightSyncError,
    completions_body,
    generate_body,
    parse_completions,
    parse_generate,
    route_missing,
)
from bapo_jax.rollout.vllm_recovery import LastGood, RestartHook, ServerRecovery

__all__ = [
    "RestartHook",
    "RolloutRequestError",
    "ServerUnavailableError",
    "VLLMClientConfig",
    "VLLMEngine",
    "WeightSyncError",
    "prompt_seed",
]


def prompt_seed(seed: int, prompt_index: int) -> int:
    """Per-prompt seed in [0, 2^53): vLLM gives sample j of a request the seed ``s + j``."""
    digest = hashlib.blake2b(f"{seed}:{prompt_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 11


class _Retry(Exception):
    def __init__(self, server: Server, why: str):
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
        restart: RestartHook | None = None,
        alive: Callable[[str], bool] | None = None,
        sync: Any = None,
    ):
        """sync: the ``orbax_sync.OrbaxSync`` that ``update_weights`` writes through (None:
          only ``load_checkpoint`` of versions written elsewhere).
        initial_version: the version the servers boot with (their ``--model`` weights).
        initial_checkpoint: a synced version dir to fall back to on a failed load (optional).
        expected_config: the trainer's ``Qwen2Config``; manifests must match it.
        restart: restarts a server that died or that a reload of the last good version could
          not repair.
        alive: alive(url) says whether a server's process still runs (with ``restart``, a dead
          one is restarted as soon as a request finds it gone)."""
        for name, hook in (("restart", restart), ("alive", alive)):
            if hook is not None and not callable(hook):
                raise ValueError(f"{name} must be callable(url), got {hook!r}")
        self._alive = alive
        self._sync = sync
        self.config = config
        self._expected = expected_config
        self._boot_version = self._version = int(initial_version)
        self._last_good: str | None = initial_checkpoint
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._recovery = ServerRecovery(config, self._idle, restart)
        self._updating = False
        self._inflight = 0
        api = "completions" if config.api == "completions" else "generate"
        self._servers = [Server(u, config, version=self._version, api=api) for u in config.urls]
        # url -> the worker's reply to the last load (timings: restore_s, load_s)
        self.last_update: dict[str, dict[str, Any]] = {}

    @property
    def policy_version(self) -> int:
        return self._version

    @property
    def restarted(self) -> list[str]:
        """Servers restarted by this client, in order."""
        return self._recovery.restarted

    @property
    def servers(self) -> list[str]:
        """URLs in rotation."""
        return [s.url for s in self._servers if s.in_rotation]

    def close(self) -> None:
        for s in self._servers:
            s.close()

    # ---- generation ----------------------------------------------------------------------------
    def _pick(self, avoid: Server | None) -> Server | None:
        """Least-loaded server in rotation (None: all of them are restarting). Lock held."""
        now = time.monotonic()
        live = [s for s in self._servers if s.in_rotation]
        if not live:
            if any(s.restarting for s in self._servers):
                return None
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

    def _enter(self, deadline: float, avoid: Server | None) -> Server:
        """Wait until no update runs and a server is in rotation; count the request in."""
        with self._idle:
            while (server := None if self._updating else self._pick(avoid)) is None:
                left = deadline - time.monotonic()
                if left <= 0 or not self._idle.wait(timeout=left):
                    raise ServerUnavailableError(
                        "timed out waiting for a weight update or a server restart to end"
                    )
            self._inflight += 1
            server.inflight += 1
            return server

    def _leave(self, server: Server) -> None:
        with self._idle:
            server.inflight -= 1
            self._inflight -= 1
            self._idle.notify_all()

    def _request(self, ask: Ask, deadline: float) -> tuple[list[Reply], int, bool]:
        """One generation request with retries; returns (replies, the version the server served
        when the request started, whether that version is certain for the whole reply: no
        resume was sent to the server meanwhile, so no new weights can have sampled)."""
        cfg = self.config
        avoid: Server | None = None
        last = ""
        for attempt in range(cfg.max_attempts):
            if time.monotonic() >= deadline:
                break
            server = self._enter(deadline, avoid)
            version, resumes = server.snapshot()
            try:
                replies = self._send(server, ask, deadline)
                return replies, version, server.snapshot()[1] == resumes
            except _Retry as e:
                last = f"{e.server.url}: {e.why}"
                avoid = e.server
                e.server.down_until = time.monotonic() + cfg.backoff(attempt)
                if "timeout" in e.why or "503" in e.why:
                    self._recover_if_paused(e.server)
                elif e.why.startswith("connection error"):
                    self._leave(server)
                    server = None
                    if self._restart_if_dead(e.server):
                        avoid = None
                        continue  # resubmit at once, on the restarted server or another
            finally:
                if server is not None:
                    self._leave(server)
            time.sleep(min(cfg.backoff(attempt), max(0.0, deadline - time.monotonic())))
        raise ServerUnavailableError(
            f"request not served after {cfg.max_attempts} attempts / deadline: {last}"
        )

    def _send(self, server: Server, ask: Ask, deadline: float) -> list[Reply]:
        read = min(self.config.request_timeout_s, max(0.1, deadline - time.monotonic()))
        api = server.api
        if api == "generate":
            path, body = GENERATE_PATH, generate_body(self.config.model, ask)
        else:
            path, body = COMPLETIONS_PATH, completions_body(self.config.model, ask)
        try:
            r = server.post(path, body, read_timeout=read)
        except requests.ConnectTimeout as e:
            raise _Retry(server, f"connection error ({e})") from e
        except requests.Timeout as e:
            raise _Retry(server, f"timeout ({e})") from e
        except requests.ConnectionError as e:  # refused, reset by a restart, ...
            raise _Retry(server, f"connection error ({e})") from e
        if api == "generate" and self.config.api == "auto" and route_missing(r):
            server.api = "completions"  # a server launched without --enable-scale-out
            return self._send(server, ask, deadline)
        if r.status_code in RETRY_STATUS:
            raise _Retry(server, f"HTTP {r.status_code}")
        if r.status_code != 200:
            raise RolloutRequestError(f"{server.url}{path}: HTTP {r.status_code}: {r.text[:500]}")
        if api == "generate":
            return parse_generate(r.json(), ask.n, server.url, self._boot_version)
        return parse_completions(r.json(), ask.n, server.url)

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingParams,
        seed: int,
        *,
        greedy: bool = False,
    ) -> Rollout:
        """``n`` samples per prompt (greedy=True: vLLM's argmax decoding, for evaluation)."""
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
                    self._generate_prompt,
                    p,
                    ids,
                    n,
                    sampling,
                    prompt_seed(seed, p),
                    deadline,
                    greedy,
                )
                for p, ids in enumerate(prompts)
            ]
            samples = [s for f in futures for s in f.result()]
        return Rollout(prompts, n, tuple(samples))

    def _generate_prompt(
        self,
        p: int,
        ids: tuple[int, ...],
        n: int,
        sampling: SamplingParams,
        seed: int,
        deadline: float,
        greedy: bool = False,
    ) -> list[Sample]:
        ask = Ask(ids, n, sampling, seed, greedy=greedy)
        replies, version, certain = self._request(ask, deadline)
        out = []
        for j, reply in enumerate(replies):
            tokens, logps = list(reply.token_ids), list(reply.logprobs)
            vers = _tags(reply, version, certain)
            finish = reply.finish_reason
            for round_ in range(self.config.max_attempts):
                if finish != "abort":
                    break
                # Aborted by a weight update: continue (partial rollouts) or start over.
                if not self.config.partial_rollouts:
                    tokens, logps, vers = [], [], []
                if len(tokens) >= sampling.max_tokens:
                    finish = "length"
                    break
                ask = Ask(
                    ids + tuple(tokens),
                    1,
                    sampling,
                    seed + n + round_ * n + j,
                    done=len(tokens),
                    greedy=greedy,
                )
                (more,), v, sure = self._request(ask, deadline)
                tokens += more.token_ids
                logps += more.logprobs
                vers += _tags(more, v, sure)
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
    def begin_update(self, version: int, params: Any, *, step: int) -> Any:
        """Write ``params`` as ``version`` and have the servers stage it, generation going on
        (``OrbaxSync.begin``; a background thread on one process)."""
        from bapo_jax.rollout import orbax_sync

        if self._sync is None:
            raise ValueError("VLLMEngine.begin_update needs VLLMEngine(sync=OrbaxSync(...))")
        return self._sync.begin(orbax_sync.loader_for(self), version, params, step)

    def finish_update(self, handle: Any, generating_until: float | None = None) -> SyncTimings:
        """Load the version ``begin_update`` wrote on every server (``OrbaxSync.finish``)."""
        return self._sync.finish(handle, generating_until)

    def update_weights(self, version: int, params: Any, *, step: int = 0) -> SyncTimings:
        return self.finish_update(self.begin_update(version, params, step=step))

    def load_checkpoint(self, version: int, checkpoint: str) -> None:
        """Load the synced version dir ``checkpoint`` (written by ``weight_sync``) on every
        server; see the module doc for the protocol and the failure handling."""
        checkpoint = self._checked(version, checkpoint)  # before any pause
        self.last_update = {}
        deadline = time.monotonic() + self.config.deadline_s
        with self._idle:
            self._updating = True
            if self.config.pause_mode == "wait":
                while self._inflight:
                    if not self._idle.wait(timeout=max(0.0, deadline - time.monotonic())):
                        self._updating = False
                        self._idle.notify_all()
                        raise WeightSyncError("timed out draining in-flight requests")
        good = LastGood(self._last_good, self._version)
        errors: dict[str, str] = {}
        to_restart: list[Server] = []
        try:
            live = [s for s in self._servers if s.in_rotation]
            if not live:
                raise WeightSyncError(
                    f"no vLLM server in rotation to load version {version}: "
                    + "; ".join(f"{s.url}: {s.retired or 'restarting'}" for s in self._servers)
                )
            with cf.ThreadPoolExecutor(len(live)) as pool:
                outcomes = pool.map(
                    lambda s: self._recovery.load(s, version, checkpoint, good), live
                )
                for s, (reply, err, restart) in zip(live, outcomes, strict=True):
                    if reply is not None:
                        self.last_update[s.url] = reply
                    if err:
                        errors[s.url] = err
                    if restart:
                        to_restart.append(s)
            if len(errors) < len(live):  # at least one server switched
                self._version = version
                self._last_good = checkpoint
        finally:
            with self._idle:
                self._updating = False
                self._idle.notify_all()
        # Generation goes on (on the other servers) while these boot.
        for s in to_restart:
            errors[s.url] += "; " + self._recovery.restart(s, good)[1]
        if errors:
            raise WeightSyncError(
                f"weight update to version {version} failed: "
                + " | ".join(f"{url}: {err}" for url, err in errors.items())
            )

    def _checked(self, version: int, checkpoint: str | None) -> str:
        """The absolute version dir, once its manifest's format, config and version pass."""
        from bapo_jax.rollout import weight_sync as ws

        if checkpoint is None:
            raise ValueError("VLLMEngine.load_checkpoint needs the version directory (checkpoint)")
        manifest = ws.read_manifest(checkpoint := os.path.abspath(checkpoint))
        want = ws.ORBAX_FORMATS if self.config.sync_format == "orbax" else (ws.SAFETENSORS_FORMAT,)
        if (fmt := manifest.get("format")) not in want:
            raise WeightSyncError(f"{checkpoint}: format {fmt!r}, this client syncs {want}")
        ws.validate_manifest(manifest, self._expected, version=version)
        return checkpoint

    def stage_weights(self, version: int, checkpoint: str) -> dict[str, dict[str, Any]]:
        """Every server in rotation starts reading + checking the Orbax version dir in a worker
        thread (``bapo_stage``, module doc) and goes on generating; url -> the worker's reply."""
        if self.config.sync_format != "orbax":
            return {}
        checkpoint, replies = self._checked(version, checkpoint), {}
        for s in [s for s in self._servers if s.in_rotation]:
            try:
                replies[s.url] = s.rpc("bapo_stage", {"path": checkpoint, "version": version})
            except (RolloutRequestError, ServerUnavailableError) as e:
                replies[s.url] = {"ok": False, "stage": "stage", "error": str(e)}
        return replies

    def _restart_if_dead(self, server: Server) -> bool:
        """After a connection error: if ``server``'s process died, restart it on the last good
        version (one thread does; the others wait for it). Returns whether it is back."""
        if self._alive is None or not self._recovery.can_restart:
            return False
        restarts = self._recovery.restarted.count(server.url)
        with server.recovering:
            if self._alive(server.url):
                # Back at once only if another request restarted it while this one waited. A
                # refused connection from a live process (e.g. one still exiting after a kill)
                # is retried after the backoff, so the attempts are not spent in a moment.
                return server.in_rotation and self._recovery.restarted.count(server.url) > restarts
            if server.retired is not None:
                return False
            with self._idle:
                good = LastGood(self._last_good, self._version)
            ok, _ = self._recovery.restart(server, good)
            return ok

    def server_versions(self) -> dict[str, dict[str, Any]]:
        """What every server in rotation reports of its weights: the worker extension's loaded
        version and poisoned flag, and vLLM's own weight-version label."""
        out = {}
        for s in self._servers:
            if s.in_rotation:
                worker = s.worker_state()
                label = s.control("GET", "/weight_info", read_timeout=30.0)
                out[s.url] = {
                    "worker_version": worker.get("version"),
                    "poisoned": bool(worker.get("poisoned")),
                    "weight_version": (label or {}).get("weight_version"),
                }
        return out

    def _recover_if_paused(self, server: Server) -> bool:
        """Resume a server left paused by someone else (e.g. a crashed trainer)."""
        if self._updating:
            return False
        with server.recovering:  # one recovery per server, however many requests timed out
            good = LastGood(self._last_good, self._version)
            return self._recovery.resume_paused(server, good)

    def recover(self) -> list[str]:
        """Resume every server left paused (call at trainer start); returns the URLs resumed."""
        return [s.url for s in self._servers if s.in_rotation and self._recover_if_paused(s)]


def _tags(reply: Reply, version: int, certain: bool) -> list[int]:
    """Per-token versions: the server's when it reported them; else the request's version when
    it is certain (no resume meanwhile, or the reply was aborted by the pause), else -1."""
    if reply.versions is not None:
        return list(reply.versions)
    known = certain or reply.finish_reason == "abort"
    return [version if known else -1] * len(reply.token_ids)
