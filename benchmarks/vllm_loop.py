"""The CPU main job's RL loop on a real vLLM server: what the sync costs, and what k = 1 hides.

    python -m benchmarks.vllm_loop [--steps 12] [--vllm-python PATH] [--workdir DIR]

One vLLM server (core 1, as `experiments.cpu_arithmetic --engine vllm` launches it) serves the
main job's model; the trainer runs on core 0. From the same warm start the loop runs `steps`
iterations twice, in this one process against this one server:

    k = 1   staleness 1 (the main job's vLLM setting): batch i + 1 is generated while the
            trainer updates on batch i;
    k = 0   the baseline: every batch is generated, then trained on.

Per setting it prints the mean seconds per iteration (the loop's wall time / steps, the first
iteration excluded: it compiles), the sync (write + worker load) as a share of that, the
share of the sync hidden behind generation (`time/sync_write_hidden` + `time/sync_load_hidden`
over write + load: the seconds of the write of version i + 1 and of the servers' staged read
of it that ran before the generation being drained ended, `rollout.orbax_sync`; with k = 0, or when
the update outlasts the generation, there is none to hide behind), the sync's visible wait
(`time/sync`: from the drain's end, the rest of the write and staged read, the pause, the
copy into vLLM, resume),
the generation seconds and the share of them hidden behind the update, and then the ratio of
iteration time k = 1 / k = 0 (< 1: the overlap pays).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import socket
import tempfile

import numpy as np

from bapo_jax.rollout import serve
from bapo_jax.run import build
from bapo_jax.tasks import arithmetic_job as job
from experiments import cpu_arithmetic as main_job


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(prepared: job.Prepared, url: str, staleness: int, steps: int, out_dir: str) -> dict:
    """One run of `steps` iterations with staleness k against the server at `url`."""
    base = main_job.VLLM_RUN
    trainer = dataclasses.replace(
        base.trainer,
        steps=steps,
        eval_every=0,
        eval_at_start=False,
        offpolicy=dataclasses.replace(base.trainer.offpolicy, staleness=staleness),
        logging=dataclasses.replace(base.trainer.logging, progress=False, plots=False),
    )
    config = dataclasses.replace(
        base,
        trainer=trainer,
        model=dataclasses.replace(base.model, hf_dir=prepared.hf_dir),
        engine=dataclasses.replace(
            base.engine, launch_servers=0, server_cpu_cores=(), vllm_urls=(url,)
        ),
    )
    shutil.rmtree(out_dir, ignore_errors=True)  # a kept --workdir: never resume an old run
    job.run_rl(prepared, config, out_dir)
    rows = job.read_rows(out_dir)[1:]  # the first iteration compiles the step
    # An iteration's wall time: waiting for its batch + updating + draining + syncing.
    keys = ("time/wait_rollout", "time/update", "time/drain_rollout", "time/sync")
    iteration = [sum(r[k] for k in keys) for r in rows]
    sync = [r["time/sync_write"] + r["time/sync_load"] for r in rows]
    sync_hidden = [r["time/sync_write_hidden"] + r["time/sync_load_hidden"] for r in rows]
    generated = sum(r.get("overlap/generation_s", 0.0) for r in rows)
    hidden = sum(r.get("overlap/hidden_s", 0.0) for r in rows)
    return {
        "iteration_s": float(np.mean(iteration)),
        "sync_s": float(np.mean(sync)),
        "sync_share": float(np.sum(sync) / np.sum(iteration)),
        "sync_hidden_share": float(np.sum(sync_hidden) / np.sum(sync)),
        "sync_wait_s": float(np.mean([r["time/sync"] for r in rows])),
        "generate_s": float(np.mean([r["time/generate"] for r in rows])),
        "update_s": float(np.mean([r["time/update"] for r in rows])),
        "hidden_share": hidden / generated if generated else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument(
        "--vllm-python", default=None, help="default $BAPO_VLLM_PYTHON, else .venv-vllm"
    )
    ap.add_argument("--workdir", default=None, help="default: a temp dir (removed at the end)")
    args = ap.parse_args()
    python = serve.vllm_python(args.vllm_python)
    if (why := serve.missing_vllm_python(python)) is not None:
        raise SystemExit(f"error: {why}")
    root = args.workdir or tempfile.mkdtemp(prefix="bapo-vllm-loop-bench-")
    try:
        trainer = main_job.VLLM_RUN.trainer
        prepared = job.prepare(
            main_job.TASK,
            main_job.SHAPE,
            main_job.WARM_START,
            args.steps * trainer.rollout.prompts_per_step,
            os.path.join(root, "warm_start"),
            eval_max_tokens=trainer.rollout.max_response_tokens,
        )
        run = main_job.VLLM_RUN
        spec = build.server_spec(
            dataclasses.replace(
                run,
                model=dataclasses.replace(run.model, hf_dir=prepared.hf_dir),
                engine=dataclasses.replace(
                    run.engine, server_port=_free_port(), vllm_python=python
                ),
            )
        )
        group = serve.ServerGroup(spec, 1, log_dir=os.path.join(root, "logs"))
        try:
            group.wait_healthy()
            results = {
                k: measure(prepared, group.urls[0], k, args.steps, os.path.join(root, f"k{k}"))
                for k in (1, 0)
            }
        finally:
            group.stop()
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    print(f"vLLM loop, {args.steps - 1} timed iterations each (trainer core 0, server core 1):")
    for k, r in results.items():
        print(
            f"  k={k}: {r['iteration_s']:.2f} s/iteration, sync {r['sync_s']:.3f} s "
            f"({100 * r['sync_share']:.1f}% of it; {100 * r['sync_hidden_share']:.0f}% of the "
            f"sync hidden by generation, {r['sync_wait_s']:.3f} s waited for), "
            f"generation {r['generate_s']:.2f} s "
            f"({100 * r['hidden_share']:.0f}% hidden by the update), update {r['update_s']:.2f} s"
        )
    ratio = results[1]["iteration_s"] / results[0]["iteration_s"]
    print(f"iteration time k=1 / k=0 (baseline, same run): {ratio:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
