"""Peak memory of token log-probs + entropy, forward and backward: tiled vs full logits.

    python -m benchmarks.logprob_memory [--seq 4096] [--dim 896] [--vocab 151936] [--measure]

Baseline: `full_token_logprobs`, the plain path that builds the whole [B, T, V] fp32 logits and
lets JAX differentiate it. Candidate: `token_logprobs` (chunks of tokens x blocks of vocab,
custom backward). Both compute (logp, entropy) and, for "fwd+bwd", the gradients of
sum(a * logp + b * entropy) w.r.t. hidden [B, T, D] and the unembedding [V, D] (Qwen2.5-0.5B
shape by default: D = 896, V = 151,936; B = 1, T = 4096; fp32).

Memory is XLA's compiled `memory_analysis()`: temp + arguments + outputs - aliased bytes, i.e.
the peak the executable needs. Arguments and outputs (W and dW: 519 MiB each) are the same for
both paths, so they bound the ratio from below.

`--measure` also runs each case once in a fresh subprocess: measured = argument bytes + the
peak resident-memory increase during the run (polled from /proc every 2 ms). On XLA:CPU the
full path really peaks well above its compiled temp (~9x the logits for fwd+bwd at T=1024), so
at T=4096 it would not fit this 24 GiB machine: a case whose estimated need exceeds the
available memory is skipped with a note (try `--seq 1024 --measure`).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from bapo_jax.models.logprobs import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_VOCAB_BLOCK_SIZE,
    full_token_logprobs,
    token_logprobs,
)

MIB = 2**20
TARGET_RATIO = 0.15


@dataclasses.dataclass(frozen=True)
class Shape:
    batch: int = 1
    seq: int = 4096
    dim: int = 896
    vocab: int = 151_936


def _case_fn(path: str, passes: str, chunk_size: int, vocab_block_size: int):
    """The jitted function of one case: forward only, or loss + gradients."""
    if path == "full":
        logprobs = full_token_logprobs
    else:

        def logprobs(h, w, t):
            return token_logprobs(h, w, t, chunk_size=chunk_size, vocab_block_size=vocab_block_size)

    def forward(h, w, t, a, b):
        del a, b
        return logprobs(h, w, t)

    def objective(h, w, t, a, b):
        logp, ent = logprobs(h, w, t)
        return jnp.sum(a * logp) + jnp.sum(b * ent)

    if passes == "fwd":
        return jax.jit(forward)
    return jax.jit(jax.value_and_grad(objective, argnums=(0, 1)))


def _arg_specs(shape: Shape):
    tokens = (shape.batch, shape.seq)
    return (
        jax.ShapeDtypeStruct((*tokens, shape.dim), jnp.float32),
        jax.ShapeDtypeStruct((shape.vocab, shape.dim), jnp.float32),
        jax.ShapeDtypeStruct(tokens, jnp.int32),
        jax.ShapeDtypeStruct(tokens, jnp.float32),
        jax.ShapeDtypeStruct(tokens, jnp.float32),
    )


def compiled_memory(
    path: str, passes: str, shape: Shape, chunk_size: int, vocab_block_size: int
) -> dict[str, int]:
    """Bytes from XLA's memory analysis of the compiled case."""
    fn = _case_fn(path, passes, chunk_size, vocab_block_size)
    analysis = fn.lower(*_arg_specs(shape)).compile().memory_analysis()
    temp = analysis.temp_size_in_bytes
    args = analysis.argument_size_in_bytes
    outputs = analysis.output_size_in_bytes
    alias = analysis.alias_size_in_bytes
    return {"temp": temp, "args": args, "outputs": outputs, "total": temp + args + outputs - alias}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def measure_in_this_process(
    path: str, passes: str, shape: Shape, chunk_size: int, vocab_block_size: int
) -> int:
    """Peak RSS increase (bytes) during the first run of the compiled case on real inputs.

    Inputs are made in numpy (their temporaries are returned to the OS) and the case is
    compiled before the baseline is read, so the number is the run's temporaries plus its
    outputs. Polled every 2 ms from /proc, so it is a lower bound on the true peak.
    """
    fn = _case_fn(path, passes, chunk_size, vocab_block_size)
    rng = np.random.default_rng(0)
    tokens = (shape.batch, shape.seq)
    args = jax.block_until_ready(
        (
            jnp.asarray(rng.standard_normal((*tokens, shape.dim), np.float32)),
            jnp.asarray(0.05 * rng.standard_normal((shape.vocab, shape.dim), np.float32)),
            jnp.asarray(rng.integers(0, shape.vocab, tokens, np.int32)),
            jnp.asarray(rng.uniform(size=tokens).astype(np.float32)),
            jnp.asarray(rng.uniform(size=tokens).astype(np.float32)),
        )
    )
    compiled = fn.lower(*args).compile()
    gc.collect()
    baseline = _rss_bytes()
    peak = baseline
    done = threading.Event()

    def poll():
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_bytes())
            time.sleep(0.002)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    jax.block_until_ready(compiled(*args))
    done.set()
    poller.join()
    return max(peak, _rss_bytes()) - baseline


def _measure_subprocess(path, passes, shape, chunk_size, vocab_block_size) -> int:
    spec = json.dumps([path, passes, dataclasses.asdict(shape), chunk_size, vocab_block_size])
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.logprob_memory", "--child", spec],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(result.stdout.strip().splitlines()[-1])


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def _measured_need_bytes(path: str, passes: str, shape: Shape) -> int:
    """Rough RSS a measured run needs: the full path on XLA:CPU peaked at ~7x (fwd) and ~9x
    (fwd+bwd) the [B, T, V] fp32 logits at T=1024, on top of inputs and outputs."""
    weights = 2 * shape.vocab * shape.dim * 4
    if path == "tiled":
        return weights
    logits = shape.batch * shape.seq * shape.vocab * 4
    return weights + (7 if passes == "fwd" else 10) * logits


def run_memory(
    shape: Shape = Shape(),
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    vocab_block_size: int = DEFAULT_VOCAB_BLOCK_SIZE,
    measure: bool = False,
) -> dict[str, dict[str, float]]:
    """Print and return the memory of each case and the tiled/full ratios."""
    print(
        f"log-prob + entropy memory: B={shape.batch} T={shape.seq} D={shape.dim} "
        f"V={shape.vocab}, fp32; tiled: chunk_size={chunk_size}, "
        f"vocab_block_size={vocab_block_size}; baseline: full [B, T, V] logits"
    )
    header = f"{'pass':8s} {'path':6s} {'temp':>9s} {'args':>9s} {'outputs':>9s} {'total':>9s}"
    if measure:
        header += f" {'measured':>9s}"
    print("compiled memory_analysis, MiB (total = temp + args + outputs - aliased)")
    if measure:
        print("measured = args + peak RSS increase during one run (fresh subprocess each)")
    print(header)
    results: dict[str, dict[str, float]] = {}
    for passes in ("fwd", "fwd+bwd"):
        for path in ("full", "tiled"):
            mem = compiled_memory(path, passes, shape, chunk_size, vocab_block_size)
            row = {key: value / MIB for key, value in mem.items()}
            line = (
                f"{passes:8s} {path:6s} {row['temp']:9.1f} {row['args']:9.1f} "
                f"{row['outputs']:9.1f} {row['total']:9.1f}"
            )
            if measure:
                need = _measured_need_bytes(path, passes, shape)
                available = _available_bytes()
                if need > 0.8 * available:
                    print(
                        f"  ({passes} {path}: not measured, needs ~{need / 2**30:.0f} GiB, "
                        f"{available / 2**30:.0f} GiB available)"
                    )
                    row["measured"] = float("nan")
                else:
                    increase = _measure_subprocess(
                        path, passes, shape, chunk_size, vocab_block_size
                    )
                    row["measured"] = row["args"] + increase / MIB
                line += f" {row['measured']:9.1f}"
            print(line, flush=True)
            results[f"{passes}/{path}"] = row
    for passes in ("fwd", "fwd+bwd"):
        full, tiled = results[f"{passes}/full"], results[f"{passes}/tiled"]
        ratios = {key: tiled[key] / full[key] for key in ("total", "temp")}
        if measure:
            ratios["measured"] = tiled["measured"] / full["measured"]
        results[f"{passes}/ratio"] = ratios
        text = ", ".join(f"{key} {value:.3f}" for key, value in ratios.items())
        print(f"ratio tiled/full, {passes}: {text}")
    ratio = results["fwd+bwd/ratio"]["total"]
    if shape == Shape():
        verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
        print(f"peak memory ratio (fwd+bwd, total) = {ratio:.3f}: {verdict} the target <= 0.15")
    else:
        print(f"peak memory ratio (fwd+bwd, total) = {ratio:.3f} (the target is set for T=4096)")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=Shape.batch)
    parser.add_argument("--seq", type=int, default=Shape.seq)
    parser.add_argument("--dim", type=int, default=Shape.dim)
    parser.add_argument("--vocab", type=int, default=Shape.vocab)
    parser.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK_SIZE)
    parser.add_argument("--vocab-block-size", type=int, default=DEFAULT_VOCAB_BLOCK_SIZE)
    parser.add_argument("--measure", action="store_true", help="also run and measure peak RSS")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one measured case
    args = parser.parse_args(argv)
    if args.child:
        path, passes, shape, chunk_size, vocab_block_size = json.loads(args.child)
        print(measure_in_this_process(path, passes, Shape(**shape), chunk_size, vocab_block_size))
        return
    run_memory(
        Shape(args.batch, args.seq, args.dim, args.vocab),
        chunk_size=args.chunk_size,
        vocab_block_size=args.vocab_block_size,
        measure=args.measure,
    )


if __name__ == "__main__":
    main()
