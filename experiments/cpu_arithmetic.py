"""The README's main job: BAPO RL on a synthetic arithmetic task, on this CPU, from nothing.

    python -m experiments.cpu_arithmetic --out-dir runs/cpu_arithmetic [--quick]

Generates the task, trains a SentencePiece tokenizer, warm-starts a tiny Qwen2 (2 layers,
width 128) by supervised training, then runs BAPO RL with the embedded engine and reports
greedy held-out accuracy (500 problems) before and after, beside an equal-compute supervised
continuation. Writes summary.json, metrics.jsonl, TensorBoard events and plots/ in the run
directory. `--quick` is a smoke test of every stage at toy size (CI), not a result.
"""

import argparse
import dataclasses
import os
import sys

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.run.cli import ensure_environment
from bapo_jax.tasks.arithmetic_job import ModelShape, TaskConfig, WarmStartConfig, run_job
from bapo_jax.train.config import (
    AlgorithmConfig,
    CheckpointConfig,
    LoggingConfig,
    RolloutConfig,
    TrainerConfig,
)
from bapo_jax.train.optim import OptimizerConfig

TASK = TaskConfig(max_operand=9, n_basic=1500, n_target_sft=256, n_eval=500, vocab_size=48)
SHAPE = ModelShape(layers=2, hidden=128, heads=4, kv_heads=2)
WARM_START = WarmStartConfig(steps=600, batch_size=64, length=32, learning_rate=1e-3)
TRAINER = TrainerConfig(
    steps=40,
    eval_every=10,
    rollout=RolloutConfig(
        prompts_per_step=32,
        samples_per_prompt=8,
        max_prompt_tokens=12,
        max_response_tokens=32,
        temperature=1.0,
    ),
    algorithm=AlgorithmConfig(loss="bapo", bapo=BAPOConfig(rho0=0.5), mini_batches=4),
    optimizer=OptimizerConfig(learning_rate=1e-4, warmup_steps=0, weight_decay=0.0),
    checkpoint=CheckpointConfig(every=20, keep=1),
    logging=LoggingConfig(plot_every=10),
)
QUICK = {
    "task": dataclasses.replace(TASK, n_basic=300, n_target_sft=32, n_eval=64),
    "warm_start": dataclasses.replace(WARM_START, steps=30),
    "trainer": dataclasses.replace(TRAINER, steps=2, eval_every=2),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default="runs/cpu_arithmetic")
    ap.add_argument("--quick", action="store_true", help="toy-size smoke test of every stage")
    args = ap.parse_args()
    ensure_environment(1, "experiments.cpu_arithmetic", sys.argv[1:])
    os.makedirs(args.out_dir, exist_ok=True)
    if args.quick:
        summary = run_job(
            QUICK["task"], SHAPE, QUICK["warm_start"], QUICK["trainer"], args.out_dir, control=False
        )
    else:
        summary = run_job(TASK, SHAPE, WARM_START, TRAINER, args.out_dir)
    print(
        f"held-out accuracy {100 * summary['accuracy_before']:.1f}% -> "
        f"{100 * summary['accuracy_after']:.1f}% ({summary['improvement_points']:+.1f} points) "
        f"in {summary['wall_time_s']:.0f}s; summary in {args.out_dir}/summary.json"
    )


if __name__ == "__main__":
    main()
