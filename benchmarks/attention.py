"""Attention forward + backward: blockwise (custom VJP) vs plain, compiled memory and time.

    python -m benchmarks.attention [--lengths 1024,4096,16384] [--time-max 2048] [--steps 3]
        [--heads 28,4,128]

Shapes are one layer's attention for one sequence, by default Qwen2.5-7B's (``--heads N,K,H``:
N=28 query heads, K=4 KV heads, H=128; ``8,2,64`` is `benchmarks.rl_update`'s model), fp32 on
this CPU. For each length T the jitted ``grad`` of ``sum(attention(q, k, v) * w)``
is compiled for both implementations; printed are XLA's temporary buffer size of each (the
memory the attention needs beyond its inputs and outputs) and, up to ``--time-max``, the median
wall time of a step. Baseline: ``plain`` (dense [K, G, T, S] fp32 scores) in the same run;
ratios are blockwise / plain. Blocks: 512 x 512 (the ``ModelOptions`` default).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from bapo_jax.models import attention as A


def grad_fn(impl: str, block: int):
    def loss(q, k, v, w, seg):
        out = A.attend(q, k, v, seg, implementation=impl, block_q=block, block_kv=block)
        return jnp.sum(out * w)

    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))


def inputs(t: int, n: int, kv: int, h: int):
    """q, k, v, the output weights w ([1, t, heads, h] fp32) and one segment over all t."""
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(1, t, n, h)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, t, kv, h)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, t, kv, h)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(1, t, n, h)), jnp.float32)
    seg = jnp.ones((1, t), jnp.int32)
    return q, k, v, w, seg


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="1024,4096,16384")
    p.add_argument("--time-max", type=int, default=2048)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--block", type=int, default=512)
    p.add_argument("--heads", default="28,4,128", help="N,K,H: query heads, KV heads, head dim")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.lengths.split(",")]
    try:
        n, k, h = (int(x) for x in args.heads.split(","))
    except ValueError:
        p.error(f"--heads must be N,K,H (three ints), got {args.heads!r}")
    if n < 1 or k < 1 or h < 1 or n % k:
        p.error(f"--heads: N, K, H >= 1 and K dividing N, got {args.heads!r}")
    print(f"attention fwd+bwd, B=1 N={n} K={k} H={h} fp32, blocks {args.block}; baseline: plain")
    for t in lengths:
        args_t = inputs(t, n, k, h)
        shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args_t]
        temp, compiled = {}, {}
        for impl in ("plain", "blockwise"):
            c = grad_fn(impl, args.block).lower(*shapes).compile()
            temp[impl] = c.memory_analysis().temp_size_in_bytes
            compiled[impl] = c
        line = (
            f"T={t:6d}  temporaries plain {temp['plain'] / 1e6:9.1f} MB  blockwise "
            f"{temp['blockwise'] / 1e6:8.1f} MB  ratio {temp['blockwise'] / temp['plain']:.3f}"
        )
        if t <= args.time_max:
            times = {impl: [] for impl in compiled}
            for c in compiled.values():
                jax.block_until_ready(c(*args_t))  # warm-up
            for _ in range(args.steps):
                for impl, c in compiled.items():  # interleaved: load hits both alike
                    t0 = time.perf_counter()
                    jax.block_until_ready(c(*args_t))
                    times[impl].append(time.perf_counter() - t0)
            med = {impl: statistics.median(x) for impl, x in times.items()}
            line += (
                f"  | time plain {med['plain']:7.3f} s  blockwise {med['blockwise']:7.3f} s  "
                f"ratio {med['blockwise'] / med['plain']:.2f}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
