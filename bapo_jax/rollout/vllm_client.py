"""The vLLM rollout engine: an HTTP client for one or more vLLM servers (data parallel).
docs/rollout.md ("vLLM servers", "Weight sync") is the full account; in short:

Generation: one ``POST /inference/v1/generate`` per prompt (token ids in and out, ``n``
samples, ``logprobs: 0``, every sampling field explicit, the seed ``prompt_seed(seed, p)``),
spread over the servers in rotation (least in-flight first) by a bounded thread pool over
pooled keep-alive connections; ``greedy=True`` (evaluation) sends temperature 0. Every output
token carries the weight version vLLM's engine reports for the step that sampled it, so the
tags are exact also for a request an update froze mid-way ("default", an untagged server, is
``initial_version``).

Failures: connection errors, timeouts, 502 and 503 are retried with backoff on any server in
rotation (at most ``max_attempts`` times, within ``deadline_s``); 4xx and other 5xx raise
``RolloutRequestError`` at once, so ``generate`` returns every prompt's samples or raises. By
kind (`_Retry`): after a connection error a server whose process died (the ``alive`` hook) is
restarted (the ``restart`` hook) on the last good version while its requests wait; a server
that timed out or answered 503 and is found paused with no update running (a crashed trainer)
is recovered; an aborted reply is requested again whole; a server that `vllm_liveness` finds
silent leaves the rotation, the requests waiting on it go to the others at once with their own
seeds, and it rejoins on the current version once it answers.

Weight update: the engine is the ``SyncTarget`` of an ``orbax_sync.OrbaxSync``.
``stage_weights`` has every worker read and check a version while generating;
``load_checkpoint`` validates the manifest, then on every server in rotation pauses (mode
keep: running requests freeze; new ones wait), loads (``BapoWorkerExtension.bapo_load``), tags,
resets the prefix cache (the frozen requests' KV is recomputed) and resumes (`vllm_http`). A
server whose load fails part-way never serves from it: `vllm_recovery` reloads the last good
version, else restarts the server, else retires it; ``load_checkpoint`` then raises
``WeightSyncError`` naming each failing server, the others serving the new version.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import requests

from bapo_jax.rollout.types import Rollout, Sample, SamplingParams, validate_prompts
from bapo_jax.rollout.vllm_http import (
    GENERATE_PATH,
    RETRY_STATUS,
    Ask,
    Reply,
    RolloutRequestError,
    Server,
    ServerUnavailableError,
    VLLMClientConfig,
    WeightSyncError,
    generate_body,
    parse_generate,
)
from bapo_jax.rollout.vllm_liveness import Liveness
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
    """A request to send again: ``kind`` decides how ("connect": the process may have died;
    "timeout" / "status" (502, 503): the server may be paused; "aborted"; "unresponsive":
    `vllm_liveness` took the server out of rotation while the request waited on it)."""

    def __init__(self, kind: str, why: str):
        super().__init__(why)
        self.kind, self.why = kind, why


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
    ):
        """initial_version: the version the servers boot with (their ``--model`` weights).
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
        self.config = config
        self._expected = expected_config
        self._boot_version = int(initial_version)
        self._good = LastGood(initial_checkpoint, self._boot_version)  # replaced, never mutated
        self._idle = threading.Condition(threading.Lock())
        self._recovery = ServerRecovery(self._idle, restart)
        self._updating = False
        self._servers = [Server(u, config, version=self._boot_version) for u in config.urls]
        # url -> the worker's reply to the last load (timings: restore_s, load_s)
        self.last_update: dict[str, dict[str, Any]] = {}
        self.liveness = None
        if config.unresponsive_after_s is not None:
            self.liveness = Liveness(
                self._servers,
                self._idle,
                unresponsive_after_s=config.unresponsive_after_s,
                rejoin=self._rejoin,
                token=config.token,
            )

    @property
    def policy_version(self) -> int:
        return self._good.version

    @property
    def restarted(self) -> list[str]:
        """Servers restarted by this client, in order."""
        return self._recovery.restarted

    @property
    def servers(self) -> list[str]:
        """URLs in rotation."""
        return [s.url for s in self._in_rotation()]

    @property
    def inflight(self) -> dict[str, int]:
        """url -> generation requests this client has sent it and not yet had answered."""
        with self._idle:
            return {s.url: s.inflight for s in self._servers}

    def close(self) -> None:
        if self.liveness is not None:
            self.liveness.close()
        for s in self._servers:
            s.close()

    def _in_rotation(self) -> list[Server]:
        return [s for s in self._servers if s.in_rotation]

    @contextlib.contextmanager
    def _holding_updates(self) -> Iterator[None]:
        """Run the body as the only weight change (an update, or a server's rejoin): new
        requests wait meanwhile, running ones go on (an update's pause freezes them)."""
        with self._idle:
            while self._updating:
                self._idle.wait()
            self._updating = True
        try:
            yield
        finally:
            with self._idle:
                self._updating = False
                self._idle.notify_all()

    # ---- generation ----------------------------------------------------------------------------
    def _pick(self, avoid: Server | None) -> Server | None:
        """Least-loaded server in rotation (None: all of them are restarting). Lock held."""
        now = time.monotonic()
        live = self._in_rotation()
        if not live:
            if any(s.retired is None for s in self._servers):  # restarting, or unresponsive
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
            server.inflight += 1
            return server

    def _leave(self, server: Server) -> None:
        with self._idle:
            server.inflight -= 1
            self._idle.notify_all()

    def _request(self, ask: Ask, deadline: float) -> list[Reply]:
        """One generation request with retries (on any server in rotation)."""
        cfg = self.config
        avoid: Server | None = None
        last = ""
        for attempt in range(cfg.max_attempts):
            if time.monotonic() >= deadline:
                break
            server = self._enter(deadline, avoid)
            try:
                return self._send(server, ask, deadline)
            except _Retry as e:
                retry = e
            finally:
                self._leave(server)
            last, avoid = f"{server.url}: {retry.why}", server
            server.down_until = time.monotonic() + cfg.backoff(attempt)
            if retry.kind == "unresponsive":
                continue  # resubmit at once, elsewhere; liveness brings it back
            if retry.kind in ("timeout", "status"):
                self._recover_if_paused(server)
            elif retry.kind == "connect" and self._restart_if_dead(server):
                avoid = None
                continue  # resubmit at once, on the restarted server or another
            time.sleep(min(cfg.backoff(attempt), max(0.0, deadline - time.monotonic())))
        raise ServerUnavailableError(
            f"request not served after {cfg.max_attempts} attempts / deadline: {last}"
        )

    def _send(self, server: Server, ask: Ask, deadline: float) -> list[Reply]:
        read = min(self.config.request_timeout_s, max(0.1, deadline - time.monotonic()))
        body = generate_body(server.adapter or self.config.model, ask)
        try:
            r = self._post(server, body, read)
        except (requests.ConnectionError, requests.Timeout) as e:  # refused, reset, timed out
            if isinstance(e, requests.ConnectionError):  # a ConnectTimeout too
                raise _Retry("connect", f"connection error ({e})") from e
            raise _Retry("timeout", f"timeout ({e})") from e
        if r.status_code in RETRY_STATUS:
            raise _Retry("status", f"HTTP {r.status_code}")
        if r.status_code == 404 and "Not Found" in r.text:  # the router's, not the handler's
            raise RolloutRequestError(
                f"{server.url}{GENERATE_PATH}: no such route; launch vLLM >= 0.32 with "
                "--enable-scale-out (bapo_jax.rollout.serve does)"
            )
        if r.status_code != 200:
            raise RolloutRequestError(
                f"{server.url}{GENERATE_PATH}: HTTP {r.status_code}: {r.text[:500]}"
            )
        replies = parse_generate(r.json(), ask.n, server.url, self._boot_version)
        if any(reply.finish_reason == "abort" for reply in replies):
            raise _Retry("aborted", "a sample came back aborted")
        return replies

    def _post(self, server: Server, body: dict, read: float) -> requests.Response:
        """The generation POST; with liveness probes on, sent from a thread of its own so that
        the wait ends as soon as the server is marked unresponsive (`_Retry` "unresponsive":
        its reply, if it ever comes, is dropped)."""
        if self.liveness is None:
            return server.post(GENERATE_PATH, body, read_timeout=read)
        reply: cf.Future = cf.Future()

        def send() -> None:
            try:
                reply.set_result(server.post(GENERATE_PATH, body, read_timeout=read))
            except BaseException as e:  # handed to the waiting thread
                reply.set_exception(e)

        threading.Thread(target=send, name="vllm-post", daemon=True).start()
        while True:
            done, _ = cf.wait([reply], timeout=self.liveness.interval_s)
            if done:
                return reply.result()
            if server.unresponsive:
                raise _Retry("unresponsive", "no health answer: out of rotation")

    def _rejoin(self, server: Server) -> bool:
        """A server that answers again after `vllm_liveness` took it out: on the current
        version (reloaded unless it holds it), resumed; no update runs meanwhile (one now
        would skip it). Returns whether it may rejoin the rotation."""
        with self._holding_updates():
            return self._recovery.bring_back(server, self._good)

    def requests_per_server(self, n: int) -> int:
        """Requests of ``n`` samples each kept at a server (`VLLMClientConfig`)."""
        if self.config.sequences_per_server is None:
            return self.config.max_inflight_per_server
        return max(1, self.config.sequences_per_server // n)

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
        asks = [
            Ask(ids, n, sampling, prompt_seed(seed, p), greedy) for p, ids in enumerate(prompts)
        ]
        workers = min(len(prompts), len(self._servers) * self.requests_per_server(n))
        with cf.ThreadPoolExecutor(max(1, workers), thread_name_prefix="vllm-gen") as pool:
            futures = [pool.submit(self._request, ask, deadline) for ask in asks]
            samples = [
                Sample(
                    prompt_index=p,
                    sample_index=j,
                    token_ids=np.asarray(reply.token_ids, np.int32),
                    logprobs=np.asarray(reply.logprobs, np.float32),
                    versions=np.asarray(reply.versions, np.int64),
                    finish_reason=reply.finish_reason,
                )
                for p, future in enumerate(futures)
                for j, reply in enumerate(future.result())
            ]
        return Rollout(prompts, n, tuple(samples))

    # ---- weight update -------------------------------------------------------------------------
    def load_checkpoint(self, version: int, checkpoint: str) -> dict[str, dict[str, Any]]:
        """Load the synced version dir ``checkpoint`` (written by ``weight_sync``) on every
        server; url -> the worker's reply (also ``last_update``). See the module doc for the
        protocol and the failure handling."""
        checkpoint = self._checked(version, checkpoint)  # before any pause
        self.last_update = {}
        errors: dict[str, str] = {}
        to_restart: list[Server] = []
        with self._holding_updates():
            good, live = self._good, self._in_rotation()
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
                self._good = LastGood(checkpoint, version)
        # Generation goes on (on the other servers) while these boot.
        for s in to_restart:
            errors[s.url] += "; " + self._recovery.restart(s, good)[1]
        if errors:
            raise WeightSyncError(
                f"weight update to version {version} failed: "
                + " | ".join(f"{url}: {err}" for url, err in errors.items())
            )
        return dict(self.last_update)

    def _checked(self, version: int, checkpoint: str) -> str:
        """The absolute version dir, once its manifest's format, config and version pass."""
        from bapo_jax.rollout import weight_sync as ws
        from bapo_jax.rollout.adapter_sync import ADAPTER_FORMAT

        manifest = ws.read_manifest(checkpoint := os.path.abspath(checkpoint))
        if (fmt := manifest.get("format")) == ADAPTER_FORMAT:  # a LoRA run's adapters
            if manifest.get("version") != version:
                raise WeightSyncError(f"{checkpoint}: version {manifest.get('version')!r}")
            return checkpoint  # the worker checks the rest (`adapter_sync.check_adapter`)
        if fmt != ws.FORMAT:
            raise WeightSyncError(f"{checkpoint}: format {fmt!r}, this client syncs {ws.FORMAT}")
        ws.validate_manifest(manifest, self._expected, version=version)
        return checkpoint

    def _rpc_in_rotation(self, method: str, payload: dict, stage: str) -> dict[str, dict]:
        """``method`` on every server in rotation; url -> the worker's reply (a server that
        cannot be asked: ``{"ok": False, "stage": stage, "error": ...}``)."""
        replies = {}
        for s in self._in_rotation():
            try:
                replies[s.url] = s.rpc(method, payload)
            except (RolloutRequestError, ServerUnavailableError) as e:
                replies[s.url] = {"ok": False, "stage": stage, "error": str(e)}
        return replies

    def reserve_sync_memory(
        self, checkpoint_bytes: int, parameters: int
    ) -> dict[str, dict[str, Any]]:
        """Every server in rotation sets aside the host memory a sync of a checkpoint of that
        many bytes and parameters needs (``bapo_reserve``, once per worker process, before the
        first sync); url -> the worker's reply (the reservation only speeds its syncs up)."""
        request = {"checkpoint_bytes": int(checkpoint_bytes), "parameters": parameters}
        return self._rpc_in_rotation("bapo_reserve", request, "reserve")

    def stage_weights(self, version: int, checkpoint: str) -> dict[str, dict[str, Any]]:
        """Every server in rotation starts reading + checking the Orbax version dir in a worker
        thread (``bapo_stage``, module doc) and goes on generating; url -> the worker's reply."""
        request = {"path": self._checked(version, checkpoint), "version": version}
        return self._rpc_in_rotation("bapo_stage", request, "stage")

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
            return self._recovery.restart(server, self._good)[0]

    def server_versions(self) -> dict[str, dict[str, Any]]:
        """What every server in rotation reports of its weights: the worker extension's loaded
        version and poisoned flag, and vLLM's own weight-version label."""
        out = {}
        for s in self._in_rotation():
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
            return self._recovery.resume_paused(server, self._good)
