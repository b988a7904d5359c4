"""A pool of reward worker processes with a hard per-check timeout enforced by the parent.

math-verify bounds its own time with SIGALRM, which only works in a process's main thread
and cannot interrupt long C-level work (a big-integer power holds the interpreter). So every
check runs in a separate process (`bapo_jax.rewards.worker`), and the parent, which only
waits on pipes, kills a worker that overruns `timeout_s` and starts a replacement. A worker
that dies (segfault, out of memory, killed from outside) is replaced the same way. The check
it was running scores 0 and is counted; nothing is raised to the trainer.

The same workers run reward plug-ins (`rewards.fn = "package.module:function"`,
`bapo_jax.rewards.plugins`): a pool made with `plugin=spec` checks the spec in this process
before any worker starts, each worker imports it, and `score_batch(..., reward=spec)` sends
the whole response, the answer and the prompt's metadata to a worker, under the same
timeouts. A plug-in that raises, hangs, or returns NaN/inf or a non-number scores 0 and is
counted; the shipped "exact_match" reward is computed here, without a worker.

The parent side is plain subprocess + selectors: no fork of the (possibly multi-threaded,
JAX-holding) trainer process, no pickling, and it is safe to call from any thread (calls
are serialised by a lock).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import math
import os
import select
import selectors
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bapo_jax.rewards import plugins
from bapo_jax.rewards.boxed import extract_last_boxed

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])
_MAX_START_FAILURES = 3
_MAX_ATTEMPTS = 2  # a check whose worker dies is retried once
# A worker's status of a check or plug-in call -> the `PoolStats` counter it increments.
_STATUS_COUNTERS = {
    "soft_timeout": "soft_timeouts",
    "error": "errors",
    plugins.PLUGIN_ERROR: "plugin_errors",
    plugins.NON_FINITE: "non_finite",
    plugins.BAD_RETURN: "bad_returns",
}


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """Counters since the pool was created.

    checks: responses scored (including those that never reached a worker).
    no_answer: responses without a complete, non-empty `\\boxed{}` (score 0, no worker).
    too_long: boxed answers longer than `max_answer_chars` (score 0, no worker).
    soft_timeouts: checks the worker interrupted itself (worker kept).
    hard_timeouts: checks the parent killed after `timeout_s` (worker replaced).
    worker_crashes: workers that died on their own while checking (worker replaced).
    worker_restarts: replacement workers started (hard timeouts + crashes + failed starts).
    errors: checks that raised inside the worker (parse errors, MemoryError, ...).
    plugin_errors: plug-in calls that raised.
    non_finite: plug-in calls that returned NaN or +-inf.
    bad_returns: plug-in calls that returned neither a number nor a mapping with a numeric
      "score".
    Every one of these scored 0. Plug-in calls that overrun count in soft/hard_timeouts.
    """

    checks: int = 0
    no_answer: int = 0
    too_long: int = 0
    soft_timeouts: int = 0
    hard_timeouts: int = 0
    worker_crashes: int = 0
    worker_restarts: int = 0
    errors: int = 0
    plugin_errors: int = 0
    non_finite: int = 0
    bad_returns: int = 0

    @property
    def timeouts(self) -> int:
        return self.soft_timeouts + self.hard_timeouts


class _Batch:
    """The scheduling state of one `score_batch` call."""

    def __init__(self, tasks: dict[int, dict]):
        self.tasks = tasks  # index -> request
        self.pending = collections.deque(tasks)  # indices not yet sent (or to retry)
        self.results: dict[int, float] = {}
        self.attempts = collections.Counter()
        self.counts = collections.Counter()  # this call's share of the pool's counters


class _Worker:
    """One worker process and the parent's view of it (starting, idle or busy)."""

    def __init__(self, command: list[str], env: dict[str, str], startup_timeout_s: float):
        self.proc = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            close_fds=True,
            start_new_session=True,  # a Ctrl-C aimed at the trainer does not hit the workers
        )
        self.fd = self.proc.stdout.fileno()
        self.buffer = bytearray()
        self.ready = False
        self.deadline = time.monotonic() + startup_timeout_s
        self.task: int | None = None  # index of the task it is checking, in `batch`
        self.batch: _Batch | None = None  # (an interrupted call's batch absorbs its result)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def send(self, message: dict) -> None:
        self.proc.stdin.write((json.dumps(message) + "\n").encode())
        self.proc.stdin.flush()

    def read_messages(self) -> list[dict] | None:
        """Messages that arrived (reads once; call when readable). None = the pipe closed."""
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            return None
        self.buffer.extend(chunk)
        messages = []
        while (end := self.buffer.find(b"\n")) >= 0:
            messages.append(json.loads(self.buffer[:end]))
            del self.buffer[: end + 1]
        return messages

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):  # a broken pipe: the process is gone anyway
                stream.close()


class RewardPool:
    """Scores responses against gold answers in worker processes, each check time-bounded.

    Args:
      num_workers: worker processes (default: min(4, CPU count)).
      plugin: a reward plug-in "package.module:function" (`rewards.plugins`) each worker
        imports at start, for `score_batch(..., reward=plugin)`. It is imported and checked
        here first: a bad spec raises `PluginError` naming rewards.fn before any worker starts.
      timeout_s: hard wall-clock limit per check; an overrunning worker is killed.
      soft_timeout_fraction: the worker interrupts its own check after this fraction of
        `timeout_s` (no restart needed); None disables it.
      max_answer_chars: longer boxed answers score 0 without a check (the longest gold
        answer of the shipped sets has 159 characters). None = no limit.
      memory_limit_bytes: address-space limit of each worker (0 = none).
      startup_timeout_s: time a new worker may take to import sympy and warm up.
    """

    def __init__(
        self,
        num_workers: int | None = None,
        *,
        plugin: str | None = None,
        timeout_s: float = 10.0,
        soft_timeout_fraction: float | None = 0.5,
        max_answer_chars: int | None = 1000,
        memory_limit_bytes: int = 4 << 30,
        startup_timeout_s: float = 120.0,
    ):
        if num_workers is None:
            num_workers = max(1, min(4, os.cpu_count() or 1))
        if not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if soft_timeout_fraction is not None and not 0 < soft_timeout_fraction < 1:
            raise ValueError(
                f"soft_timeout_fraction must be in (0, 1) or None, got {soft_timeout_fraction}"
            )
        soft_timeout_s = (
            None if soft_timeout_fraction is None else soft_timeout_fraction * timeout_s
        )
        if max_answer_chars is not None and max_answer_chars < 1:
            raise ValueError(f"max_answer_chars must be >= 1 or None, got {max_answer_chars}")
        if memory_limit_bytes < 0:
            raise ValueError(f"memory_limit_bytes must be >= 0, got {memory_limit_bytes}")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s}")
        self.plugin = None if plugin is None else plugins.load_plugin(plugin)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.soft_timeout_s = soft_timeout_s
        self.max_answer_chars = max_answer_chars
        self.startup_timeout_s = float(startup_timeout_s)
        self._command = [sys.executable, "-m", "bapo_jax.rewards.worker"]
        self._command += ["--cpu-budget-s", str(max(2 * self.timeout_s, self.timeout_s + 5))]
        self._command += ["--memory-limit-bytes", str(memory_limit_bytes)]
        if soft_timeout_s is not None:
            self._command += ["--soft-timeout-s", str(soft_timeout_s)]
        roots = [_PACKAGE_ROOT]
        if self.plugin is not None:
            self._command += ["--plugin", self.plugin.spec]
            root = plugins.plugin_root(self.plugin.spec)  # where this process imported it from
            if root is not None and root != _PACKAGE_ROOT:
                roots.insert(0, root)
        self._env = dict(os.environ)
        path = self._env.get("PYTHONPATH")
        self._env["PYTHONPATH"] = os.pathsep.join(roots + ([path] if path else []))
        self._env["OMP_NUM_THREADS"] = "1"
        self._lock = threading.Lock()
        self._counts = collections.Counter()
        self._start_failures = 0
        self._closed = False
        self._owner_pid = os.getpid()
        self._workers: list[_Worker] = []
        self._selector = selectors.DefaultSelector()
        try:
            for _ in range(num_workers):
                self._add_worker()
            self._run(_Batch({}), wait_for_startup=True)
        except BaseException:
            self.close()
            raise

    # -- public API -------------------------------------------------------------------------

    def score(self, response: str, answer: str | int) -> float:
        """1.0 if the last `\\boxed{}` of `response` equals `answer`, else 0.0."""
        return float(self.score_batch([response], [answer])[0])

    def score_batch(
        self,
        responses: Sequence[str],
        answers: Sequence[str | int],
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        reward: str = plugins.MATH_VERIFY,
    ) -> np.ndarray:
        """Scores of many responses, checked in parallel over the workers: float32 [B], in
        the order of `responses`. See `score_batch_with_stats`."""
        return self.score_batch_with_stats(responses, answers, metadata, reward=reward)[0]

    def score_batch_with_stats(
        self,
        responses: Sequence[str],
        answers: Sequence[str | int],
        metadata: Sequence[Mapping[str, Any] | None] | None = None,
        *,
        reward: str = plugins.MATH_VERIFY,
    ) -> tuple[np.ndarray, PoolStats]:
        """(scores float32 [B], this call's counters) of many responses.

        reward: "math_verify" (1.0 / 0.0: the last `\\boxed{}` equals the answer under
        math-verify), "exact_match" (`plugins.exact_match`, computed here), or this pool's
        `plugin` spec (whatever finite number the plug-in returns; failures score 0).
        metadata: one JSON-able mapping per response (None = {}), passed to the plug-in;
        the shipped rewards ignore it. Worker restarts are left out of the call's counters.
        """
        allowed = (*plugins.BUILTIN_REWARDS, *([self.plugin.spec] if self.plugin else []))
        if reward not in allowed:
            raise ValueError(f"reward must be one of {allowed} for this pool, got {reward!r}")
        if isinstance(responses, str) or isinstance(answers, str):
            raise ValueError("responses and answers must be sequences of strings, not a str")
        if len(responses) != len(answers):
            raise ValueError(
                f"responses and answers must have the same length, got {len(responses)} and "
                f"{len(answers)}"
            )
        for index, response in enumerate(responses):
            if not isinstance(response, str):
                raise ValueError(f"responses[{index}] must be a str, got {type(response).__name__}")
        metas = plugins.metadata_dicts(metadata, len(responses))
        scores = np.zeros(len(responses), np.float32)  # [B]
        tasks: dict[int, dict] = {}
        counts = collections.Counter(checks=len(responses))
        if reward == plugins.MATH_VERIFY:
            golds = [_gold_text(answer, index) for index, answer in enumerate(answers)]
            for index, response in enumerate(responses):
                pred = extract_last_boxed(response)
                if not pred:
                    counts["no_answer"] += 1
                elif self.max_answer_chars is not None and len(pred) > self.max_answer_chars:
                    counts["too_long"] += 1
                else:
                    tasks[index] = {"id": index, "pred": pred, "gold": golds[index]}
        elif reward == plugins.EXACT_MATCH:
            golds = [_gold_text(answer, index) for index, answer in enumerate(answers)]
            for index, response in enumerate(responses):
                scores[index] = plugins.exact_match(response, golds[index])
        else:
            for index, (response, answer) in enumerate(zip(responses, answers, strict=True)):
                if isinstance(answer, bool) or not isinstance(answer, (str, int)):
                    raise ValueError(
                        f"answers[{index}] must be a str or int, got {type(answer).__name__}"
                    )
                tasks[index] = {
                    "id": index,
                    "plugin": True,
                    "response": response,
                    "answer": str(answer),
                    "metadata": metas[index],
                }
        with self._lock:
            self._check_usable()
            batch = _Batch(tasks)
            batch.counts.update(counts)
            self._counts.update(counts)
            self._run(batch)
        for index, score in batch.results.items():
            scores[index] = score
        return scores, PoolStats(
            **{f.name: batch.counts[f.name] for f in dataclasses.fields(PoolStats)}
        )

    def wait_ready(self) -> None:
        """Block until every worker (replacements included) has started and warmed up."""
        with self._lock:
            self._check_usable()
            self._run(_Batch({}), wait_for_startup=True)

    @property
    def stats(self) -> PoolStats:
        with self._lock:
            return PoolStats(
                **{f.name: self._counts[f.name] for f in dataclasses.fields(PoolStats)}
            )

    def worker_pids(self) -> list[int]:
        """Process ids of the current workers (they change when workers are replaced)."""
        with self._lock:
            return [worker.pid for worker in self._workers]

    def close(self) -> None:
        """Stop every worker (idempotent). Only the process that created the pool does this."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._owner_pid:
            return  # a forked child: the workers belong to the parent
        for worker in self._workers:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(worker.fd)
            worker.kill()
        self._workers.clear()
        self._selector.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    # -- scheduling -------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("this RewardPool is closed")
        if os.getpid() != self._owner_pid:
            raise RuntimeError(
                "this RewardPool was created in another process (fork); create a new pool"
            )

    def _add_worker(self) -> None:
        worker = _Worker(self._command, self._env, self.startup_timeout_s)
        self._workers.append(worker)
        self._selector.register(worker.fd, selectors.EVENT_READ, worker)

    def _count(self, name: str, batch: _Batch | None) -> None:
        """One more `name` in the pool's counters and in those of the call running `batch`."""
        self._counts[name] += 1
        if batch is not None:
            batch.counts[name] += 1

    def _replace(self, worker: _Worker) -> None:
        self._selector.unregister(worker.fd)
        worker.kill()
        self._workers.remove(worker)
        self._counts["worker_restarts"] += 1
        self._add_worker()

    def _run(self, batch: _Batch, *, wait_for_startup: bool = False) -> None:
        """Run every task of `batch` to a score. Workers still starting keep starting in the
        background unless `wait_for_startup`."""

        def waiting(worker: _Worker) -> bool:
            return worker.task is not None or (wait_for_startup and not worker.ready)

        while batch.pending or any(waiting(w) for w in self._workers):
            for worker in list(self._workers):  # _dispatch may replace a dead worker
                if worker.ready and worker.task is None and batch.pending:
                    self._dispatch(worker, batch)
            now = time.monotonic()
            # Busy and starting workers both have deadlines; a starting one may become ready.
            watched = [w for w in self._workers if w.task is not None or not w.ready]
            next_deadline = min((w.deadline for w in watched), default=now)
            for key, _ in self._selector.select(timeout=max(0.0, next_deadline - now)):
                self._on_readable(key.data)
            now = time.monotonic()
            for worker in list(self._workers):
                if (worker.task is not None or not worker.ready) and worker.deadline <= now:
                    self._on_deadline(worker)

    def _dispatch(self, worker: _Worker, batch: _Batch) -> None:
        index = batch.pending.popleft()
        try:
            worker.send(batch.tasks[index])
        except OSError:  # BrokenPipeError: it died before it saw the task; retry the task
            batch.pending.appendleft(index)
            self._count("worker_crashes", batch)
            self._replace(worker)
            return
        batch.attempts[index] += 1
        worker.task, worker.batch = index, batch
        worker.deadline = time.monotonic() + self.timeout_s

    def _on_readable(self, worker: _Worker) -> None:
        messages = worker.read_messages()
        if messages is None:  # the worker exited
            self._on_exit(worker)
            return
        for message in messages:
            if "fatal" in message:  # the plug-in does not load in a worker: it never will
                self.close()
                raise plugins.PluginError(
                    f"{message['fatal']} (in a reward worker process; its PYTHONPATH is "
                    f"{self._env['PYTHONPATH']!r})"
                )
            if message.get("ready"):
                worker.ready = True
                worker.deadline = math.inf
                self._start_failures = 0
            elif worker.task is not None and message.get("id") == worker.task:
                worker.batch.results[worker.task] = float(message["score"])
                if message["status"] != "ok":
                    self._count(_STATUS_COUNTERS[message["status"]], worker.batch)
                worker.task, worker.batch = None, None

    def _on_exit(self, worker: _Worker) -> None:
        if not worker.ready:
            self._start_failed()
        else:
            batch = worker.batch
            self._count("worker_crashes", batch)
            if worker.task is not None:
                # Killed from outside, or the task crashed it: retry once, then score 0.
                if batch.attempts[worker.task] < _MAX_ATTEMPTS:
                    batch.pending.appendleft(worker.task)
                else:
                    batch.results[worker.task] = 0.0
        self._replace(worker)

    def _on_deadline(self, worker: _Worker) -> None:
        # The answer may sit in the pipe (the parent was slow to look): take it if so.
        if worker.task is not None and _has_input(worker.fd):
            self._on_readable(worker)
            if worker not in self._workers or worker.task is None:
                return
        if not worker.ready:
            self._start_failed()
        else:
            self._count("hard_timeouts", worker.batch)
            worker.batch.results[worker.task] = 0.0
        self._replace(worker)

    def _start_failed(self) -> None:
        self._start_failures += 1
        if self._start_failures >= _MAX_START_FAILURES:
            self.close()
            raise RuntimeError(
                f"reward workers failed to start {self._start_failures} times in a row "
                f"(command: {' '.join(self._command)}; see stderr for the worker's error)"
            )


def _has_input(fd: int) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    return bool(poller.poll(0))


def _gold_text(answer: str | int, index: int) -> str:
    if isinstance(answer, bool) or not isinstance(answer, (str, int)):
        raise ValueError(f"answers[{index}] must be a str or int, got {type(answer).__name__}")
    text = str(answer).strip()
    if not text:
        raise ValueError(f"answers[{index}] must be a non-empty answer, got {answer!r}")
    return text
