"""Embedded JAX sampler decode throughput vs transformers `generate`, same model, same CPU.

Baseline: transformers (PyTorch 2.13 CPU) `generate(do_sample=False)` with its KV cache, on the
checkpoint this project saves. Both decode greedily, batch 16, fixed-length prompts, exactly
`--new-tokens` tokens per row (no EOS), timed after a warm-up (JAX compile excluded), prefill
included on both sides. The two sides alternate call by call, so load from other processes
falls on both alike; CPU-seconds per call (all threads, user + sys) are printed as the
load-insensitive view of the same comparison.

Ceiling. The benchmark also times the engine's own weight matmuls alone: one decode step's dots
(q/k/v, o, gate/up, down for every layer, then the output head, each the decode layout's
`ops.linear` exactly as the step runs them, chained because each layer needs the previous one),
in a jitted loop of `--new-tokens - 1` steps, and a `max_tokens=1` call (prefill + first
token). Their sum is what a call would take if everything but the weight dots were free, so
`tokens / (prefill + (new_tokens - 1) * dots step)` bounds what any change to the rest of the
engine could reach on this machine, as a ratio to the same run's transformers rate.

`--dtype bfloat16` runs both sides in bf16 (the same bf16-rounded weights; JAX accumulates the
dots in fp32). Greedy rows then need not agree: the two round intermediate values differently.

    python -m benchmarks.embedded_decode [--model sweep] [--new-tokens 64] [--repeats 5]
                                         [--dtype float32] [--default-malloc]

`--model`: random-weight models, from the main job's (`experiments.cpu_arithmetic`, 0.5M
params) through 7M and 31M to the Qwen2.5-0.5B shape; `sweep` (the default) runs the first
three one after the other and ends with their ratios. The ratio falls with size: transformers
pays a fixed Python cost per step, both sides stream every weight once per step.

Allocator: like `benchmarks.model_step`, the benchmark restarts itself once with
`GLIBC_TUNABLES` keeping freed memory in the process (first-touch page faults of freshly
mmap'd buffers are very slow on this VM). Both sides run in that one process.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers

from bapo_jax.malloc import MALLOC_TUNABLES
from bapo_jax.models import Qwen2Config, decode, init_model, save_pretrained
from bapo_jax.models.config import ModelOptions
from bapo_jax.rollout.embedded import EmbeddedEngine
from bapo_jax.rollout.types import SamplingParams
from bapo_jax.run.cli import ensure_environment
from experiments import cpu_arithmetic

MODEL_31M = Qwen2Config(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
)
# Random-weight models of the sizes the embedded engine serves (--model).
MODELS = {
    "main-job": cpu_arithmetic.SHAPE.qwen2_config(cpu_arithmetic.TASK.vocab_size),  # 0.5M
    "7m": MODEL_31M.replace(
        hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4
    ),
    "31m": MODEL_31M,
    "qwen2.5-0.5b": Qwen2Config.preset("qwen2.5-0.5b"),
}
SWEEP = ("main-job", "7m", "31m")  # --model sweep (the default); the 0.5B shape takes minutes


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _time(fn, repeats: int) -> float:
    """Median wall seconds of `fn()` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _dots_only_steps(weights: decode.DecodeWeights, steps: int, batch: int):
    """A jitted loop of `steps` decode steps that run only the weight matmuls of a step. The
    weights are arguments of the program, as in the engine's."""
    c = weights.config
    attn_width, f = c.num_attention_heads * c.head_dim, c.intermediate_size
    dtype = weights.embed.dtype
    linear = weights.ops.linear

    def step(weights, x):  # x [B, D]
        # Every output column feeds the next dot (else XLA drops the unused ones).
        for p in weights.layers:
            qkv = linear(x, p["qkv"])  # [B, (N+2K)H]
            kv = jnp.sum(qkv[:, attn_width:], axis=-1, keepdims=True)  # [B, 1]
            x = linear(qkv[:, :attn_width] + kv, p["o_proj"], residual=x)  # [B, D]
            gate_up = linear(x, p["gate_up"])  # [B, 2F]
            act = jax.nn.silu(gate_up[:, :f]) * gate_up[:, f:]  # [B, F]
            x = linear(act, p["down_proj"], residual=x)  # [B, D]
        logits = linear(x, weights.unembed, jnp.float32)  # [B, V]
        x = x + jnp.max(logits, axis=-1, keepdims=True)  # [B, D] fp32, every logit used
        return (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)).astype(dtype)

    run = jax.jit(lambda w, x: jax.lax.fori_loop(0, steps, lambda _, x: step(w, x), x))
    x0 = jnp.ones((batch, c.hidden_size), dtype)
    return lambda: run(weights, x0).block_until_ready()


def _measure(name: str, args: argparse.Namespace) -> float:
    """Runs the comparison for `MODELS[name]`, prints it and returns the ratio."""
    config = MODELS[name]
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, config.vocab_size, size=(args.batch, args.prompt_len)).tolist()

    model = init_model(config, ModelOptions(compute_dtype=jnp.dtype(args.dtype)), seed=0)
    engine = EmbeddedEngine(model, eos_token_ids=[], length_bucket=args.prompt_len)
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0)
    dots_only = _dots_only_steps(engine.decode_weights, args.new_tokens - 1, args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            tmp, dtype=getattr(torch, args.dtype)
        ).eval()
    del model

    def run_jax():
        rollout = engine.generate(prompts, 1, sampling, seed=0, greedy=True)
        return [s.token_ids.tolist() for s in rollout.samples]

    ids = torch.tensor(prompts, dtype=torch.long)

    def run_torch():
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=args.new_tokens,
                min_new_tokens=args.new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        return out[:, args.prompt_len :].tolist()

    load_before = os.getloadavg()
    jax_tokens, torch_tokens = run_jax(), run_torch()  # warm-up (JAX compiles here)
    same = sum(a == b for a, b in zip(jax_tokens, torch_tokens, strict=True))
    times = {"jax": [], "torch": []}
    cpu = {"jax": [], "torch": []}
    for _ in range(args.repeats):  # alternate, so machine load hits both alike
        for side, fn in (("jax", run_jax), ("torch", run_torch)):
            start, start_cpu = time.perf_counter(), _cpu_seconds()
            fn()
            times[side].append(time.perf_counter() - start)
            cpu[side].append(_cpu_seconds() - start_cpu)
    first_token = SamplingParams(max_tokens=1, temperature=1.0)
    prefill_s = _time(lambda: engine.generate(prompts, 1, first_token, seed=0, greedy=True), 5)
    dots_s = _time(dots_only, 3)
    load_after = os.getloadavg()
    tokens = args.batch * args.new_tokens
    rate = {side: tokens / statistics.median(t) for side, t in times.items()}
    cpu_s = {side: statistics.median(c) for side, c in cpu.items()}
    malloc = "glibc defaults" if args.default_malloc else f"GLIBC_TUNABLES={MALLOC_TUNABLES}"
    print(
        f"greedy decode, --model {name} ({config.num_params() / 1e6:.1f}M params) "
        f"{args.dtype}, batch {args.batch}, "
        f"prompt {args.prompt_len}, {args.new_tokens} new tokens; median of {args.repeats}; "
        f"torch threads {torch.get_num_threads()}, {os.cpu_count()} CPUs; malloc: {malloc}"
    )
    before, after = (" ".join(f"{x:.2f}" for x in load) for load in (load_before, load_after))
    print(f"load average (1/5/15 min) before: {before}, after: {after}")
    print(
        f"  embedded JAX engine       {rate['jax']:9.1f} tokens/s   {cpu_s['jax']:.2f} CPU-s/call"
    )
    print(
        f"  transformers generate     {rate['torch']:9.1f} tokens/s   "
        f"{cpu_s['torch']:.2f} CPU-s/call   (baseline)"
    )
    print(f"  identical greedy rows: {same}/{args.batch}")
    ceiling = tokens / (prefill_s + dots_s)
    print(
        f"ceiling: prefill + first token {prefill_s * 1e3:.0f} ms + {args.new_tokens - 1} "
        f"dots-only steps {dots_s * 1e3:.0f} ms ({dots_s / (args.new_tokens - 1) * 1e3:.2f} ms "
        f"each) = {ceiling:.1f} tokens/s = {ceiling / rate['torch']:.2f}x transformers"
    )
    ratio = rate["jax"] / rate["torch"]
    print(
        f"ratio embedded / transformers = {ratio:.2f}  (target >= 3); "
        f"CPU-seconds ratio transformers / embedded = {cpu_s['torch'] / cpu_s['jax']:.2f}\n"
    )
    return ratio


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=(*sorted(MODELS), "sweep"), default="sweep")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--default-malloc", action="store_true", help="keep glibc's malloc defaults (see doc)"
    )
    args = parser.parse_args(argv)
    if args.new_tokens < 2:
        parser.error(
            f"--new-tokens must be >= 2 (the ceiling times new_tokens - 1 steps), "
            f"got {args.new_tokens}"
        )
    if not args.default_malloc:
        ensure_environment(1, "benchmarks.embedded_decode", sys.argv[1:] if argv is None else argv)
    names = SWEEP if args.model == "sweep" else (args.model,)
    ratios = {name: _measure(name, args) for name in names}
    if len(ratios) > 1:
        print("ratio embedded / transformers by model (target >= 3):")
        for name, ratio in ratios.items():
            params = MODELS[name].num_params() / 1e6
            print(f"  {name:14s} {params:7.1f}M params   {ratio:5.2f}")


if __name__ == "__main__":
    main()
