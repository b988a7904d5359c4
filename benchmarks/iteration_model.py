"""The iteration model against reality: calibrated on this CPU, its predictions beside the
measured iteration times of four runs of the vLLM main job.

    python -m benchmarks.iteration_model [--steps 12] [--calibration-steps 8]
                                         [--vllm-python PATH] [--workdir DIR]

One vLLM server (core 1) and the trainer (core 0), as `experiments.cpu_arithmetic --engine
vllm` runs them, from one warm start:

1. Calibrate: two short runs at staleness 0 (every phase in turn), of the main job's batch
   (32 prompts x 8 samples, 4 updates) and of a quarter of it in 2 updates;
   `bapo_jax.run.measured` fits the kernels
   (a decoding step, a running sequence's share of it, a trained token, an optimizer update,
   a teacher-forced token, a response's reward, the sync, the loop's own overhead) and the
   response lengths to their rows.
2. Predict (`bapo_jax.run.estimate` with those kernels) the iteration time of four runs that
   move the balance between generation and training:
       main job   k = 1 (the vLLM main job's setting: the next batch generates beside the update)
       k = 0      every phase in turn
       G = 16     twice the samples per prompt: 512 sequences a batch, two waves on a server
                  that runs 256 at once, twice the trained tokens
       E = 8      two epochs over the batch: twice the updates, the same generation
3. Run each for `steps` iterations; print the prediction beside the measured median of
   `time/iteration` (the first iteration compiles and is left out) and the error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import numpy as np

from bapo_jax.overrides import apply_overrides
from bapo_jax.rollout import serve
from bapo_jax.run import estimate as est
from bapo_jax.run import measured
from bapo_jax.tasks import arithmetic_job as job
from bapo_jax.tasks import job_report
from benchmarks import vllm_loop
from experiments import cpu_arithmetic as main_job

# name -> (staleness, overrides of the main job's vLLM run)
RUNS = {
    "main job (k = 1)": (1, []),
    "k = 0": (0, []),
    "G = 16": (1, ["trainer.rollout.samples_per_prompt=16"]),
    "E = 8 (2 epochs)": (1, ["trainer.algorithm.epochs=2"]),
}
# Two staleness-0 runs whose shapes differ in both fitted directions: batch size (the per-token
# against the per-step and per-update costs) and updates per batch (4 against 2).
CALIBRATION = {
    "calibrate_32": ["trainer.rollout.prompts_per_step=32"],
    "calibrate_8": ["trainer.rollout.prompts_per_step=8", "trainer.algorithm.mini_batches=2"],
}
TOLERANCE = 0.25


def run(prepared, base, url: str, steps: int, staleness: int, overrides, out_dir: str) -> str:
    config = vllm_loop.against(
        prepared, apply_overrides(base, overrides), url, steps, staleness=staleness
    )
    shutil.rmtree(out_dir, ignore_errors=True)
    job.run_rl(prepared, config, out_dir)
    return out_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12, help="iterations of each predicted run")
    ap.add_argument("--calibration-steps", type=int, default=8)
    ap.add_argument(
        "--vllm-python", default=None, help="default $BAPO_VLLM_PYTHON, else .venv-vllm"
    )
    ap.add_argument("--workdir", default=None, help="default: a temp dir (removed at the end)")
    args = ap.parse_args()
    for name in ("steps", "calibration_steps"):
        if getattr(args, name) < 3:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 3, got {getattr(args, name)}")
    python = serve.vllm_python(args.vllm_python)
    if (why := serve.missing_vllm_python(python)) is not None:
        raise SystemExit(f"error: {why}")
    base = main_job.VLLM_RUN
    root = args.workdir or tempfile.mkdtemp(prefix="bapo-iteration-model-")
    model = main_job.SHAPE.qwen2_config(main_job.TASK.vocab_size)  # only the kernels use it
    results = {}
    try:
        prepared = job.prepare(
            main_job.TASK,
            main_job.SHAPE,
            main_job.WARM_START,
            args.steps * base.trainer.rollout.prompts_per_step,
            os.path.join(root, "warm_start"),
            eval_max_tokens=base.trainer.rollout.max_response_tokens,
        )
        with vllm_loop.serving(base, prepared, root, python) as (base, url):
            dirs = [
                run(prepared, base, url, args.calibration_steps, 0, overrides,
                    os.path.join(root, name))
                for name, overrides in CALIBRATION.items()
            ]  # fmt: skip
            fitted = measured.fit([measured.load_run(d) for d in dirs])
            for name, (k, overrides) in RUNS.items():
                out = os.path.join(root, f"run_{len(results)}")
                config = vllm_loop.against(
                    prepared, apply_overrides(base, overrides), url, args.steps, staleness=k
                )
                predicted = est.estimate(
                    config, model, est.layout_of(config), fitted.rates, "cpu", fitted.kernels
                )
                run(prepared, base, url, args.steps, k, overrides, out)
                rows = job_report.read_rows(out)[1:]
                results[name] = {
                    "predicted_s": predicted.iteration_s,
                    "measured_s": float(np.median([r["time/iteration"] for r in rows])),
                    "phases": predicted.phases,
                    "generate_s": float(np.median([r["time/generate"] for r in rows])),
                    "update_s": float(np.median([r["time/update"] for r in rows])),
                }
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    k = fitted.kernels
    print(
        f"kernels fitted to {fitted.rows} rows of two staleness-0 runs (32 prompts in 4 updates, "
        "8 in 2): "
        f"decode step {k.decode_step_s * 1e3:.2f} ms + {k.decode_token_s * 1e6:.1f} us a "
        f"running sequence, train {k.train_token_s * 1e6:.1f} us a token + "
        f"{k.update_s * 1e3:.1f} ms an update, teacher {k.forward_token_s * 1e6:.1f} us a token, "
        f"reward {k.reward_s * 1e3:.2f} ms a response, sync write {k.sync_write_s:.3f} s + "
        f"load {k.sync_reload_s:.3f} s, loop overhead {k.overhead_s:.3f} s; responses "
        f"{fitted.rates.mean_response_tokens:.1f} tokens on average, longest "
        f"{fitted.rates.longest_response_tokens:.1f}"
    )
    print(f"| run | predicted s/iteration | measured (median of {args.steps - 1}) | error |")
    print("|---|---|---|---|")
    worst = 0.0
    for name, r in results.items():
        error = r["predicted_s"] / r["measured_s"] - 1
        worst = max(worst, abs(error))
        print(f"| {name} | {r['predicted_s']:.2f} | {r['measured_s']:.2f} | {100 * error:+.0f}% |")
    verdict = "within" if worst <= TOLERANCE else "NOT within"
    print(f"largest error {100 * worst:.0f}%: {verdict} {100 * TOLERANCE:.0f}%")
    print(json.dumps({"kernels": k.__dict__, "results": results}, default=float))


if __name__ == "__main__":
    main()
