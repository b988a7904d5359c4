"""A reward worker process: `python -m bapo_jax.rewards.worker [limits]`.

Started by `RewardPool`, one process per worker. Protocol, one JSON object per line:

    stdin  <- {"id": 7, "pred": "\\frac{1}{2}", "gold": "0.5"}     (a math-verify check)
    stdin  <- {"id": 8, "plugin": true, "response": "...", "answer": "...", "metadata": {}}
    stdout -> {"ready": true, "pid": 1234}                 (once, after warm-up)
    stdout -> {"fatal": "rewards.fn=...: ..."}             (instead: the plug-in did not load)
    stdout -> {"id": 7, "score": 1.0, "status": "ok"}      (one per request, in order)

With `--plugin package.module:function` the worker imports that reward plug-in at start
(`rewards.plugins`) and serves plug-in requests with it; math-verify requests are always
served. A plug-in's exception, NaN/inf or non-number result scores 0 with its own status
("plugin_error", "non_finite", "bad_return"); it runs under the same limits as a check.

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

from bapo_jax.rewards import checker, plugins


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
    parser.add_argument("--plugin", default=None, help="a reward plug-in, package.module:fn")
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

    plugin = None
    if args.plugin is not None:
        try:
            plugin = plugins.load_plugin(args.plugin)
        except plugins.PluginError as error:
            send({"fatal": str(error)})
            return 3
    checker.warm_up()
    send({"ready": True, "pid": os.getpid()})
    for line in sys.stdin.buffer:
        request = json.loads(line)
        # The CPU budget counts from now: a check that burns it is killed by the kernel.
        _set_limit(resource.RLIMIT_CPU, int(_cpu_seconds_used() + args.cpu_budget_s) + 1)
        if request.get("plugin"):
            score, status = _score_plugin(plugin, request, args.soft_timeout_s)
        else:
            score, status = checker.score_answer(
                request["pred"], request["gold"], args.soft_timeout_s
            )
        send({"id": request["id"], "score": score, "status": status})
    return 0


def _score_plugin(
    plugin: plugins.Plugin | None, request: dict, soft_timeout_s: float | None
) -> tuple[float, str]:
    if plugin is None:  # the parent only sends plug-in requests to a worker started with one
        return 0.0, plugins.PLUGIN_ERROR
    try:
        with checker.soft_timeout(soft_timeout_s):
            return plugins.call_plugin(
                plugin, request["response"], request["answer"], request["metadata"]
            )
    except checker.SoftTimeout:
        return 0.0, checker.SOFT_TIMEOUT


if __name__ == "__main__":
    sys.exit(main())
