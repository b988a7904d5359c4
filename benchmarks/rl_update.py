"""The update phase of one RL iteration, packed vs padded rows, on long-tailed response lengths.

    python -m benchmarks.rl_update [--rows 16] [--prompt 32] [--cap 256] [--micro-batch-rows 1]
        [--repeats 3] [--attention plain|blockwise] [--mixes long-tailed,main-job] [--no-head]
    python -m benchmarks.rl_update --cap 8192 --attention blockwise --repeats 1 --no-head
    python -m benchmarks.rl_update --record-main-job-lengths runs/cpu_arithmetic_check

One iteration's update phase, as the trainer runs it (`train.update_inputs`, the step of
`train.step.trainer_step_config`): the log-prob pass of the old policy (ratio_base
"recomputed") over the rollout batch, then E = 2 optimizer updates (mini-batches of half the
rows, each in micro-batches of `--micro-batch-rows` rows: 1, as `aime_7b` has one row per
batch device). Model: the ~27M-parameter config of
`benchmarks.model_step` (its position limit raised to the row length), fp32 on this CPU, with
the `--attention` core ("blockwise" for long rows: plain attention keeps [T, T] probabilities
per head and layer, ~17 GB at 8k). Baseline: the same trainer settings with
`algorithm.packing` off (one padded sequence per row of prompt + cap tokens).

Length mixes (`--rows` responses of a rollout batch, prompts of `--prompt` tokens):
1. long-tailed: response length = min(16 + 24 X, cap), X ~ Lomax(1.2) (numpy's pareto), the
   longest set to the cap -- the shape of reasoning-RL rollouts (most short, a few at the cap);
2. main-job: the response lengths of the main job's first rollout batch (its warm-started
   policy, 32 prompts x 8 samples at temperature 1, cap 32 tokens; recorded with
   ``--record-main-job-lengths`` into benchmarks/data/), scaled to the cap (x cap / 32).

Printed per mix: real tokens/s of the update phase (real = non-padding tokens, counted once per
pass over them), padded and packed, their ratio, micro-batches run per update, padding share,
and compiled step programs. The LM head's saving from scoring only trained tokens is measured
on the long-tailed mix: the packed update phase with the head on every position vs on the
trained tokens (`--no-head` skips it). Every variant is first compiled for its shapes without
running (`CompileOnly`), then the variants run interleaved, `--repeats` times, medians reported.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
import typing

import jax
import jax.numpy as jnp
import numpy as np

from bapo_jax.models.config import AttentionImpl, ModelOptions
from bapo_jax.train import step as step_lib
from bapo_jax.train import update_inputs
from bapo_jax.train.assemble import RowArrays
from bapo_jax.train.config import AlgorithmConfig, RolloutConfig, TrainerConfig
from bapo_jax.train.optim import OptimizerConfig, make_optimizer
from bapo_jax.train.specialisations import Specialisations
from bapo_jax.train.state import init_train_state
from benchmarks.model_step import BENCH_CONFIG

LENGTHS_FILE = os.path.join(os.path.dirname(__file__), "data", "main_job_response_lengths.json")
MAIN_JOB_CAP = 32


def long_tailed_lengths(rows: int, cap: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    lengths = np.minimum(16 + rng.pareto(1.2, size=rows) * 24, cap).astype(int)
    lengths[np.argmax(lengths)] = cap
    return lengths


def main_job_lengths(rows: int, cap: int, seed: int = 0) -> np.ndarray:
    with open(LENGTHS_FILE, encoding="utf-8") as f:
        recorded = np.asarray(json.load(f)["lengths"])
    rng = np.random.default_rng(seed)
    drawn = rng.choice(recorded, size=rows, replace=rows > len(recorded))
    return np.maximum(1, np.round(drawn * cap / MAIN_JOB_CAP)).astype(int)


MIXES = {"long-tailed": long_tailed_lengths, "main-job": main_job_lengths}


def rollout_rows(lengths: np.ndarray, prompt: int, cap: int, seed: int = 0) -> RowArrays:
    """The trainer's row layout (`train.assemble`): left-padded prompts, responses after."""
    rng = np.random.default_rng(seed)
    n, width = len(lengths), prompt + cap
    col = np.arange(width)[None]
    response = (col >= prompt) & (col < prompt + lengths[:, None])  # [N, T]
    attention = (col < prompt) | response
    ids = np.where(attention, rng.integers(3, BENCH_CONFIG.vocab_size, (n, width)), 0)
    adv = np.where(rng.random(n) < 0.5, 1.0, -1.0)[:, None] * response
    logp = np.where(response, -rng.gamma(2.0, 1.5, size=(n, width)), 0.0)
    versions = np.where(response, 0, -1)
    return RowArrays(
        input_ids=ids.astype(np.int32),
        attention_mask=attention.astype(np.int32),
        loss_mask=response.astype(np.float32),
        advantages=adv.astype(np.float32),
        behavior_logp=logp.astype(np.float32),
        versions=versions,
        scheduled_versions=versions,
        trainer_logp=np.full((n, width), np.nan, np.float32),
        rewards=np.zeros(n, np.float32),
        response_lengths=lengths.astype(np.int32),
        overlong=lengths >= cap,
        replayed=np.zeros(n, bool),
        active=np.ones(n, bool),
    )


class CompileOnly:
    """Stands in for a jitted function: compiles it for the arguments' shapes (which fills the
    function's own cache, so its next call with those shapes runs without compiling) and
    returns zeros of its outputs' shapes. A warm-up through it costs compile time, not a run
    (a padded update phase at an 8k cap runs for tens of minutes on this CPU)."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        lowered = self.fn.lower(*args)
        lowered.compile()
        return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), lowered.out_info)


class UpdatePhase:
    """One trainer configuration's update phase: log-prob pass + E updates on given rows."""

    def __init__(self, config: TrainerConfig, options: ModelOptions, scored: bool = True):
        self.config = config
        self.step_config = step_lib.trainer_step_config(config)
        if not scored:
            self.step_config = dataclasses.replace(self.step_config, scored_length=None)
        optimizer = make_optimizer(config.optimizer)
        model = dataclasses.replace(
            BENCH_CONFIG,
            max_position_embeddings=max(BENCH_CONFIG.max_position_embeddings, config.row_length),
        )
        self.graphdef, self.state = init_train_state(model, optimizer, options=options, seed=0)
        self.step = Specialisations(
            step_lib.make_train_step(self.graphdef, optimizer, self.step_config)
        )
        self.logprob_fn = step_lib.make_logprob_fn(self.graphdef, self.step_config)
        self.packing = update_inputs.packing_config(config)

    def compile(self, rows: RowArrays) -> None:
        """Compile every program `run(rows)` calls, running none of them."""
        self.run(rows, compile_only=True)

    def run(self, rows: RowArrays, compile_only: bool = False) -> tuple[float, dict[str, float]]:
        """Seconds of one update phase on `rows`, and what it computed."""
        algo, n = self.config.algorithm, rows.num_rows
        logprob_fn, step = self.logprob_fn, self.step
        if compile_only:
            logprob_fn, step = CompileOnly(logprob_fn), CompileOnly(step)
        start = time.perf_counter()
        logps = update_inputs.recompute_logprobs(
            rows,
            {"old": self.state.params},
            logprob_fn,
            self.packing,
            chunk_rows=n // algo.mini_batches,
            place=jax.device_put,
        )
        fill = update_inputs.RowFill()
        per_update = n // algo.mini_batches
        metrics = None
        for m in range(algo.mini_batches):
            idx = np.arange(m * per_update, (m + 1) * per_update)
            batch = update_inputs.train_batch(
                rows.take(idx),
                logps.take(idx),
                self.packing,
                fill=fill,
                micro_batches=algo.micro_batches,
                scored_length=self.step_config.scored_length,
            )
            state, metrics = step(self.state, jax.device_put(batch))
            if not compile_only:
                self.state = state
        jax.block_until_ready(metrics)
        seconds = time.perf_counter() - start
        out = fill.metrics(self.config.row_length)
        out["compiled"] = self.step.count
        return seconds, out


def trainer_config(
    rows: int, prompt: int, cap: int, packing: bool, micro_batch_rows: int = 1
) -> TrainerConfig:
    micro = rows // 2 // micro_batch_rows
    return TrainerConfig(
        rollout=RolloutConfig(
            prompts_per_step=rows // 8,
            samples_per_prompt=8,
            max_prompt_tokens=prompt,
            max_response_tokens=cap,
        ),
        algorithm=AlgorithmConfig(
            loss="bapo",
            ratio_base="recomputed",
            mini_batches=2,
            micro_batches=micro,
            packing=packing,
        ),
        optimizer=OptimizerConfig(learning_rate=1e-5, warmup_steps=1, weight_decay=0.01),
    )


def measure(phases: dict[str, UpdatePhase], rows: RowArrays, repeats: int) -> dict[str, dict]:
    """Each phase compiled, then `repeats` interleaved timed runs; medians. Real tokens: every
    non-padding token counted once in the log-prob pass and once in its update."""
    for phase in phases.values():
        phase.compile(rows)
    times: dict[str, list[float]] = {name: [] for name in phases}
    info: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        for name, phase in phases.items():
            seconds, info[name] = phase.run(rows)
            times[name].append(seconds)
    real = 2.0 * float(rows.attention_mask.sum())
    out = {}
    for name, t in times.items():
        median = statistics.median(t)
        out[name] = {"seconds": median, "tokens_per_s": real / median, **info[name]}
    return out


def record_main_job_lengths(run_dir: str) -> None:
    """The response lengths of the main job's first rollout batch, from its warm start."""
    from bapo_jax.models.hf import load_pretrained
    from bapo_jax.models.spm_tokenizer import SentencePieceTokenizer
    from bapo_jax.rollout.embedded import EmbeddedEngine
    from bapo_jax.rollout.types import SamplingParams
    from bapo_jax.tasks import arithmetic_job as job
    from experiments import cpu_arithmetic as main_job

    r = main_job.TRAINER.rollout
    if r.max_response_tokens != MAIN_JOB_CAP:
        raise ValueError(f"the main job's response cap is {r.max_response_tokens}, not 32")
    warm = os.path.join(run_dir, "warm_start")
    with open(os.path.join(warm, "warm_start.json"), encoding="utf-8") as f:
        settings = json.load(f)["settings"]
    expected = job._fingerprint(main_job.TASK, main_job.SHAPE, main_job.WARM_START)
    if settings != expected:
        raise ValueError(f"{warm} is not the current main job's warm start: {settings}")
    task = job.build_task(main_job.TASK, main_job.SHAPE, rl_prompts=r.prompts_per_step)
    tok = SentencePieceTokenizer.load(os.path.join(warm, "tokenizer.model"))
    engine = EmbeddedEngine(
        load_pretrained(os.path.join(warm, "hf")),
        eos_token_ids=[tok.eos_id],
        pad_token_id=tok.pad_id,
        length_bucket=8,
    )
    prompts = [task.rl[i].prompt_ids for i in range(r.prompts_per_step)]
    sampling = SamplingParams(
        max_tokens=r.max_response_tokens, temperature=r.temperature, stop_token_ids=(tok.eos_id,)
    )
    rollout = engine.generate(prompts, r.samples_per_prompt, sampling, seed=r.seed)
    lengths = [len(s.token_ids) for s in rollout.samples]
    os.makedirs(os.path.dirname(LENGTHS_FILE), exist_ok=True)
    with open(LENGTHS_FILE, "w", encoding="utf-8") as f:
        json.dump(
            {
                "source": "python -m benchmarks.rl_update --record-main-job-lengths "
                f"{run_dir}: the main job's warm-started policy, its first {len(prompts)} "
                f"RL prompts x {r.samples_per_prompt} samples, temperature {r.temperature}, "
                f"cap {r.max_response_tokens} tokens",
                "lengths": lengths,
            },
            f,
        )
    print(
        f"{len(lengths)} lengths, mean {np.mean(lengths):.1f}, max {max(lengths)} -> {LENGTHS_FILE}"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16, help="responses per rollout batch (x16)")
    p.add_argument("--prompt", type=int, default=32, help="prompt tokens")
    p.add_argument("--cap", type=int, default=256, help="response cap (row = prompt + cap)")
    p.add_argument("--micro-batch-rows", type=int, default=1, help="rows per micro-batch")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attention", default="plain", choices=typing.get_args(AttentionImpl))
    p.add_argument(
        "--mixes", default=",".join(MIXES), help=f"comma-separated, of {', '.join(MIXES)}"
    )
    p.add_argument("--no-head", action="store_true", help="skip the head-on-every-position variant")
    p.add_argument("--record-main-job-lengths", metavar="RUN_DIR", default=None)
    args = p.parse_args(argv)
    if args.record_main_job_lengths:
        record_main_job_lengths(args.record_main_job_lengths)
        return
    if args.rows < 16 or args.rows % 16:
        p.error(f"--rows must be a multiple of 16, got {args.rows}")
    if args.micro_batch_rows < 1 or (args.rows // 2) % args.micro_batch_rows:
        p.error(f"--micro-batch-rows must divide rows / 2, got {args.micro_batch_rows}")
    mixes = args.mixes.split(",")
    if unknown := [m for m in mixes if m not in MIXES]:
        p.error(f"--mixes: unknown {unknown}; known: {list(MIXES)}")
    options = ModelOptions(attention=args.attention)
    print(
        f"model {BENCH_CONFIG.num_params() / 1e6:.1f}M params fp32, {jax.device_count()} CPU "
        f"device(s); {args.rows} responses, prompt {args.prompt} + cap {args.cap} tokens a row; "
        f"log-prob pass + 2 updates of {args.rows // 2} rows in micro-batches of "
        f"{args.micro_batch_rows} row(s); {args.attention} attention; medians of "
        f"{args.repeats}"
    )
    shape = (args.rows, args.prompt, args.cap)
    padded = trainer_config(*shape, packing=False, micro_batch_rows=args.micro_batch_rows)
    packed = trainer_config(*shape, packing=True, micro_batch_rows=args.micro_batch_rows)
    for name in mixes:
        lengths = MIXES[name](args.rows, args.cap)
        rows = rollout_rows(lengths, args.prompt, args.cap)
        phases = {"padded": UpdatePhase(padded, options), "packed": UpdatePhase(packed, options)}
        if name == "long-tailed" and not args.no_head:
            phases["packed, head everywhere"] = UpdatePhase(packed, options, scored=False)
        results = measure(phases, rows, args.repeats)
        print(
            f"\n{name}: response lengths mean {lengths.mean():.0f}, median "
            f"{np.median(lengths):.0f}, max {lengths.max()} of cap {args.cap}"
        )
        for variant, r in results.items():
            print(
                f"  {variant:24s} {r['seconds']:7.2f} s  {r['tokens_per_s']:8.0f} real tok/s  "
                f"micro-batches/update {r['packing/micro_batches']:.1f}  padding "
                f"{r['packing/padding_share']:.0%}  compiled steps {r['compiled']}"
            )
        ratio = results["packed"]["tokens_per_s"] / results["padded"]["tokens_per_s"]
        print(f"  packed / padded real tokens/s: {ratio:.2f}x")
        if "packed, head everywhere" in results:
            head = (
                results["packed"]["tokens_per_s"]
                / results["packed, head everywhere"]["tokens_per_s"]
            )
            print(f"  head on trained tokens only / on every position (packed): {head:.2f}x")


if __name__ == "__main__":
    main()
