"""A reward worker process: `python -m bapo_jax.rewards.worker [limits]`.

Started by `RewardPool`, one process per worker. Protocol, one JSON object per line:

    stdin  <- {"id": 7, "pred": "\\frac{1}{2}", "gold": "0.5"}
    stdout -> {"ready": true, "pid": 1234}                 (once, after warm-up)
    stdout -> {"id": 7, "score": 1.0, "status": "ok"}      (one per request, in order)

The process protects itself as well as it can; the parent's hard timeout is the guarantee:
- an address-space limit (RLIMIT_AS), so a runaway big-number computation fails with
  MemoryError instead of eating the machine;
- a CPU budget per request (RLIMIT_CPU, raised before each request): if the parent is gone
  and nobody kills a stuck request, the kernel does (SIGXCPU);
- an interval timer (`--soft-timeout-s`) that interrupts interruptible Python work, so most
  slow checks end with status "soft_timeout" without a restart;
- no core dumps; the protocol uses a private copy of fd 1, and fd 1 itself points at stderr,
  so a stray print in a library cannot corrupt the protocol.
It exits when stdin closes (the parent closed the pool or died).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

from bapo_jax.rewards import checker


def _set_limit(kind: int, soft: int) -> None:
    _, hard = resource.getrlimit(kind)
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(kind, (soft, hard))


def _cpu_seconds_used() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bapo_jax.rewards.worker")
    parser.add_argument("--soft-timeout-s", type=float, default=None)
    parser.add_argument("--cpu-budget-s", type=float, default=60.0)
    parser.add_argument("--memory-limit-bytes", type=int, default=0, help="0 = no limit")
    args = parser.parse_args(argv)

    protocol_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    _set_limit(resource.RLIMIT_CORE, 0)
    if args.memory_limit_bytes > 0:
        _set_limit(resource.RLIMIT_AS, args.memory_limit_bytes)

    def send(message: dict) -> None:
        protocol_out.write(json.dumps(message) + "\n")
        protocol_out.flush()

    checker.warm_up()
    send({"ready": True, "pid": os.getpid()})
    for line in sys.stdin.buffer:
        request = json.loads(line)
        # The CPU budget counts from now: a check that burns it is killed by the kernel.
        _set_limit(resource.RLIMIT_CPU, int(_cpu_seconds_used() + args.cpu_budget_s) + 1)
        score, status = checker.score_answer(request["pred"], request["gold"], args.soft_timeout_s)
        send({"id": request["id"], "score": score, "status": status})
    return 0


if __name__ == "__main__":
    sys.exit(main())
