"""Train-step throughput: packed vs padded rows on long-tailed lengths; 1 vs 8 CPU devices.

    python -m benchmarks.packing [--sequences 8] [--max-len 256] [--steps 3]

Model: the ~27M-parameter benchmark config of `benchmarks.model_step` (fp32, CPU). One step is
the full jitted BAPO train step (`train.step.make_train_step`: chunked log-probs, BAPO loss with
its bound search, backward, AdamW).

1. Packed vs padded. ``--sequences`` sequences with a 32-token prompt and a long-tailed
   (Pareto) response length capped so the longest is ``--max-len`` tokens, the shape of RL
   rollouts. Baseline: the padded batch [sequences, max-len]. Packed: the same sequences in
   max-len rows (`train.packing`, first-fit-decreasing), one micro-batch. Printed: real (non
   padding) tokens per second of each and the ratio packed / padded, measured in this run.
2. Mesh scaling sanity check (not a speed claim: the 8 "devices" are simulated on the same CPU
   cores). Baseline: the padded step on 1 device; then the same step on the 8-device fsdp mesh.

Steps are timed interleaved (padded, packed, padded, ...) so load from other processes hits
both alike; the median step time is used.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.train import optim
from bapo_jax.train.batch import TrainBatch
from bapo_jax.train.packing import PackingConfig, pack_batch
from bapo_jax.train.state import init_train_state, state_shardings
from bapo_jax.train.step import StepConfig, make_train_step, shard_batch
from benchmarks.model_step import BENCH_CONFIG

PROMPT = 32
OPT = optim.OptimizerConfig(learning_rate=1e-5, warmup_steps=1, weight_decay=0.01)


def long_tailed_batch(num: int, max_len: int, seed: int = 0) -> TrainBatch:
    """Right-padded [num, max_len] batch; response lengths ~ Pareto(1.2), the longest = max_len."""
    rng = np.random.default_rng(seed)
    resp = 16 + rng.pareto(1.2, size=num) * 24
    resp = np.minimum(resp, max_len - PROMPT).astype(int)
    resp[np.argmax(resp)] = max_len - PROMPT  # the long tail always reaches the cap
    total = PROMPT + resp
    pos = np.arange(max_len)
    attention = pos[None] < total[:, None]
    loss_mask = attention & (pos[None] >= PROMPT)
    ids = np.where(attention, rng.integers(3, BENCH_CONFIG.vocab_size, (num, max_len)), 0)
    adv = np.where(rng.random(num) < 0.5, 1.0, -1.0)[:, None]
    logp = -rng.gamma(2.0, 1.5, size=(num, max_len))
    return TrainBatch(
        input_ids=ids.astype(np.int32),
        attention_mask=attention.astype(np.int32),
        loss_mask=loss_mask.astype(np.float32),
        advantages=(adv * loss_mask).astype(np.float32),
        behavior_logp=np.where(loss_mask, logp, 0.0).astype(np.float32),
    )


class Runner:
    """A train state and its jitted step on one batch; `run()` times one step."""

    def __init__(self, batch: TrainBatch, num_micro_batches: int, mesh=None):
        optimizer = optim.make_optimizer(OPT)
        graphdef, self.state = init_train_state(BENCH_CONFIG, optimizer, seed=0, mesh=mesh)
        config = StepConfig(
            loss="bapo", loss_config=BAPOConfig(), num_micro_batches=num_micro_batches
        )
        shardings = None if mesh is None else state_shardings(self.state, mesh)
        self.step = make_train_step(graphdef, optimizer, config, state_shardings=shardings)
        batch = jax.tree.map(jnp.asarray, batch)
        self.batch = batch if mesh is None else shard_batch(batch, mesh)
        self.real_tokens = int(np.sum(np.asarray(batch.attention_mask)))
        self.times: list[float] = []

    def run(self, record: bool = True) -> None:
        t0 = time.perf_counter()
        self.state, metrics = self.step(self.state, self.batch)
        jax.block_until_ready((self.state, metrics))
        if record:
            self.times.append(time.perf_counter() - t0)

    def tokens_per_second(self) -> float:
        return self.real_tokens / statistics.median(self.times)


def compare(runners: dict[str, Runner], steps: int) -> None:
    for r in runners.values():
        r.run(record=False)  # compile + warm-up
    for _ in range(steps):
        for r in runners.values():
            r.run()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sequences", type=int, default=8)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args(argv)
    if args.max_len <= PROMPT + 16:
        raise ValueError(f"--max-len must be > {PROMPT + 16}, got {args.max_len}")
    if args.sequences < 1 or args.sequences % 8:
        raise ValueError(f"--sequences must be a positive multiple of 8, got {args.sequences}")

    padded = long_tailed_batch(args.sequences, args.max_len)
    lengths = padded.attention_mask.sum(axis=1)
    packed, _ = pack_batch(
        padded, PackingConfig(row_length=args.max_len, rows_per_micro_batch=args.sequences)
    )
    rows = int(np.sum(packed.segment_ids.max(axis=1) > 0))
    packed = jax.tree.map(lambda x: x[: max(rows, 1)], packed)  # keep the non-empty rows only
    print(
        f"model ~{BENCH_CONFIG.num_params() / 1e6:.0f}M params, fp32, BAPO train step, "
        f"{jax.device_count()} CPU devices visible"
    )
    print(
        f"lengths (prompt {PROMPT} + Pareto response): min {lengths.min()}, median "
        f"{int(np.median(lengths))}, max {lengths.max()}; real tokens {int(lengths.sum())}"
    )
    print(
        f"padded: [{args.sequences}, {args.max_len}] = {padded.input_ids.size} slots "
        f"({lengths.sum() / padded.input_ids.size:.0%} real); packed: [{rows}, {args.max_len}] "
        f"= {rows * args.max_len} slots ({lengths.sum() / (rows * args.max_len):.0%} real)"
    )
    runners = {"padded": Runner(padded, 1), "packed": Runner(packed, 1)}
    compare(runners, args.steps)
    base = runners["padded"].tokens_per_second()
    for name, r in runners.items():
        print(
            f"  {name:7s} median step {statistics.median(r.times):7.3f} s  "
            f"{r.tokens_per_second():9.1f} real tokens/s  "
            f"ratio vs padded {r.tokens_per_second() / base:5.2f}x"
        )

    print("mesh scaling sanity check (8 simulated devices share the same CPU cores):")
    cfg = mesh_lib.mesh_preset("cpu-fsdp8")
    mesh = mesh_lib.make_mesh(cfg, jax.devices()[: cfg.num_devices])
    runners = {"1 device": Runner(padded, 1), "fsdp 8": Runner(padded, 1, mesh=mesh)}
    compare(runners, args.steps)
    base = runners["1 device"].tokens_per_second()
    for name, r in runners.items():
        print(
            f"  {name:8s} median step {statistics.median(r.times):7.3f} s  "
            f"{r.tokens_per_second():9.1f} real tokens/s  "
            f"ratio vs 1 device {r.tokens_per_second() / base:5.2f}x"
        )


if __name__ == "__main__":
    main()
