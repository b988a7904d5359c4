"""A small scripted stand-in for a vLLM server on 127.0.0.1, for faults vLLM cannot be made to
produce on demand (503, 500 on load, resets, timeouts, a server left paused, a restart).

Completions are deterministic: sample j of a request with prompt p, seed s and max_tokens m is
``[(sum(p) + s + j + k) % 97 for k in range(m)]`` with log-probs ``-(k + 1) / 10``, served by
``/inference/v1/generate`` with vLLM's ``weight_versions`` spans: each token carries the label
``/update_weight_version`` last set when it was sampled ("default" until the first one, as in
vLLM).

Nothing in it waits for time to pass: a request that waits (for a resume, a new weight label, or
a test's `release_held()`) blocks on the fake's condition, which every change notifies, and a
test waits for the fake's state the same way (`wait_until`). The waits end after WAIT_S only so
that a broken test fails instead of hanging.
"""

from __future__ import annotations

import json
import threading
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

WAIT_S = 20.0  # the longest any wait of the fake lasts (a guard, never reached by a passing test)


def expected_ids(prompt: list[int], seed: int, j: int, max_tokens: int) -> list[int]:
    return [(sum(prompt) + seed + j + k) % 97 for k in range(max_tokens)]


class _Notifying:
    """An attribute of the fake whose every change notifies its condition (`wait_until`)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = "_" + name

    def __get__(self, fake: FakeVLLM, owner: type | None = None) -> Any:
        return getattr(fake, self.name)

    def __set__(self, fake: FakeVLLM, value: Any) -> None:
        with fake.lock:
            setattr(fake, self.name, value)
            fake.lock.notify_all()


class FakeVLLM:
    """Scripted server. ``plan``: actions consumed by successive generation requests:
    "ok", "503", "502", "500", "400", "reset" (close without answering), "hold" (a slow request:
    answer once the test calls `release_held()`), "abort:K" (finish_reason "abort" after K
    tokens), "straddle:K" (K tokens, then wait for the weight label to change, then the rest).
    Empty plan = "ok". ``waiting``: the requests now blocked in a "hold" or mid-"straddle".

    generate_api: serve ``/inference/v1/generate`` (False: 404 as a vLLM launched without
    ``--enable-scale-out``). ``restart()`` stops it and starts a fresh one on the same port,
    with the state a booted vLLM has (the scripted plans and the call log are kept)."""

    def __init__(self, *, generate_api: bool = True, port: int = 0) -> None:
        self.plan: list[str] = []
        self.load_plan: list[Any] = []  # per bapo_load call: "ok" | 500 | {"ok": False, ...}
        self.generate_api = generate_api
        self.calls: list[tuple[str, Any]] = []
        self.queries: list[tuple[str, dict]] = []  # (path, query) of every control POST
        self.connections = 0
        self.restarts = 0
        self.calls_at_restart = 0  # len(calls) when the last restart happened
        # Guards all of the fake's state and is notified on every change of it (`wait_until`).
        self.lock = threading.Condition()
        self.waiting = 0
        self._released = False
        self._boot()
        self._serve(port)

    def _boot(self) -> None:
        """The state of a freshly booted server and its worker."""
        self.frozen = False
        self.paused = False
        self.version: int | None = None  # the worker's bapo_version
        self.poisoned = False
        self.weight_version = "default"

    # What requests wait on (set by the control routes, or by a test): setting one notifies.
    # frozen: a stopped process (SIGSTOP): every route, /health included, answers only once the
    # test thaws it (``frozen = False``); the connections stay open.
    frozen = _Notifying()
    paused = _Notifying()
    weight_version = _Notifying()

    def _thawed(self) -> None:
        with self.lock:
            self.lock.wait_for(lambda: not self.frozen, WAIT_S)

    def wait_until(self, predicate: Callable[[], bool], timeout: float = WAIT_S) -> bool:
        """Block until ``predicate()`` (of the fake's state) holds; False if it still does not
        after ``timeout`` seconds. Re-checked on every change: each one notifies."""
        with self.lock:
            return self.lock.wait_for(predicate, timeout)

    def release_held(self) -> None:
        """Let every "hold" request answer, now and from now on."""
        with self.lock:
            self._released = True
            self.lock.notify_all()

    def _serve(self, port: int) -> None:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _reply(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                fake._thawed()
                path = urllib.parse.urlparse(self.path).path
                fake.record(path, None)
                if path == "/is_paused":
                    self._reply(200, {"is_paused": fake.paused})
                elif path == "/weight_info":
                    self._reply(200, {"weight_version": fake.weight_version})
                else:
                    self._reply(200, {})

            def do_POST(self) -> None:
                fake._thawed()
                url = urllib.parse.urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                fake.record(url.path, body)
                handler = getattr(fake, "on_" + url.path.strip("/").replace("/", "_"), None)
                if handler is None or (
                    url.path == "/inference/v1/generate" and not fake.generate_api
                ):
                    self._reply(404, {"detail": "Not Found"})  # FastAPI's unknown route
                    return
                result = handler(body, urllib.parse.parse_qs(url.query))
                if result == "reset":
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                self._reply(*result)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address):  # clients that timed out
                pass

            def get_request(self):  # count TCP connections (pooling check)
                sock, addr = super().get_request()
                with fake.lock:
                    fake.connections += 1
                return sock, addr

        self.httpd = Server(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def record(self, path: str, body: Any) -> None:
        with self.lock:
            self.calls.append((path, body))
            self.lock.notify_all()

    def count(self, path: str) -> int:
        with self.lock:
            return sum(1 for p, _ in self.calls if p == path)

    def count_generation(self) -> int:
        return self.count("/inference/v1/generate")

    def bodies(self, path: str) -> list[Any]:
        with self.lock:
            return [b for p, b in self.calls if p == path]

    def close(self) -> None:
        self.release_held()  # no handler thread is left blocked
        self._stop()

    def _stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def restart(self) -> None:
        """What ``serve.ServerGroup.restart`` does to a real server: stop, boot, healthy."""
        port = self.httpd.server_address[1]
        self._stop()
        with self.lock:
            self.restarts += 1
            self.calls_at_restart = len(self.calls)
        self._boot()
        self._serve(port)

    # ---- generation ----------------------------------------------------------------------------
    def _sample(self, prompt: list[int], n: int, seed: int, m: int, action: str) -> list[dict]:
        """Each choice: token ids, log-probs, finish reason and weight-version spans."""
        label = self.weight_version
        cut = int(action.split(":")[1]) if action.startswith(("abort:", "straddle:")) else m
        if action.startswith("straddle:"):  # frozen mid-way by a pause in keep mode
            with self.lock:
                label = self.weight_version  # that of the first `cut` tokens
                # Frozen while the update goes on around it: a new label, then the resume.
                self._block(lambda: self.weight_version != label and not self.paused)
            cut = min(cut, m)
        spans = [{"version": label, "start": 0, "end": cut}]
        if action.startswith("straddle:") and cut < m:
            spans.append({"version": self.weight_version, "start": cut, "end": m})
        choices = []
        for j in range(n):
            ids = expected_ids(prompt, seed, j, m)
            finish = "length"
            if action.startswith("abort:"):
                ids, finish = ids[:cut], "abort"
            choices.append(
                {
                    "index": j,
                    "token_ids": ids,
                    "finish_reason": finish,
                    "logprobs": [-(k + 1) / 10 for k in range(len(ids))],
                    "weight_versions": spans if finish != "abort" else spans[:1],
                }
            )
        return choices

    def _block(self, until: Callable[[], bool]) -> None:
        """Wait for ``until()``, counted in ``waiting`` meanwhile (what a test waits to see before
        it acts on a running request). Lock held."""
        self.waiting += 1
        self.lock.notify_all()
        try:
            self.lock.wait_for(until, WAIT_S)
        finally:
            self.waiting -= 1
            self.lock.notify_all()

    def _action(self) -> str:
        """The next scripted action, once the server is not paused (vLLM holds requests)."""
        with self.lock:
            action = self.plan.pop(0) if self.plan else "ok"
            self.lock.wait_for(lambda: not self.paused, WAIT_S)
            if action == "hold":
                self._block(lambda: self._released)
        return action

    def on_inference_v1_generate(self, body: dict, query: dict):
        action = self._action()
        if action == "reset":
            return "reset"
        if action in ("503", "502", "500", "400"):
            return int(action), {"error": {"message": f"scripted {action}"}}
        sp = body["sampling_params"]
        choices = self._sample(body["token_ids"], sp["n"], sp["seed"], sp["max_tokens"], action)
        for c in choices:
            lp = c.pop("logprobs")
            c["logprobs"] = {
                "content": [
                    {"token_id": i, "logprob": x, "top_logprobs": []}
                    for i, x in zip(c["token_ids"], lp, strict=True)
                ]
            }
        return 200, {"output_mode": "tokens", "choices": choices}

    # ---- control plane -------------------------------------------------------------------------
    def on_pause(self, body, query):
        self.queries.append(("/pause", query))
        self.paused = True
        return 200, {"status": "paused"}

    def on_resume(self, body, query):
        self.paused = False
        return 200, {"status": "resumed"}

    def on_reset_prefix_cache(self, body, query):
        self.queries.append(("/reset_prefix_cache", query))
        return 200, {"success": True}

    def on_update_weight_version(self, body, query):
        self.weight_version = body["new_version"]
        return 200, {"success": True}

    def on_collective_rpc(self, body, query):
        method = body["method"]
        args = json.loads(body["args"][0])
        if method == "bapo_state":
            return 200, {
                "results": [{"ok": True, "version": self.version, "poisoned": self.poisoned}]
            }
        if method == "bapo_reserve":  # as a server without bapo_jax.malloc's setting says
            why = "GLIBC_TUNABLES lacks bapo_jax.malloc's setting (fake server)"
            reply = {"ok": True, "reserved_bytes": 0, "added_bytes": 0, "seconds": 0.0}
            return 200, {"results": [{**reply, "why": why}]}
        if method == "bapo_set_version":
            self.version, self.poisoned = args["version"], False
            return 200, {"results": [{"ok": True, "version": self.version, "poisoned": False}]}
        if method == "bapo_load":
            with self.lock:
                action = self.load_plan.pop(0) if self.load_plan else "ok"
            if action == "ok":
                self.version, self.poisoned = args["version"], False
                return 200, {"results": [{"ok": True, "version": args["version"]}]}
            if isinstance(action, int):
                return action, {"error": {"message": "scripted load failure"}}
            self.poisoned = action.get("stage") == "load"
            return 200, {"results": [action]}
        return 400, {"error": f"unknown method {method}"}
