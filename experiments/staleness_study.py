"""Staleness study on the CPU arithmetic task: fixed clip, clip-higher and BAPO at E = 1, 4, 8.

    python -m experiments.staleness_study --out-dir runs/staleness_study [--steps 40]

E is the number of optimizer updates per rollout batch (the paper's staleness: each batch is
cut into E mini-batches, so later updates train on data further from the current policy).
Every run starts from the same warm start (the main job's recipe) with the same seeds; only
the loss and E differ. Writes docs-ready `staleness_study.png` and `staleness_study.md`
(figure + table) into the output directory; the committed copies live in docs/.
"""

import argparse
import dataclasses
import os
import sys
import time

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.algorithms.losses import ClipHigherConfig, PPOClipConfig
from bapo_jax.run.cli import ensure_environment
from bapo_jax.tasks import arithmetic_job as job
from bapo_jax.tasks import study
from bapo_jax.train.config import AlgorithmConfig, CheckpointConfig, LoggingConfig
from experiments.cpu_arithmetic import RUN, SHAPE, TASK, WARM_START

ALGORITHMS = {
    "clip [0.8, 1.2]": AlgorithmConfig(loss="ppo_clip", ppo_clip=PPOClipConfig(epsilon=0.2)),
    "clip-higher [0.8, 1.28]": AlgorithmConfig(
        loss="clip_higher", clip_higher=ClipHigherConfig(eps_low=0.2, eps_high=0.28)
    ),
    "BAPO": AlgorithmConfig(loss="bapo", bapo=BAPOConfig(rho0=0.5)),
}
UPDATES = (1, 4, 8)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="runs/staleness_study")
    ap.add_argument("--steps", type=int, default=RUN.trainer.steps)
    args = ap.parse_args()
    ensure_environment(1, "experiments.staleness_study", sys.argv[1:])
    os.makedirs(args.out_dir, exist_ok=True)
    start = time.perf_counter()
    trainer = dataclasses.replace(
        RUN.trainer,
        steps=args.steps,
        checkpoint=CheckpointConfig(every=0, keep=1),
        logging=LoggingConfig(plot_every=args.steps, progress=False),
    )
    base = dataclasses.replace(RUN, trainer=trainer)
    prepared = job.prepare(
        TASK,
        SHAPE,
        WARM_START,
        trainer.steps * trainer.rollout.prompts_per_step,
        os.path.join(args.out_dir, "warm_start"),
        eval_max_tokens=trainer.rollout.max_response_tokens,
    )
    task, before = prepared.task, prepared.accuracy
    results = study.run_grid(prepared, base, study.cells(ALGORITHMS, UPDATES), args.out_dir)
    figure = os.path.join(args.out_dir, "staleness_study.png")
    study.figure(results, figure, "CPU arithmetic: same warm start, same seeds, loss x E")
    command = "python -m experiments.staleness_study " + " ".join(sys.argv[1:])
    with open(os.path.join(args.out_dir, "staleness_study.md"), "w", encoding="utf-8") as f:
        f.write(
            f"Command: `{command.strip()}` ({time.perf_counter() - start:.0f} s on this CPU).\n\n"
            f"Warm-start held-out greedy accuracy: {before:.3f} ({len(task.held_out)} problems)."
            f" {trainer.steps} RL iterations of {trainer.rollout.prompts_per_step} prompts x "
            f"{trainer.rollout.samples_per_prompt} samples per run.\n\n"
            + study.table(results)
            + "\n"
        )
    print(f"wrote {figure} and staleness_study.md", flush=True)


if __name__ == "__main__":
    main()
