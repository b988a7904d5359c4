"""Launches a test worker script as several JAX processes on this machine (jax.distributed on
localhost, gloo collectives between the processes' simulated CPU devices)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Sequence

from bapo_jax.sharding import distributed
from tests.child_env import child_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(
    worker: str, args: Sequence[str], *, num_processes: int, devices_per_process: int
) -> list[subprocess.Popen]:
    """`python worker *args` as processes 0 .. num_processes - 1 of one JAX run (the launcher
    environment of `distributed.maybe_initialize`); collect them with `wait`."""
    port = free_port()
    procs = []
    for i in range(num_processes):
        env = child_env(
            devices_per_process,
            PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **{
                distributed.COORDINATOR_ENV: f"127.0.0.1:{port}",
                distributed.NUM_PROCESSES_ENV: str(num_processes),
                distributed.PROCESS_ID_ENV: str(i),
            },
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, worker, *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def wait(procs: Sequence[subprocess.Popen], timeout_s: float) -> list[subprocess.CompletedProcess]:
    """Their outputs, together bounded by `timeout_s`; the survivors are killed on any failure
    or timeout."""
    results = []
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=max(deadline - time.monotonic(), 1.0))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return results


def launch(
    worker: str,
    args: Sequence[str],
    *,
    num_processes: int,
    devices_per_process: int,
    timeout_s: float,
) -> list[subprocess.CompletedProcess]:
    """`start` then `wait`."""
    procs = start(
        worker, args, num_processes=num_processes, devices_per_process=devices_per_process
    )
    return wait(procs, timeout_s)


def check_all_succeeded(results: Sequence[subprocess.CompletedProcess]) -> None:
    for i, r in enumerate(results):
        assert r.returncode == 0, f"process {i} failed (exit {r.returncode}):\n{r.stderr[-4000:]}"
