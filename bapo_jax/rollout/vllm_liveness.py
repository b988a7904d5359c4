"""A frozen vLLM server survived: health probes while the engine is open, out of rotation when
one stops answering, back once it answers again on the current weights.

A server whose process stops without dying (a hung driver, SIGSTOP, a network partition) sends
no RST: its in-flight requests would wait for their read timeout (``request_timeout_s``,
minutes) and new ones would keep choosing it. `Liveness` probes every server's ``/health``
(with the run's bearer token) every ``unresponsive_after_s / 4`` seconds, each probe waiting up
to half of it, all servers at once in a small pool so that a silent one does not delay the
others' probes. A server that has answered no probe for ``unresponsive_after_s`` (default 20 s;
so it is out within 1.75 times that) is marked ``unresponsive``: it
leaves the rotation, and every request waiting on it gives up at once (`VLLMEngine` waits on
its reply and on that mark together) and is resubmitted to the others with its own seed, so
the batch is the one an undisturbed run samples (the same samples where sampling is seeded;
nothing lost, nothing twice: the abandoned reply is dropped if it ever comes). Updates skip it.

When it answers a probe again, ``rejoin(server)`` (the engine's) brings it to the current
version first (pause, reload the last good version, tag, reset, resume) unless it already holds
it, and only then puts it back in rotation; a rejoin that fails is tried at the next answered
probe. Servers given by URL get the same treatment (they cannot be restarted, but they can be
re-admitted). ``events`` records each change with its time, for logs and tests.

Limits: a server that freezes inside a weight update is not covered here (the load RPC waits
for its own timeout); it is detected as soon as the update ends. vLLM 0.32 answers ``/health``
from its API server process without asking the engine core: a stopped API server, a stopped
server or a partition is seen; an engine core stuck behind a live API server only by the
request timeout. Each client brings a server that answers again to its own current version:
two clients of one server at different versions would undo each other (close the one not in
use: `VLLMEngine.close()` stops its probes).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections.abc import Callable, Sequence

import requests

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
        if token:
            self._session.headers["Authorization"] = f"Bearer {token}"
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
