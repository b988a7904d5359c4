"""A small scripted stand-in for a vLLM server on 127.0.0.1, for faults vLLM cannot be made to
produce on demand (503, 500 on load, resets, timeouts, a server left paused).

Completions are deterministic: sample j of a request with prompt p, seed s and max_tokens m is
``[(sum(p) + s + j + k) % 97 for k in range(m)]`` with log-probs ``-(k + 1) / 10``.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


def expected_ids(prompt: list[int], seed: int, j: int, max_tokens: int) -> list[int]:
    return [(sum(prompt) + seed + j + k) % 97 for k in range(max_tokens)]


class FakeVLLM:
    """Scripted server. ``plan``: actions consumed by successive completion requests:
    "ok", "503", "502", "500", "400", "reset" (close without answering), "sleep:S" (answer
    after S seconds), "abort:K" (finish_reason "abort" after K tokens). Empty plan = "ok"."""

    def __init__(self) -> None:
        self.plan: list[str] = []
        self.load_plan: list[Any] = []  # per bapo_load call: "ok" | 500 | {"ok": False, ...}
        self.paused = False
        self.version: int | None = 0
        self.poisoned = False
        self.weight_version = "0"
        self.calls: list[tuple[str, Any]] = []
        self.connections = 0
        self.lock = threading.Lock()
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
                path = urllib.parse.urlparse(self.path).path
                fake.record(path, None)
                if path == "/is_paused":
                    self._reply(200, {"is_paused": fake.paused})
                elif path == "/weight_info":
                    self._reply(200, {"weight_version": fake.weight_version})
                else:
                    self._reply(200, {})

            def do_POST(self) -> None:
                url = urllib.parse.urlparse(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length) or b"null")
                fake.record(url.path, body)
                handler = getattr(fake, "on_" + url.path.strip("/").replace("/", "_"), None)
                if handler is None:
                    self._reply(404, {"error": f"no route {url.path}"})
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

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def record(self, path: str, body: Any) -> None:
        with self.lock:
            self.calls.append((path, body))

    def count(self, path: str) -> int:
        with self.lock:
            return sum(1 for p, _ in self.calls if p == path)

    def bodies(self, path: str) -> list[Any]:
        with self.lock:
            return [b for p, b in self.calls if p == path]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # ---- routes --------------------------------------------------------------------------------
    def on_v1_completions(self, body: dict, query: dict):
        with self.lock:
            action = self.plan.pop(0) if self.plan else "ok"
        deadline = time.monotonic() + 20.0
        while self.paused and time.monotonic() < deadline:  # a paused vLLM holds requests
            time.sleep(0.02)
        if action == "reset":
            return "reset"
        if action.startswith("sleep:"):
            time.sleep(float(action.split(":")[1]))
        elif action in ("503", "502", "500", "400"):
            return int(action), {"error": {"message": f"scripted {action}"}}
        prompt = body["prompt"][0]
        m = body["max_tokens"]
        abort_after = int(action.split(":")[1]) if action.startswith("abort:") else None
        choices = []
        for j in range(body["n"]):
            ids = expected_ids(prompt, body["seed"], j, m)
            finish = "length"
            if abort_after is not None:
                ids, finish = ids[:abort_after], "abort"
            choices.append(
                {
                    "index": j,
                    "token_ids": ids,
                    "finish_reason": finish,
                    "logprobs": {
                        "tokens": [f"token_id:{i}" for i in ids],
                        "token_logprobs": [-(k + 1) / 10 for k in range(len(ids))],
                    },
                }
            )
        return 200, {"choices": choices}

    def on_pause(self, body, query):
        self.paused = True
        return 200, {"status": "paused"}

    def on_resume(self, body, query):
        self.paused = False
        return 200, {"status": "resumed"}

    def on_reset_prefix_cache(self, body, query):
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
