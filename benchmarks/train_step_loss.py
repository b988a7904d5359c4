"""BAPO vs fixed-clip PPO on the whole jitted train step, and the cost of the update-wide search.

Baselines, measured in the same run on the same model, batch and optimizer:
  1. `ppo_clip` step without gradient accumulation vs `bapo` (target: bapo/ppo <= 1.05 — the
     bound search is one pass over [B, T] scalars beside a transformer forward/backward);
  2. with gradient accumulation, `bapo` scope="update" (paper: a forward-only pass over all
     micro-batches tabulates the grid sums before the first backward) vs scope="micro_batch"
     (authors' code: no extra pass). The ratio is the price of the paper's scope.

    python -m benchmarks.train_step_loss [--batch 8] [--seq 512] [--repeats 7]
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.models import Qwen2Config
from bapo_jax.train import optim
from bapo_jax.train.batch import TrainBatch
from bapo_jax.train.state import init_train_state
from bapo_jax.train.step import StepConfig, make_train_step

MODEL = Qwen2Config(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=10000.0,
)


def make_batch(batch: int, seq: int, seed: int = 0) -> TrainBatch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, MODEL.vocab_size, size=(batch, seq)).astype(np.int32)
    loss_mask = np.zeros((batch, seq), np.float32)
    loss_mask[:, seq // 4 :] = 1.0
    adv = np.where(rng.random(batch) < 0.5, 1.0, -1.0).astype(np.float32)[:, None] * loss_mask
    # Behaviour log-probs far from the policy's: ratios spread widely, the search makes moves.
    behavior = (-9.0 + rng.normal(0.0, 1.0, size=(batch, seq))).astype(np.float32) * loss_mask
    return TrainBatch(
        input_ids=jnp.asarray(ids),
        attention_mask=jnp.ones((batch, seq), jnp.int32),
        loss_mask=jnp.asarray(loss_mask),
        advantages=jnp.asarray(adv),
        behavior_logp=jnp.asarray(behavior),
    )


def build(step_config: StepConfig):
    optimizer = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-5))
    graphdef, state = init_train_state(MODEL, optimizer, seed=0)
    return make_train_step(graphdef, optimizer, step_config), state


def time_interleaved(candidates: dict, batch: TrainBatch, repeats: int) -> dict[str, list]:
    """Alternates the candidates each round so machine load hits all of them alike."""
    runs = {}
    for name, config in candidates.items():
        step, state = build(config)
        state, metrics = step(state, batch)  # compile + warm up
        jax.block_until_ready(metrics)
        runs[name] = [step, state, [], metrics]
    for _ in range(repeats):
        for run in runs.values():
            step, state, times, _ = run
            start = time.perf_counter()
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - start)
            run[1], run[3] = state, metrics
    return {name: (run[2], run[3]) for name, run in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    batch = make_batch(args.batch, args.seq)
    m = args.micro_batches
    print(
        f"train step: {MODEL.num_params() / 1e6:.1f}M params, batch {args.batch} x {args.seq}, "
        f"fp32, jax {jax.__version__} {jax.default_backend()}, {args.repeats} timed steps each"
    )
    candidates = {
        "ppo_clip": StepConfig(loss="ppo_clip"),
        "bapo": StepConfig(loss="bapo", loss_config=BAPOConfig()),
        f"bapo scope=micro_batch x{m}": StepConfig(
            loss="bapo", loss_config=BAPOConfig(scope="micro_batch"), num_micro_batches=m
        ),
        f"bapo scope=update x{m}": StepConfig(
            loss="bapo", loss_config=BAPOConfig(scope="update"), num_micro_batches=m
        ),
    }
    results = time_interleaved(candidates, batch, args.repeats)
    median = {name: statistics.median(times) for name, (times, _) in results.items()}
    for name, (times, metrics) in results.items():
        moves = int(metrics["iterations"]) if "iterations" in metrics else "-"
        print(
            f"  {name:<28} median {1e3 * median[name]:8.1f} ms   min {1e3 * min(times):8.1f} ms"
            f"   search moves {moves}"
        )
    names = list(candidates)
    print("ratios (median):")
    ratio = median["bapo"] / median["ppo_clip"]
    print(f"  bapo / ppo_clip, no accumulation = {ratio:.3f}  (target <= 1.05)")
    ratio = median[names[3]] / median[names[2]]
    print(f"  scope update / micro_batch, x{m} micro-batches = {ratio:.3f}  (extra forward pass)")


if __name__ == "__main__":
    main()
