"""Compile time of a jitted forward+backward vs depth: 4 vs 32 layers.

    python -m benchmarks.compile_time [--unrolled]

The decoder layers are stacked and run by one ``jax.lax.scan``, so the compiled program (and its
compile time) should not grow with the number of layers: the printed ratio should be ~1.
``--unrolled`` also times ``scan_unroll = layers`` (every layer inlined) for contrast.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from bapo_jax.models import ModelOptions, Qwen2Config, abstract_model

SMALL = Qwen2Config(
    vocab_size=2048,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=2048,
    rope_theta=1_000_000.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    max_window_layers=4,
)


def compile_seconds(layers: int, options: ModelOptions, batch: int = 2, seq: int = 128):
    """(trace+lower seconds, XLA compile seconds) of jit(value_and_grad(next-token loss))."""
    config = SMALL.replace(num_hidden_layers=layers, max_window_layers=layers)
    graphdef, params = nnx.split(abstract_model(config, options), nnx.Param)  # no allocation
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)

    def loss(p, ids):
        logits = nnx.merge(graphdef, p)(ids)[:, :-1]  # [B, T-1, V]
        tgt = jnp.take_along_axis(logits, ids[:, 1:, None], axis=-1)[..., 0]
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) - tgt)

    fn = jax.jit(jax.value_and_grad(loss))
    t0 = time.perf_counter()
    lowered = fn.lower(params, ids)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs=2, default=(4, 32))
    parser.add_argument("--repeats", type=int, default=2, help="best of N compiles")
    parser.add_argument("--unrolled", action="store_true", help="also time unrolled layers")
    args = parser.parse_args(argv)

    variants = [("scan", lambda n: ModelOptions())]
    if args.unrolled:
        variants.append(("unrolled", lambda n: ModelOptions(scan_unroll=n)))
    print(
        f"jit(value_and_grad(loss)) of a {SMALL.hidden_size}-wide Qwen2, batch 2 x 128, "
        f"jax {jax.__version__} ({jax.default_backend()}); best of {args.repeats}"
    )
    print(f"{'variant':10s} {'layers':>6s} {'lower s':>8s} {'compile s':>10s} {'total s':>8s}")
    compile_seconds(2, ModelOptions())  # first-use overheads (imports, backend) out of the timing
    for name, make in variants:
        totals = []
        for n in args.layers:
            runs = [compile_seconds(n, make(n)) for _ in range(args.repeats)]
            lower, comp = min(runs, key=sum)
            totals.append(lower + comp)
            print(f"{name:10s} {n:6d} {lower:8.2f} {comp:10.2f} {lower + comp:8.2f}")
        a, b = args.layers
        print(
            f"{name:10s} ratio total({b} layers) / total({a} layers) = {totals[1] / totals[0]:.2f}"
        )


if __name__ == "__main__":
    main()
