"""Train-step throughput: this JAX port vs transformers/PyTorch on the same Qwen2 shapes.

    python -m benchmarks.model_step [--batch 4] [--seq 256] [--steps 6] [--scan-unroll 1]

One step = forward + backward + AdamW on next-token cross-entropy, same config, batch and
optimizer hyper-parameters on both sides, fp32 on this CPU. Prints tokens/s of each, their ratio
(JAX / PyTorch), CPU-seconds per step, and the forward / backward / optimizer split of each. The
two sides are timed interleaved, step by step, so load from other processes hits both alike; each
timed step follows an untimed one of the same side, as in a training loop (`back_to_back`); the
CPU-seconds ratio is the load-insensitive view of the same comparison. The JAX side runs the
model's default options (layers scanned, ``scan_unroll=1``); ``--scan-unroll 8`` inlines every
layer (same results bit for bit, slower to compile). Then, when the module
exists, the chunked-vs-full log-prob memory benchmark (``benchmarks.logprob_memory.run_memory``).

torch and transformers come with the ``test`` extra (the numerical reference); without them only
the JAX side runs.

Allocator: both frameworks free and re-allocate hundreds of MB of activations every step. With
glibc's defaults those come back as fresh mmap'd pages, and first-touch page faults are very slow
on this VM (~1 GB/s; ~175k faults and ~0.4 s of system time per JAX step). The benchmark therefore
re-executes itself once with ``GLIBC_TUNABLES`` keeping freed memory in the process (no mmap for
large blocks, no trimming, one arena). Both sides run in that same process, so the comparison
stays like for like; ``--default-malloc`` measures with glibc's defaults instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bapo_jax.malloc import MALLOC_TUNABLES
from bapo_jax.models import ModelOptions, Qwen2Config, init_model
from bapo_jax.run.cli import ensure_environment

# ~27M parameters, Qwen2.5-0.5B's proportions (GQA 4:1, head_dim 64, tied embeddings).
BENCH_CONFIG = Qwen2Config(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    max_window_layers=8,
)
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.999), 1e-8, 0.01


@dataclasses.dataclass
class Side:
    """One framework's train step, and the same step split into its phases."""

    name: str
    step: Callable[[], None]  # one full train step, blocking
    phases: Callable[[], tuple[float, float, float]]  # (forward, backward, optimizer) seconds


@dataclasses.dataclass
class Timing:
    name: str
    step: float  # wall seconds per full train step (median)
    cpu: float  # process CPU seconds (all threads, user + sys) per step (median)
    forward: float
    backward: float
    optimizer: float


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def back_to_back(run: Callable[[], object]) -> tuple[float, float]:
    """(wall, process CPU) seconds of ``run()`` right after an untimed ``run()``, as steps follow
    each other in a training loop. The sides share this process: a call timed right after the
    other side's would pay for that side's tail, and PyTorch's OpenMP workers spin after a
    parallel region (~10 ms of CPU after each torch step, measured here), competing with the
    next JAX call for the cores and counted in its CPU-seconds (a 15 ms attention block ran
    ~25 % slower right after torch's; docs/model.md)."""
    run()
    c0, t0 = _cpu_seconds(), time.perf_counter()
    run()
    return time.perf_counter() - t0, _cpu_seconds() - c0


def measure(sides: list[Side], steps: int, warmup: int) -> list[Timing]:
    """Time the sides *interleaved* (`back_to_back` steps of each in turn), so that load from
    other processes on the machine falls on both alike; medians over ``steps``."""
    for _ in range(warmup):
        for side in sides:
            side.step()
    wall: dict[str, list[float]] = {s.name: [] for s in sides}
    cpu: dict[str, list[float]] = {s.name: [] for s in sides}
    split: dict[str, list[tuple[float, float, float]]] = {s.name: [] for s in sides}
    for _ in range(steps):
        for side in sides:
            w, c = back_to_back(side.step)
            wall[side.name].append(w)
            cpu[side.name].append(c)
    for _ in range(steps):
        for side in sides:
            side.step()  # the split, too, right after a step of the same side
            split[side.name].append(side.phases())
    out = []
    for side in sides:
        f, b, o = (statistics.median(x) for x in zip(*split[side.name], strict=True))
        out.append(
            Timing(
                side.name,
                statistics.median(wall[side.name]),
                statistics.median(cpu[side.name]),
                f,
                b,
                o,
            )
        )
    return out


# ---- JAX ---------------------------------------------------------------------------------------
def _next_token_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Mean cross-entropy of token t+1 at positions 0..T-2, as transformers computes it: the
    labels are shifted and the last position is left out, not the logits sliced (a sliced
    [B, T-1, V] copy of the logits in the forward, and its padded cotangent in the backward,
    cost ~1 % of the step)."""
    b, t, _ = logits.shape
    targets = jnp.concatenate([ids[:, 1:], ids[:, :1]], axis=1)  # [B, T]; the last is unused
    lse = jax.nn.logsumexp(logits, axis=-1)  # [B, T]
    tgt = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]  # [B, T]
    scored = jnp.arange(t) < t - 1  # [T]
    return jnp.sum(jnp.where(scored, lse - tgt, 0.0)) / (b * (t - 1))


def jax_side(config: Qwen2Config, ids_np: np.ndarray, scan_unroll: int = 1) -> Side:
    model = init_model(config, ModelOptions(scan_unroll=scan_unroll), seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    tx = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)
    ids = jnp.asarray(ids_np)

    def loss_fn(p, ids):
        return _next_token_loss(nnx.merge(graphdef, p)(ids), ids)

    @functools.partial(jax.jit, donate_argnums=(0, 1))  # params and optimizer state in place
    def train_step(p, s, ids):
        loss, grads = jax.value_and_grad(loss_fn)(p, ids)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    # The phases, each jitted on its own (for the split only; the step above is one program).
    forward = jax.jit(loss_fn)
    forward_backward = jax.jit(jax.value_and_grad(loss_fn))

    @jax.jit
    def optimizer(p, s, g):
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s

    state = {"p": params, "s": tx.init(params)}

    def step() -> None:
        state["p"], state["s"], loss = train_step(state["p"], state["s"], ids)
        loss.block_until_ready()

    def phases() -> tuple[float, float, float]:
        p, s = state["p"], state["s"]
        t0 = time.perf_counter()
        jax.block_until_ready(forward(p, ids))
        t1 = time.perf_counter()
        _, g = jax.block_until_ready(forward_backward(p, ids))
        t2 = time.perf_counter()
        jax.block_until_ready(optimizer(p, s, g))
        t3 = time.perf_counter()
        return t1 - t0, (t2 - t1) - (t1 - t0), t3 - t2

    return Side("jax (this port)", step, phases)


# ---- PyTorch -----------------------------------------------------------------------------------
def hf_model(config: Qwen2Config):
    """transformers' Qwen2ForCausalLM of ``config`` (fresh torch init), in train mode."""
    import transformers

    hf_config = transformers.Qwen2Config(
        **{k: v for k, v in config.to_hf_dict().items() if k not in ("architectures", "model_type")}
    )
    return transformers.Qwen2ForCausalLM(hf_config).train()


def torch_side(config: Qwen2Config, ids_np: np.ndarray) -> Side:
    import torch

    torch.manual_seed(0)
    model = hf_model(config)
    opt = torch.optim.AdamW(
        model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
    )
    ids = torch.from_numpy(ids_np.astype(np.int64))

    def loss_of():
        return model(input_ids=ids, labels=ids).loss  # shifted next-token CE, mean

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        loss_of().backward()
        opt.step()

    def phases() -> tuple[float, float, float]:
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = loss_of()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        return t1 - t0, t2 - t1, t3 - t2

    return Side(f"pytorch {torch.__version__} (transformers, sdpa)", step, phases)


# ---- report ------------------------------------------------------------------------------------
def _print_table(rows: list[Timing], tokens: int) -> None:
    print(
        f"{'implementation':44s} {'tokens/s':>9s} {'step ms':>8s} {'cpu s':>6s} {'fwd ms':>7s} "
        f"{'bwd ms':>7s} {'opt ms':>7s} {'bwd/fwd':>7s}"
    )
    for r in rows:
        print(
            f"{r.name:44s} {tokens / r.step:9.0f} {1e3 * r.step:8.0f} {r.cpu:6.2f} "
            f"{1e3 * r.forward:7.0f} {1e3 * r.backward:7.0f} {1e3 * r.optimizer:7.0f} "
            f"{r.backward / r.forward:7.2f}"
        )


def run_logprob_memory() -> None:
    try:
        module = importlib.import_module("benchmarks.logprob_memory")
    except ModuleNotFoundError:
        print("\n[log-prob memory] benchmarks/logprob_memory.py is not present: skipped.")
        return
    run = getattr(module, "run_memory", None)
    if run is None:
        print("\n[log-prob memory] benchmarks.logprob_memory has no run_memory(): skipped.")
        return
    print("\n[log-prob memory]")
    run()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=6, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument(
        "--scan-unroll",
        type=int,
        default=1,
        help="layers per iteration of the JAX side's scan over layers (ModelOptions.scan_unroll)",
    )
    parser.add_argument("--no-torch", action="store_true", help="time the JAX port only")
    parser.add_argument("--no-memory", action="store_true", help="skip the log-prob memory part")
    parser.add_argument(
        "--default-malloc", action="store_true", help="keep glibc's malloc defaults (see doc)"
    )
    args = parser.parse_args(argv)
    if not args.default_malloc:
        ensure_environment(1, "benchmarks.model_step", sys.argv[1:] if argv is None else argv)

    config = BENCH_CONFIG
    ids = np.random.default_rng(0).integers(
        0, config.vocab_size, (args.batch, args.seq), dtype=np.int32
    )
    tokens = args.batch * args.seq
    print(
        f"config: {config.num_params() / 1e6:.1f}M params, {config.num_hidden_layers} layers, "
        f"hidden {config.hidden_size}, heads {config.num_attention_heads}/"
        f"{config.num_key_value_heads}, mlp {config.intermediate_size}, vocab {config.vocab_size}"
    )
    print(
        f"batch {args.batch} x {args.seq} = {tokens} tokens/step, fp32, AdamW, JAX scan_unroll "
        f"{args.scan_unroll}; "
        f"{os.cpu_count()} CPUs, jax {jax.__version__} ({jax.default_backend()}); malloc: "
        + ("glibc defaults" if args.default_malloc else f"GLIBC_TUNABLES={MALLOC_TUNABLES}")
    )
    try:
        load = os.getloadavg()[0]
        print(f"load average before the run: {load:.2f} (other processes share these CPUs)")
    except OSError:
        pass
    sides = [jax_side(config, ids, args.scan_unroll)]
    if not args.no_torch:
        try:
            sides.append(torch_side(config, ids))
        except ModuleNotFoundError as e:
            print(f"(PyTorch side skipped: {e}; install the test extra)")
    rows = measure(sides, args.steps, args.warmup)
    print()
    _print_table(rows, tokens)
    if len(rows) == 2:
        print(
            f"\nratio jax/pytorch tokens/s: {rows[1].step / rows[0].step:.2f} "
            f"(CPU-seconds per step: {rows[1].cpu / rows[0].cpu:.2f})"
        )
    if not args.no_memory:
        run_logprob_memory()


if __name__ == "__main__":
    main()
