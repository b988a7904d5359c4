"""Embedded JAX sampler decode throughput vs transformers `generate`, same model, same CPU.

Baseline: transformers (PyTorch 2.13 CPU) `generate(do_sample=False)` with its KV cache, on the
checkpoint this project saves. Both decode greedily, batch 16, fixed-length prompts, exactly
`--new-tokens` tokens per row (no EOS), timed after a warm-up (JAX compile excluded), prefill
included on both sides. The two sides alternate call by call, so load from other processes
falls on both alike; CPU-seconds per call (all threads, user + sys) are printed as the
load-insensitive view of the same comparison.

    python -m benchmarks.embedded_decode [--new-tokens 64] [--repeats 5] [--default-malloc]

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

import numpy as np
import torch
import transformers

from bapo_jax.models import Qwen2Config, init_model, save_pretrained
from bapo_jax.rollout.embedded import EmbeddedEngine
from bapo_jax.rollout.types import SamplingParams
from bapo_jax.run.cli import MALLOC_TUNABLES, ensure_environment

MODEL = Qwen2Config(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=10000.0,
)


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--default-malloc", action="store_true", help="keep glibc's malloc defaults (see doc)"
    )
    args = parser.parse_args(argv)
    if not args.default_malloc:
        ensure_environment(1, "benchmarks.embedded_decode", sys.argv[1:] if argv is None else argv)
    rng = np.random.default_rng(0)
    prompts = rng.integers(3, MODEL.vocab_size, size=(args.batch, args.prompt_len)).tolist()

    model = init_model(MODEL, seed=0)
    engine = EmbeddedEngine(model, eos_token_ids=[], length_bucket=args.prompt_len)
    sampling = SamplingParams(max_tokens=args.new_tokens, temperature=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(model, tmp)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
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
        for name, fn in (("jax", run_jax), ("torch", run_torch)):
            start, start_cpu = time.perf_counter(), _cpu_seconds()
            fn()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(_cpu_seconds() - start_cpu)
    load_after = os.getloadavg()
    tokens = args.batch * args.new_tokens
    rate = {name: tokens / statistics.median(t) for name, t in times.items()}
    cpu_s = {name: statistics.median(c) for name, c in cpu.items()}
    malloc = "glibc defaults" if args.default_malloc else f"GLIBC_TUNABLES={MALLOC_TUNABLES}"
    print(
        f"greedy decode, {MODEL.num_params() / 1e6:.1f}M params fp32, batch {args.batch}, "
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
    print(
        f"ratio embedded / transformers = {rate['jax'] / rate['torch']:.2f}  (target >= 3); "
        f"CPU-seconds ratio transformers / embedded = {cpu_s['torch'] / cpu_s['jax']:.2f}"
    )


if __name__ == "__main__":
    main()
