"""Benchmark: the cost of BAPO's adaptive clipping at the loss level.

    python -m benchmarks.bapo_loss [--batch 256] [--length 8192] [--repeats 7]

Same inputs for every implementation: B x T tokens whose bound target is unreachable (a
quarter of the sequences have A > 0, so P / (P + N) stays below rho0 = 0.4), so every search
makes all 36 + 15 = 51 grid moves. Measured, all jitted, float32, this machine:

1. loss + grad: fixed-clip PPO (`ppo_clip`, the named baseline) vs BAPO (`bapo.policy_loss`,
   bucketed search inside the graph). Reported ratio; the search adds one pass over the tokens.
2. search only: BAPO's in-graph `lax.while_loop` search vs `host_driven_search`, written as
   the authors' verl code does it: a Python while loop that recomputes the statistic over all
   tokens at the current bounds (a jitted pass) and reads it back with `float()` -- one
   device-to-host sync per iteration. Target ratio >= 10x.
3. end to end: host-driven search + loss + grad vs BAPO loss + grad.

Times are the minimum over `--repeats` rounds after a warm-up (compilation) call; each round
runs every implementation once in turn, so they share the machine's load; medians are printed
too. Compare ratios from one run.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from bapo_jax.algorithms import bapo, bapo_search, losses


def make_inputs(batch: int, length: int, seed: int = 0):
    """Behaviour/current log-probs, per-sequence GRPO-like advantages, ragged masks: [B, T]."""
    rng = np.random.default_rng(seed)
    behavior_logp = rng.uniform(-4.0, -0.05, (batch, length)).astype(np.float32)
    logp = (behavior_logp + rng.normal(0.0, 0.3, (batch, length))).astype(np.float32)
    positive = rng.random((batch, 1)) < 0.25
    magnitude = rng.uniform(0.2, 1.5, (batch, 1))
    advantages = np.broadcast_to(np.where(positive, magnitude, -magnitude), (batch, length))
    lengths = rng.integers(length // 4, length + 1, (batch, 1))
    mask = (np.arange(length)[None, :] < lengths).astype(np.float32)
    arrays = (logp, behavior_logp, advantages.astype(np.float32), mask)
    return tuple(jnp.asarray(x) for x in arrays)


def statistic_at(ratio, advantages, mask, c_low, c_high, config: bapo.BAPOConfig):
    """One full pass: rho at (c_low, c_high), as the authors' `_compute_effective_advantage`."""
    return bapo_search.balance_statistic(ratio, advantages, mask, config, c_low, c_high)


def host_driven_search(ratio, advantages, mask, config: bapo.BAPOConfig, statistic_fn):
    """The authors' style: Python loop, one jitted pass and one `float()` sync per iteration.

    Same grid values (start + i * step) and move order as `bapo_search.search_bounds`, so the chosen
    bounds agree; returns (c_low, c_high, rho, iterations).
    """
    low = [float(v) for v in config.low_grid.astype(np.float32)]
    high = [float(v) for v in config.high_grid.astype(np.float32)]
    i = j = 0
    rho = float(statistic_fn(ratio, advantages, mask, low[0], high[0]))  # device -> host
    moves = 0
    while rho < config.rho0 and (i < len(low) - 1 or j < len(high) - 1):
        raise_high = j < len(high) - 1 if config.order == "upper_first" else i >= len(low) - 1
        if raise_high:
            j += 1
        else:
            i += 1
        moves += 1
        rho = float(statistic_fn(ratio, advantages, mask, low[i], high[j]))  # device -> host
    return low[i], high[j], rho, moves


def time_interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple]:
    """{name: (min, median) wall ms}. One warm-up call each, then `repeats` rounds that run
    every fn once in turn, so all see the same machine load. Each fn must block until done."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: (min(t), statistics.median(t)) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()

    config = bapo.BAPOConfig()  # the paper's defaults
    ppo_config = losses.PPOClipConfig()
    logp, behavior_logp, advantages, mask = make_inputs(args.batch, args.length)
    ratio = jnp.exp(jnp.where(mask > 0, logp - behavior_logp, 0.0))
    tokens = int(jnp.sum(mask))

    def value_and_grad(loss_fn, loss_config, **kwargs):
        def scalar_loss(lp):
            return loss_fn(lp, behavior_logp, advantages, mask, loss_config, **kwargs)[0]

        return jax.jit(jax.value_and_grad(scalar_loss))

    ppo_step = value_and_grad(losses.ppo_clip, ppo_config)
    bapo_step = value_and_grad(bapo.policy_loss, config)

    @jax.jit
    def given_bounds_step(lp, c_low, c_high):
        def scalar_loss(x):
            return bapo.policy_loss(
                x, behavior_logp, advantages, mask, config, bounds=(c_low, c_high)
            )[0]

        return jax.value_and_grad(scalar_loss)(lp)

    device_search = jax.jit(bapo_search.search_bounds, static_argnums=(3,))
    statistic_fn = jax.jit(statistic_at, static_argnums=(5,))

    def host_statistic(r, a, m, c_low, c_high):
        return statistic_fn(r, a, m, jnp.float32(c_low), jnp.float32(c_high), config)

    # Agreement and iteration counts first.
    result = jax.device_get(device_search(ratio, advantages, mask, config))
    host = host_driven_search(ratio, advantages, mask, config, host_statistic)
    assert (np.float32(host[0]), np.float32(host[1])) == (result.c_low, result.c_high), host
    assert host[3] == int(result.iterations)

    def run_host_search():
        return host_driven_search(ratio, advantages, mask, config, host_statistic)

    def run_host_end_to_end():
        c_low, c_high, _, _ = run_host_search()
        jax.block_until_ready(given_bounds_step(logp, jnp.float32(c_low), jnp.float32(c_high)))

    timings = time_interleaved(
        {
            "ppo_clip loss+grad (jit)": lambda: jax.block_until_ready(ppo_step(logp)),
            "bapo loss+grad (jit, in-graph search)": lambda: jax.block_until_ready(bapo_step(logp)),
            "bapo search only (jit, lax.while_loop)": lambda: jax.block_until_ready(
                device_search(ratio, advantages, mask, config)
            ),
            "host-driven search only (authors' style)": run_host_search,
            "host-driven search + loss+grad": run_host_end_to_end,
        },
        args.repeats,
    )

    print(f"bapo_loss benchmark: {args.batch} x {args.length} = {args.batch * args.length} ")
    print(f"  tokens ({tokens} in the mask), jax {jax.__version__}, {jax.devices()[0].platform}")
    print(
        f"  search: iterations in-graph={int(result.iterations)} host-driven={host[3]}, "
        f"reached={bool(result.reached)}, bounds=({float(result.c_low):.2f}, "
        f"{float(result.c_high):.2f}), rho_before={float(result.rho_before):.4f}, "
        f"rho={float(result.rho):.4f} (rho0={config.rho0})"
    )
    print(f"  host syncs in the host-driven search: {host[3] + 1}")
    width = max(len(name) for name in timings)
    for name, (best, median) in timings.items():
        print(f"  {name:<{width}}  min {best:8.2f} ms   median {median:8.2f} ms")

    def ratio_of(numerator, denominator):
        return timings[numerator][0] / timings[denominator][0]

    print("ratios (min times):")
    print(
        "  bapo loss+grad / ppo_clip loss+grad             = "
        f"{ratio_of('bapo loss+grad (jit, in-graph search)', 'ppo_clip loss+grad (jit)'):.2f}x"
    )
    search_speedup = ratio_of(
        "host-driven search only (authors' style)", "bapo search only (jit, lax.while_loop)"
    )
    print(
        f"  host-driven search / in-graph search           = {search_speedup:.1f}x "
        f"(target >= 10x: {'met' if search_speedup >= 10 else 'NOT met'})"
    )
    end_to_end = ratio_of("host-driven search + loss+grad", "bapo loss+grad (jit, in-graph search)")
    print(f"  host-driven search + loss+grad / bapo loss+grad = {end_to_end:.1f}x")


if __name__ == "__main__":
    main()
