"""The CPU main job's RL loop on a real vLLM server: what the sync costs, what k = 1 hides, and
what in-flight weight updates hide on top.

    python -m benchmarks.vllm_loop [--steps 12] [--inflight] [--mix main|long-tailed]
                                   [--vllm-python PATH] [--workdir DIR]

One vLLM server (core 1, as `experiments.cpu_arithmetic --engine vllm` launches it) serves the
main job's model; the trainer runs on core 0. From the same warm start the loop runs `steps`
iterations twice, in this one process against this one server:

    default       k = 1 (the main job's vLLM setting: batch i + 1 is generated while the
                  trainer updates on batch i) against the baseline k = 0 (every batch is
                  generated, then trained on);
    --inflight    k = 1 with the drain (the default loop: the next batch finishes before the
                  sync) against k = 1 in flight (`offpolicy.inflight`: the sync runs while
                  the next batch generates, running requests frozen and continued on the new
                  weights).

`--mix long-tailed` samples at temperature 2.0 with a 128-token cap (the main job: 1.0 and 32),
so that a few responses run far longer than the rest, on a server that runs 8 sequences at a
time (the main job's: all 256 of a batch), as one whose KV cache is full: generation then takes
longer than the update, as on a pod, and a batch ends with a tail of long responses.

Per setting it prints the mean seconds per iteration (the loop's wall time / steps, the first
iteration excluded: it compiles), the sync (write + worker load) as a share of that, the
share of the sync hidden behind generation (`time/sync_write_hidden` + `time/sync_load_hidden`
over write + load; with k = 0, or when the update outlasts the generation, there is none to
hide behind), the sync's visible wait (`time/sync`), the generation seconds and the share of
them hidden behind the updates (`overlap/hidden_share`), the seconds the trainer waited for
rollouts (`time/wait_rollout` + `time/drain_rollout`: production, i.e. generation, rewards and
the trainer's log-prob check, not hidden by anything); the
response lengths (mean and longest per batch); with --inflight, the share of responses whose
tokens carry two versions and, over every trained token, the tokens older than scheduled
(`version_mismatch/tokens`) and the largest |vLLM - trainer| log-prob under each token's
reported version (`agreement/max_abs`); then the ratio of iteration times (< 1: it pays).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from bapo_jax.rollout import serve
from bapo_jax.run import build
from bapo_jax.run.config import RunConfig
from bapo_jax.tasks import arithmetic_job as job
from bapo_jax.tasks import job_report
from experiments import cpu_arithmetic as main_job

# --mix long-tailed: (temperature, response cap), and the sequences the server runs at once.
LONG_TAILED = (2.0, 128)
LONG_TAILED_SEQS = 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_config(mix: str) -> RunConfig:
    """The main job's vLLM run, with the sampling of `mix` and a server sized for it."""
    run = main_job.VLLM_RUN
    if mix == "main":
        return run
    temperature, cap = LONG_TAILED
    rollout = dataclasses.replace(
        run.trainer.rollout, temperature=temperature, max_response_tokens=cap
    )
    length = rollout.max_prompt_tokens + cap  # whole sequences per step: no chunked prefill
    # 8 sequences at a time (the main job: all 256), as a server whose KV cache is full: the
    # batch runs in waves, and the last wave's long responses are its tail.
    seqs = LONG_TAILED_SEQS
    args = ("--max-num-seqs", str(seqs), "--max-num-batched-tokens", str(seqs * length))
    return dataclasses.replace(
        run,
        trainer=dataclasses.replace(run.trainer, rollout=rollout),
        engine=dataclasses.replace(
            run.engine, server=dataclasses.replace(run.engine.server, args=args)
        ),
    )


def against(
    prepared: job.Prepared, base: RunConfig, url: str, steps: int, **offpolicy: Any
) -> RunConfig:
    """`base` for `steps` iterations from the warm start against the server at `url`: no eval,
    no progress bar or plots, the off-policy settings replaced."""
    trainer = dataclasses.replace(
        base.trainer,
        steps=steps,
        eval_every=0,
        eval_at_start=False,
        offpolicy=dataclasses.replace(base.trainer.offpolicy, **offpolicy),
        logging=dataclasses.replace(base.trainer.logging, progress=False, plots=False),
    )
    return dataclasses.replace(
        base,
        trainer=trainer,
        model=dataclasses.replace(base.model, hf_dir=prepared.hf_dir),
        engine=dataclasses.replace(
            base.engine,
            launch_servers=0,
            server=dataclasses.replace(base.engine.server, cpu_cores=()),
            vllm_urls=(url,),
        ),
    )


@contextlib.contextmanager
def serving(
    base: RunConfig, prepared: job.Prepared, root: str, python: str
) -> Iterator[tuple[RunConfig, str]]:
    """One vLLM server of `base`'s settings for the warm start, on a free port; yields `base`
    with the server's secret and the server's URL, and stops it."""
    spec = build.server_spec(
        dataclasses.replace(
            base,
            model=dataclasses.replace(base.model, hf_dir=prepared.hf_dir),
            engine=dataclasses.replace(
                base.engine,
                server=dataclasses.replace(base.engine.server, port=_free_port(), python=python),
            ),
        ),
        root,  # every measured run's sync directory is below
    )
    group = serve.ServerGroup(spec, 1, log_dir=os.path.join(root, "logs"))
    try:
        group.wait_healthy()
        secret = dataclasses.replace(base.engine.server, secret_file=group.secret_file)
        yield (
            dataclasses.replace(base, engine=dataclasses.replace(base.engine, server=secret)),
            (group.urls[0]),
        )
    finally:
        group.stop()


def measure(
    prepared: job.Prepared,
    base: RunConfig,
    url: str,
    staleness: int,
    steps: int,
    out_dir: str,
    inflight: bool = False,
) -> dict:
    """One run of `steps` iterations with staleness k against the server at `url`."""
    config = against(prepared, base, url, steps, staleness=staleness, inflight=inflight)
    shutil.rmtree(out_dir, ignore_errors=True)  # a kept --workdir: never resume an old run
    job.run_rl(prepared, config, out_dir)
    rows = job_report.read_rows(out_dir)[1:]  # the first iteration compiles the step
    # An iteration's wall time: waiting for its batch + updating + draining + syncing.
    keys = ("time/wait_rollout", "time/update", "time/drain_rollout", "time/sync")
    iteration = [sum(r[k] for k in keys) for r in rows]
    sync = [r["time/sync_write"] + r["time/sync_load"] for r in rows]
    sync_hidden = [r["time/sync_write_hidden"] + r["time/sync_load_hidden"] for r in rows]
    generated = sum(r.get("overlap/generation_s", 0.0) for r in rows)
    hidden = sum(r.get("overlap/hidden_s", 0.0) for r in rows)
    generate = sum(r["time/generate"] for r in rows)
    return {
        "iteration_s": float(np.mean(iteration)),
        "sync_s": float(np.mean(sync)),
        "sync_share": float(np.sum(sync) / np.sum(iteration)),
        "sync_hidden_share": float(np.sum(sync_hidden) / np.sum(sync)),
        "sync_wait_s": float(np.mean([r["time/sync"] for r in rows])),
        "generate_s": generate / len(rows),
        "update_s": float(np.mean([r["time/update"] for r in rows])),
        "hidden_share": hidden / generated if generated else 0.0,
        "waited_s": float(
            np.mean([r["time/wait_rollout"] + r["time/drain_rollout"] for r in rows])
        ),
        "length_mean": float(np.mean([r["response_length/mean"] for r in rows])),
        "length_max": float(np.mean([r["response_length/max"] for r in rows])),
        "mixed_version_frac": float(np.mean([r["mixed_version_frac"] for r in rows])),
        "older_tokens": int(sum(r["version_mismatch/tokens"] for r in rows)),
        "agreement_max_abs": float(max(r["agreement/max_abs"] for r in rows)),
        "checked_tokens": int(sum(r["agreement/tokens"] for r in rows)),
        "trained_tokens": int(sum(r["trained_tokens"] for r in rows)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--inflight", action="store_true", help="k = 1: drain vs in flight")
    ap.add_argument("--mix", choices=("main", "long-tailed"), default="main")
    ap.add_argument(
        "--vllm-python", default=None, help="default $BAPO_VLLM_PYTHON, else .venv-vllm"
    )
    ap.add_argument("--workdir", default=None, help="default: a temp dir (removed at the end)")
    args = ap.parse_args()
    if args.steps < 2:
        raise SystemExit(
            f"--steps must be >= 2 (the first iteration is not timed), got {args.steps}"
        )
    python = serve.vllm_python(args.vllm_python)
    if (why := serve.missing_vllm_python(python)) is not None:
        raise SystemExit(f"error: {why}")
    base = run_config(args.mix)
    # name -> (staleness, in flight); the first is the one compared, the second the baseline
    settings = (
        {"in flight": (1, True), "drain": (1, False)}
        if args.inflight
        else {"k=1": (1, False), "k=0": (0, False)}
    )
    root = args.workdir or tempfile.mkdtemp(prefix="bapo-vllm-loop-bench-")
    try:
        trainer = base.trainer
        prepared = job.prepare(
            main_job.TASK,
            main_job.SHAPE,
            main_job.WARM_START,
            args.steps * trainer.rollout.prompts_per_step,
            os.path.join(root, "warm_start"),
            eval_max_tokens=trainer.rollout.max_response_tokens,
        )
        with serving(base, prepared, root, python) as (base, url):
            results = {
                name: measure(
                    prepared,
                    base,
                    url,
                    k,
                    args.steps,
                    os.path.join(root, name.replace(" ", "_").replace("=", "")),
                    inflight,
                )
                for name, (k, inflight) in settings.items()
            }
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(
        f"vLLM loop, {args.mix} mix, {args.steps - 1} timed iterations each (trainer core 0, "
        "server core 1):"
    )
    for name, r in results.items():
        line = (
            f"  {name}: {r['iteration_s']:.2f} s/iteration, sync {r['sync_s']:.3f} s "
            f"({100 * r['sync_share']:.1f}% of it; {100 * r['sync_hidden_share']:.0f}% of the "
            f"sync hidden by generation, {r['sync_wait_s']:.3f} s waited for), "
            f"generation {r['generate_s']:.2f} s ({100 * r['hidden_share']:.0f}% hidden by the "
            f"update), {r['waited_s']:.2f} s waited for rollouts, update {r['update_s']:.2f} s, "
            f"responses {r['length_mean']:.1f} tokens on average, longest {r['length_max']:.0f}"
        )
        if args.inflight:
            line += (
                f"; {100 * r['mixed_version_frac']:.1f}% of responses with two versions, "
                f"{r['older_tokens']} tokens older than scheduled, log-prob |vLLM - trainer| "
                f"<= {r['agreement_max_abs']:.1e} over {r['checked_tokens']} of "
                f"{r['trained_tokens']} trained tokens"
            )
        print(line)
    first, second = results
    ratio = results[first]["iteration_s"] / results[second]["iteration_s"]
    print(f"iteration time {first} / {second} (baseline, same run): {ratio:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
