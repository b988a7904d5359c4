"""The iteration model's kernels fitted to runs' own metrics, so the estimate can be redone from
what a run measured (`python -m bapo_jax.run.estimate EXPERIMENT --measured RUN_DIR ...`).

Each run directory holds `config.json` and `metrics.jsonl`; the first row of each run is left
out (it compiles). Per row, with the run's own config:

    generation  time/generate = steps x decode_step_s + tokens x decode_token_s, least squares
                over the rows of every run, non-negative (where the rows would make a term
                negative, the per-token term alone: `_nonnegative_fit`); sequences n = prompts
                drawn x G per server, tokens = rollout/generated_tokens, steps = `decode_steps`
                at the run's concurrency with the batch's mean and longest response
    update      time/update = epochs x tokens x train_token_s + updates x update_s, fitted so
                (tokens: the trainer's, responses x (P + mean)); a loss's update-wide statistic
                pass counts at the forward kernel when the teacher check measured it, else in
                the fit
    log-prob    time/teacher_logprobs = tokens x forward_token_s (runs with the teacher check)
    reward      time/reward x reward workers / responses
    sync        the means of time/sync_write (write) and time/sync_load (stage + reload)
    checkpoint  the mean of time/checkpoint over the rows right after a save
    overhead    the median of time/iteration minus every phase above, over the rows of runs at
                staleness 0 (every phase runs in turn there: the rest is the loop's own work,
                batch assembly, metrics); 0 without such a run
    lengths     the mean and longest response tokens over the rows (`Rates`)

Two runs that differ in batch size separate the fixed from the per-token costs
(`benchmarks.iteration_model`, docs/pod.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import numpy as np

from bapo_jax.overrides import config_from_dict
from bapo_jax.run import estimate as est
from bapo_jax.run.config import RunConfig
from bapo_jax.run.estimate_report import format_estimate
from bapo_jax.train.tracking import MetricSink

__all__ = ["Measured", "RedoneEstimate", "fit", "load_run"]


@dataclasses.dataclass(frozen=True)
class Measured:
    """Fitted `kernels` and the `rates` carrying the measured lengths; `rows`: rows used."""

    kernels: est.Kernels
    rates: est.Rates
    rows: int


def load_run(run_dir: str) -> tuple[Any, list[dict]]:
    """(RunConfig, metric rows) of a run directory; a missing file is refused naming it."""
    paths = [os.path.join(run_dir, name) for name in ("config.json", "metrics.jsonl")]
    for path in paths:
        if not os.path.isfile(path):
            raise ValueError(f"--measured {run_dir!r}: no {os.path.basename(path)} there")
    with open(paths[0], encoding="utf-8") as f:
        config = config_from_dict(RunConfig, json.load(f))
    with open(paths[1], encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return config, rows


def _nonnegative_fit(features: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Least squares of target on [fixed, proportional] features with coefficients >= 0: the
    joint fit if it is non-negative, else the proportional term alone (the fixed one 0): the
    rows cannot separate the two costs then, and a predicted run scales the work (docs/pod.md).
    """
    coef = np.linalg.lstsq(features, target, rcond=None)[0]
    if (coef >= 0).all():
        return coef
    col = features[:, 1]
    slope = max(0.0, float(col @ target / (col @ col))) if col @ col > 0 else 0.0
    return np.array([0.0, slope])


def _mean(values: list[float]) -> float:
    return float(np.mean(values)) if values else 0.0


def fit(runs: list[tuple[Any, list[dict]]], accelerator: str = "cpu") -> Measured:
    """The kernels and lengths that explain `runs` ((config, rows) pairs) best (module doc)."""
    gen_x, gen_y, upd_x, upd_y = [], [], [], []
    forward, reward, write, load, ckpt, means, longest = [], [], [], [], [], [], []
    staleness_zero = []
    for config, rows in runs:
        t, r = config.trainer, config.trainer.rollout
        layout = est.layout_of(config)
        work = est.work_of(config, None, layout, est.Rates(), accelerator)
        g, p = r.samples_per_prompt, r.max_prompt_tokens
        workers = config.rewards.worker_count
        for row in rows[1:]:
            responses = row["rollout/prompts_drawn"] * g
            generated = row["rollout/generated_tokens"]
            mean, long = generated / responses, row["response_length/max"]
            per_server = responses / layout.servers
            c = max(1, min(int(per_server), work.in_flight, work.max_num_seqs))
            gen_x.append([est.decode_steps(per_server, c, mean, long), per_server * mean])
            gen_y.append(row["time/generate"])
            tokens = responses * p + generated
            upd_x.append([row["updates"], t.algorithm.epochs * tokens])
            upd_y.append((row["time/update"], work.statistic_passes * t.algorithm.epochs * tokens))
            if t.logging.logprob_agreement and "time/teacher_logprobs" in row:
                forward.append(row["time/teacher_logprobs"] / tokens)
            reward.append(row["time/reward"] * workers / responses)
            write.append(row.get("time/sync_write", 0.0))
            load.append(row.get("time/sync_load", 0.0))
            if "time/checkpoint" in row:
                ckpt.append(row["time/checkpoint"])
            means.append(mean)
            longest.append(long)
            if t.offpolicy.staleness == 0 and "time/iteration" in row:
                staleness_zero.append(row)
    if not gen_y:
        raise ValueError("--measured: no rows after each run's first (it compiles)")
    decode_step, decode_token = _nonnegative_fit(np.array(gen_x), np.array(gen_y))
    forward_token = _mean(forward)
    # The update-wide statistic's forward passes, when measured, are the forward kernel's.
    target = np.array([seconds - passes * forward_token for seconds, passes in upd_y])
    update, train_token = _nonnegative_fit(np.array(upd_x), target)
    phase_keys = ("time/generate", "time/reward", "time/teacher_logprobs", "time/update",
                  "time/sync_write", "time/sync_load", "time/eval", "time/checkpoint")  # fmt: skip
    residuals = [
        row["time/iteration"] - sum(row.get(key, 0.0) for key in phase_keys)
        for row in staleness_zero
    ]
    kernels = est.Kernels(
        prefill_token_s=0.0,  # in the per-token decode cost: prompts keep one length here
        decode_step_s=float(decode_step),
        decode_token_s=float(decode_token),
        decode_compute_s=0.0,
        train_token_s=float(train_token),
        update_s=float(update),
        forward_token_s=forward_token,
        reward_s=_mean(reward),
        sync_write_s=_mean(write),
        sync_stage_s=0.0,  # time/sync_load holds the staged read and the reload
        sync_reload_s=_mean(load),
        checkpoint_s=_mean(ckpt),
        overhead_s=max(0.0, float(np.median(residuals))) if residuals else 0.0,
        source=f"fitted to {len(gen_y)} rows of {len(runs)} run(s)",
    )
    rates = est.Rates(
        mean_response_tokens=float(np.mean(means)),
        longest_response_tokens=float(np.mean(longest)),
    )
    return Measured(kernels=kernels, rates=rates, rows=len(gen_y))


class RedoneEstimate(MetricSink):
    """A metrics follower of a pod run: after its first `after` rows past the one that
    compiles, it fits the kernels to them (`fit`) and prints the run's iteration estimate redone
    from its own measured rates, with the command that redoes it from metrics.jsonl at any
    later point. A fit that cannot be made is said, never raised."""

    def __init__(self, config: Any, model, out_dir: str, *, start_step: int, after: int = 3):
        self.config, self.model, self.out_dir = config, model, out_dir
        self.after, self.rows, self.done = after, [], start_step > 0  # resumed: said before

    def log(self, step: int, values, images) -> None:
        if self.done:
            return
        self.rows.append(dict(values))
        if len(self.rows) < self.after + 1:
            return
        self.done = True
        head = (
            f"iteration estimate redone from the first {self.after} measured iterations (redo "
            f"later: python -m bapo_jax.run.estimate EXPERIMENT --measured {self.out_dir}):"
        )
        try:
            found = fit([(self.config, self.rows)], self.config.accelerator)
            layout = est.layout_of(self.config)
            redone = est.estimate(
                self.config, self.model, layout, found.rates, self.config.accelerator,
                found.kernels,
            )  # fmt: skip
            text = format_estimate(
                redone, found.rates, self.config.accelerator, self.model, found.kernels
            )
        except (ValueError, KeyError, ZeroDivisionError) as error:
            text = f"  not redone: {error!r}"
        print(f"{head}\n{text}", flush=True)
