"""The HTTP side of the vLLM client: one server's connection, state and control plane (the
dev-mode endpoints and the project's worker RPCs), and the generation requests and replies.

HTTP. Each ``Server`` owns a pooled keep-alive session (``max_inflight_per_server``
connections). Control calls retry connection errors, timeouts, 502 and 503 with exponential
backoff (``backoff_s * 2^k``, capped at ``backoff_max_s``), at most ``max_attempts`` times;
4xx and other 5xx raise ``RolloutRequestError`` at once.

Control plane, in the order of a weight update:

    pause()            POST /pause?mode=keep&clear_cache=true   (running requests freeze)
    load(path, v)      POST /collective_rpc  BapoWorkerExtension.bapo_load
    finish(v)          POST /update_weight_version,
                       /reset_prefix_cache?reset_running_requests=true (frozen requests are
                       preempted: their KV is recomputed with the new weights), /resume

``finish`` records the new version before ``/resume`` is sent. With nothing running, a pause
in mode keep is a plain pause: one mode serves a drained loop and in-flight updates alike.

Generation. ``Ask`` is one request (prompt ids, n, sampling, seed); ``generate_body`` puts it
in the form of ``/inference/v1/generate`` (vLLM >= 0.32 with ``--enable-scale-out``: token ids
in and out); ``parse_generate`` checks a reply (n choices, one log-prob per token id, a known
finish reason) and returns ``Reply``s; ``span_versions`` turns its ``weight_versions`` spans
into one policy version per token, so a request that straddles an update carries both.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from typing import Any

import requests
from requests.adapters import HTTPAdapter

from bapo_jax.checks import check_field, check_int
from bapo_jax.rollout.run_secret import auth_headers
from bapo_jax.rollout.types import SamplingParams

__all__ = [
    "GENERATE_PATH",
    "RETRY_STATUS",
    "Ask",
    "Reply",
    "RolloutRequestError",
    "Server",
    "ServerUnavailableError",
    "VLLMClientConfig",
    "WeightSyncError",
    "generate_body",
    "parse_generate",
    "span_versions",
]
RETRY_STATUS = (502, 503)
GENERATE_PATH = "/inference/v1/generate"
_NO_LOGPROB = -9999.0  # vLLM's stand-in for a missing (or -inf) log-prob


def _positive(value: Any) -> bool:
    return isinstance(value, int | float) and value > 0


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
    request_timeout_s:  read timeout of one generation request (a run: engine.request_timeout_s).
    max_inflight_per_server: concurrent requests per server (a run: engine.requests_per_server).
    sequences_per_server: when set, a generate() call of n samples a prompt keeps
                        max(1, this // n) requests at each server instead, so that a call of
                        single samples (an evaluation) fills a server as the training groups do
                        (a run: requests_per_server x G).
    rpc_timeout_s:      read timeout of a weight-load RPC.
    max_attempts:       attempts per request (>= 1) over all servers.
    backoff_s / backoff_max_s: first retry delay, doubled each retry, capped.
    deadline_s:         wall-clock bound of one generate() or update_weights() call.
    token:              the bearer token the servers require on every route
                        (`run_secret.bearer_token`; None: send none). Never in a repr.
    unresponsive_after_s: a server that answers no health probe for this long is out of
                        rotation until it answers again (`vllm_liveness`; None: no probes).
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
    sequences_per_server: int | None = None
    token: str | None = dataclasses.field(default=None, repr=False)
    unresponsive_after_s: float | None = 20.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "urls", tuple(u.rstrip("/") for u in self.urls))
        urls = self.urls
        check_field(bool(urls), "VLLMClientConfig.urls", "at least one server's URL", urls)
        for u in urls:
            check_field(
                u.startswith(("http://", "https://")), "VLLMClientConfig.urls", "http(s) URLs", u
            )
        check_field(len(set(urls)) == len(urls), "VLLMClientConfig.urls", "distinct servers", urls)
        for name in (
            "connect_timeout_s",
            "request_timeout_s",
            "rpc_timeout_s",
            "deadline_s",
            "backoff_s",
            "backoff_max_s",
        ):
            value = getattr(self, name)
            check_field(_positive(value), f"VLLMClientConfig.{name}", "> 0", value)
        after = self.unresponsive_after_s
        ok = after is None or _positive(after)
        check_field(ok, "VLLMClientConfig.unresponsive_after_s", "> 0 or None", after)
        check_int("VLLMClientConfig.max_attempts", self.max_attempts, 1)
        check_int("VLLMClientConfig.max_inflight_per_server", self.max_inflight_per_server, 1)
        if self.sequences_per_server is not None:
            check_int("VLLMClientConfig.sequences_per_server", self.sequences_per_server, 1)

    def backoff(self, attempt: int) -> float:
        return min(self.backoff_s * 2**attempt, self.backoff_max_s)


@dataclasses.dataclass(eq=False)
class Server:
    """A server's connection and what the client knows about it.

    version:    the weights it serves, as last set by this client.
    adapter:    a LoRA run's: the name of the adapter it serves, which requests name (None: the
                served model itself; `adapter_sync`).
    retired:    why it is out of rotation for good (None: it is not).
    restarting: out of rotation while its process is restarted.
    unresponsive: out of rotation while it answers no health probe (`vllm_liveness`); the
                requests waiting on it give up and go to the others.
    """

    url: str
    config: VLLMClientConfig
    version: int = 0
    adapter: str | None = None
    inflight: int = 0
    down_until: float = 0.0
    retired: str | None = None
    restarting: bool = False
    unresponsive: bool = False
    recovering: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    session: requests.Session = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.session = self._new_session()

    def _new_session(self) -> requests.Session:
        session = requests.Session()
        adapter = HTTPAdapter(
            pool_connections=1,
            pool_maxsize=max(
                self.config.max_inflight_per_server, self.config.sequences_per_server or 0
            ),
            max_retries=0,
        )
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        session.headers.update(auth_headers(self.config.token))
        return session

    @property
    def in_rotation(self) -> bool:
        return self.retired is None and not self.restarting and not self.unresponsive

    def reconnect(self) -> None:
        """Drop the pooled connections (after a restart they are dead)."""
        old, self.session = self.session, self._new_session()
        old.close()

    def close(self) -> None:
        self.session.close()

    # ---- HTTP primitives -----------------------------------------------------------------------
    def post(self, path: str, body: Any, *, read_timeout: float) -> requests.Response:
        timeout = (self.config.connect_timeout_s, read_timeout)
        return self.session.post(self.url + path, json=body, timeout=timeout)

    def control(
        self,
        method: str,
        path: str,
        body: Any = None,
        params: dict | None = None,
        read_timeout: float | None = None,
        attempts: int | None = None,
    ) -> Any:
        """A control call with bounded retries on connection errors and 502/503."""
        cfg = self.config
        timeout = (cfg.connect_timeout_s, read_timeout or cfg.request_timeout_s)
        attempts = attempts or cfg.max_attempts
        last = ""
        for attempt in range(attempts):
            try:
                r = self.session.request(
                    method, self.url + path, json=body, params=params, timeout=timeout
                )
            except (requests.ConnectionError, requests.Timeout) as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if r.status_code in RETRY_STATUS:
                    last = f"HTTP {r.status_code}"
                elif r.status_code >= 400:
                    raise RolloutRequestError(
                        f"{self.url}{path}: HTTP {r.status_code}: {r.text[:500]}"
                    )
                else:
                    return r.json() if r.content else None
            if attempt + 1 < attempts:
                time.sleep(cfg.backoff(attempt))
        raise ServerUnavailableError(
            f"{self.url}{path}: no answer after {attempts} attempts ({last})"
        )

    def rpc(self, method: str, payload: dict[str, Any]) -> dict[str, Any]:
        """A ``BapoWorkerExtension`` method on every worker; the first failure, else worker 0."""
        out = self.control(
            "POST",
            "/collective_rpc",
            {"method": method, "args": [json.dumps(payload)], "timeout": self.config.rpc_timeout_s},
            read_timeout=self.config.rpc_timeout_s,
        )
        results = (out or {}).get("results")
        if not results:
            raise RolloutRequestError(f"{self.url}: collective_rpc {method} gave {out!r}")
        bad = [r for r in results if not (isinstance(r, dict) and r.get("ok"))]
        return bad[0] if bad else results[0]

    # ---- control plane -------------------------------------------------------------------------
    def is_paused(self) -> bool:
        reply = self.control("GET", "/is_paused", read_timeout=10.0, attempts=1)
        return bool((reply or {}).get("is_paused"))

    def pause(self) -> None:
        """Running requests freeze where they are (vLLM's pause mode keep)."""
        self.control("POST", "/pause", params={"mode": "keep", "clear_cache": "true"})

    def load(self, path: str, version: int) -> dict[str, Any]:
        """The worker's reply: {"ok": True, ...} or {"ok": False, "stage": ..., "error": ...}.
        A LoRA run's adapter version goes through `load_adapter`."""
        from bapo_jax.rollout.adapter_sync import is_adapter_version

        if is_adapter_version(path):
            return self.load_adapter(path, version)
        return self.rpc("bapo_load", {"path": path, "version": version})

    def load_adapter(self, path: str, version: int) -> dict[str, Any]:
        """An adapter version (`adapter_sync`): the worker checks it (``bapo_check_adapter``),
        then vLLM loads it under the version's name, which requests name from here on, and
        drops the adapter served before. A refusal at any point leaves the server on what it
        served (stage ``validate``)."""
        from bapo_jax.rollout.adapter_sync import adapter_name

        t0 = time.perf_counter()
        reply = self.rpc("bapo_check_adapter", {"path": path, "version": version})
        if not reply.get("ok"):
            return reply
        t1, name = time.perf_counter(), adapter_name(version)
        if name != self.adapter:  # (the one it serves: a version that loaded is never rewritten)
            why = self._lora("load", {"lora_name": name, "lora_path": os.path.join(path, "params")})
            if why:
                return {"ok": False, "stage": "validate", "error": why, "version": self.version}
            old, self.adapter = self.adapter, name
            if old is not None:
                self._lora("unload", {"lora_name": old})
        return {
            "ok": True,
            "version": version,
            "restore_s": t1 - t0,  # the check: what a full sync's read + check is
            "load_s": time.perf_counter() - t1,
            "verify_s": reply.get("verify_s", 0.0),
            "staged": False,
        }

    def _lora(self, verb: str, body: dict[str, Any]) -> str:
        """vLLM's runtime adapter route (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``);
        "" when it answered 200, else why not (the reply is plain text)."""
        path = f"/v1/{verb}_lora_adapter"
        try:
            r = self.post(path, body, read_timeout=self.config.rpc_timeout_s)
        except (requests.ConnectionError, requests.Timeout) as e:
            return f"{self.url}{path}: {type(e).__name__}: {e}"
        if r.status_code != 200:
            return f"{self.url}{path}: HTTP {r.status_code}: {r.text[:300]}"
        return ""

    def worker_state(self) -> dict[str, Any]:
        return self.rpc("bapo_state", {})

    def finish(self, version: int) -> None:
        """Tag ``version``, reset the prefix cache, resume. Frozen requests hold KV of the old
        weights: the reset preempts them, so it is recomputed with the new ones."""
        self.control("POST", "/update_weight_version", {"new_version": str(version)})
        params = {"reset_running_requests": "true"}
        for attempt in range(self.config.max_attempts):
            reply = self.control("POST", "/reset_prefix_cache", params=params)
            if (reply or {}).get("success", True):
                break
            time.sleep(self.config.backoff(attempt))
        else:
            raise RolloutRequestError(f"{self.url}: prefix cache could not be reset")
        self.version = version
        self.control("POST", "/resume")


# ---- generation requests and replies -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Ask:
    """One generation request: ``ids`` (the prompt), ``n`` samples, the call's sampling, the
    request's seed; ``greedy``: argmax decoding (vLLM's temperature 0)."""

    ids: tuple[int, ...]
    n: int
    sampling: SamplingParams
    seed: int
    greedy: bool = False


@dataclasses.dataclass(frozen=True)
class Reply:
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str
    versions: list[int]  # per token, as the server reported them (-1: not reported)


def generate_body(model: str, ask: Ask) -> dict[str, Any]:
    sampling = ask.sampling.to_vllm()
    if ask.greedy:
        sampling["temperature"] = 0.0
    return {
        "model": model,
        "token_ids": list(ask.ids),
        "output_mode": "tokens",
        "stream": False,
        "sampling_params": {
            "n": ask.n,
            "seed": ask.seed,
            "logprobs": 0,
            "detokenize": False,
            "skip_special_tokens": False,
            **sampling,
        },
    }


def parse_generate(payload: dict[str, Any], n: int, url: str, boot_version: int) -> list[Reply]:
    choices = sorted(payload.get("choices") or [], key=lambda c: c.get("index", 0))
    if len(choices) != n:
        raise RolloutRequestError(f"{url}: expected {n} choices, got {len(choices)}")
    out = []
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length", "abort"):
            raise RolloutRequestError(f"{url}: unknown finish_reason {c.get('finish_reason')!r}")
        ids = c.get("token_ids")
        content = (c.get("logprobs") or {}).get("content")
        if ids is None or content is None:
            raise RolloutRequestError(f"{url}: reply lacks token_ids or logprobs: {c}")
        if len(content) != len(ids) or any(
            e.get("token_id") != i for e, i in zip(content, ids, strict=False)
        ):
            raise RolloutRequestError(f"{url}: token ids and log-probs disagree in {c}")
        lp = [e.get("logprob") for e in content]
        if any(x is None or x <= _NO_LOGPROB for x in lp):
            raise RolloutRequestError(f"{url}: a sampled token has no log-prob in {c}")
        versions = span_versions(c.get("weight_versions"), len(ids), boot_version, url)
        out.append(
            Reply([int(i) for i in ids], [float(x) for x in lp], c["finish_reason"], versions)
        )
    return out


def span_versions(
    spans: list[dict[str, Any]] | None, num_tokens: int, boot_version: int, url: str
) -> list[int]:
    """vLLM's ``weight_versions`` ([{version, start, end}], contiguous over the output tokens)
    -> one policy version per token. Labels are this client's ``str(version)``; "default" (never
    tagged) is ``boot_version``; any other label is -1 (unknown), and so is every token of a
    reply without spans (a server that does not label its steps)."""
    if spans is None:
        return [-1] * num_tokens
    out: list[int] = []
    for span in spans:
        start, end = span.get("start"), span.get("end")
        if start != len(out) or not isinstance(end, int) or end < start:
            break
        out += [_version_number(span.get("version"), boot_version)] * (end - start)
    else:
        if len(out) == num_tokens:
            return out
    raise RolloutRequestError(
        f"{url}: weight_versions {spans} do not tile the {num_tokens} output tokens"
    )


def _version_number(label: Any, boot_version: int) -> int:
    if label == "default":
        return boot_version
    try:
        version = int(label)
    except (TypeError, ValueError):
        return -1
    return version if version >= 0 else -1
