"""Where `benchmarks.model_step`'s ratio comes from: each block of the train step, JAX vs PyTorch.

    python -m benchmarks.model_blocks [--steps 12] [--scan-unroll 1]

Same model (`model_step.BENCH_CONFIG`, 26.8M parameters), batch (4 x 256 tokens) and fp32 as
`benchmarks.model_step`. Both sides hold the same weights (the JAX model's, exported in HF
layout) and each block runs forward + backward (parameter gradients included) on the same
inputs and cotangents:

  attention core  causal GQA softmax attention on q [B, T, N, H], k, v [B, T, K, H]
                  (JAX `layers.attention` with the model's causal blocks; torch SDPA, GQA)
  MLP             SwiGLU on [B*T, D] (JAX `layers.swiglu`; three torch linears and silu)
  decoder layer   one layer: pre-norms, q/k/v, RoPE, attention, o, MLP, residuals
                  (JAX `layers.decoder_layer`; transformers' Qwen2DecoderLayer)
  layer stack     embedding and all layers, before the final norm (JAX `forward.forward`, the
                  layers scanned as the model runs them; transformers' layers in a loop)
  head + loss     final norm, tied [V, D] head, next-token cross-entropy
  AdamW           one update of every parameter (optax.adamw; torch.optim.AdamW)
  train step      `model_step`'s whole step (forward, backward, AdamW in one program)

Timed interleaved (a call of each side in turn, each timed right after an untimed call of the
same side: `model_step.back_to_back`), medians of wall and process CPU seconds;
ratios are PyTorch / JAX (> 1: JAX faster). The last line compares the step with the sum of the
blocks it is made of (layer stack + head + AdamW): what composing them costs each framework.
The allocator re-exec is `model_step`'s (both sides share this process).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from bapo_jax.models import ModelOptions, Qwen2Config, init_model, iter_hf_tensors
from bapo_jax.models import attention as A
from bapo_jax.models import forward as F
from bapo_jax.models import layers as L
from bapo_jax.run.cli import ensure_environment
from benchmarks import model_step as M


@dataclasses.dataclass
class Block:
    """One block on both sides; each callable runs forward + backward once and returns the
    block's output and its input's gradient first (JAX arrays / torch tensors), then, on the
    JAX side, the parameter gradients (returned, so that XLA computes them; torch computes
    them into ``.grad``)."""

    name: str
    jax: Callable[[], Sequence]
    torch: Callable[[], Sequence]


def _torch_model(model, config: Qwen2Config):
    import torch

    tmodel = M.hf_model(config)  # the same torch model model_step times (SDPA attention)
    state = {name: torch.tensor(w) for name, w in iter_hf_tensors(model)}
    missing, _ = tmodel.load_state_dict(state, strict=False)
    if [m for m in missing if m != "lm_head.weight"]:  # tied: lm_head is the embedding
        raise RuntimeError(f"model_blocks: weights not exported to the torch side: {missing}")
    return tmodel


def blocks(config: Qwen2Config, batch: int, seq: int, scan_unroll: int = 1) -> list[Block]:
    """The block pairs, built on one JAX model and a torch model holding the same weights."""
    import torch

    c = config
    b, t, d = batch, seq, c.hidden_size
    n, kv, h = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    model = init_model(c, ModelOptions(scan_unroll=scan_unroll), seed=0)
    tmodel = _torch_model(model, c)
    rng = np.random.default_rng(0)
    normal = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
    ids_np = rng.integers(0, c.vocab_size, (b, t), dtype=np.int32)
    ids, tids = jnp.asarray(ids_np), torch.from_numpy(ids_np.astype(np.int64))
    seg = jnp.ones((b, t), jnp.int32)
    pos = L.positions(seg)
    cos, sin = L.rope_cos_sin(pos, h, c.rope_theta)
    tpos = torch.arange(t)[None].expand(b, t)
    stacked = model.layers.stacked(jnp.float32)
    embed, final_norm = model.embed_tokens.get_value(), model.norm.get_value()
    layer0 = {k: v[0] for k, v in stacked.items()}
    tlayer0 = tmodel.model.layers[0]

    def leaf(x: np.ndarray):
        return torch.from_numpy(x.copy()).requires_grad_()

    def torch_grads(out, cotangent, *inputs, params=()):
        for p in params:
            p.grad = None
        for x in inputs:
            x.grad = None
        out.backward(cotangent)
        return [out.detach(), *(x.grad for x in inputs)]

    def jax_vjp(fn, cotangent, *args):
        out, vjp = jax.vjp(fn, *args)
        return [out, *vjp(cotangent)]

    # attention core
    q, k, v, dq = normal(b, t, n, h), normal(b, t, kv, h), normal(b, t, kv, h), normal(b, t, n, h)
    core = A.self_attention(seg)
    attn = jax.jit(lambda q, k, v, g: jax_vjp(core, g, q, k, v))
    tq, tk, tv, tdq = leaf(q), leaf(k), leaf(v), torch.from_numpy(dq)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def torch_attention():
        out = sdpa(*(x.transpose(1, 2) for x in (tq, tk, tv)), is_causal=True, enable_gqa=True)
        return torch_grads(out.transpose(1, 2), tdq, tq, tk, tv)[:2]

    # MLP on token rows
    hx, dhx = normal(b * t, d), normal(b * t, d)
    wg, wu, wd = (layer0[name] for name in ("gate_proj", "up_proj", "down_proj"))
    mlp = jax.jit(lambda x, g: jax_vjp(L.swiglu, g, x, wg, wu, wd))
    thx, tdhx, tmlp = leaf(hx), torch.from_numpy(dhx), tlayer0.mlp

    def torch_mlp():
        return torch_grads(tmlp(thx), tdhx, thx, params=tmlp.parameters())

    # one decoder layer, and the stack of all layers
    x, dx = normal(b, t, d), normal(b, t, d)
    attend = lambda q, k, v: (core(q, k, v), None)

    def layer_fn(p, x):
        return L.decoder_layer(p, x, cos, sin, attend, eps=c.rms_norm_eps)[0]

    layer = jax.jit(lambda p, x, g: jax_vjp(lambda x, p: layer_fn(p, x), g, x, p))
    tx, tdx = leaf(x), torch.from_numpy(dx)
    rope = tmodel.model.rotary_emb(tx, tpos)

    def torch_layer():
        out = tlayer0(tx, attention_mask=None, position_ids=tpos, position_embeddings=rope)
        out = out[0] if isinstance(out, tuple) else out
        return torch_grads(out, tdx, tx, params=tlayer0.parameters())[:2]

    options = model.options

    def stack_fn(embed, stacked):
        return F.forward(stacked, embed, ids, seg, pos, config=c, options=options)[0]

    stack = jax.jit(lambda e, s, g: jax_vjp(stack_fn, g, e, s))
    temb = tmodel.model.embed_tokens.weight

    def torch_stack():
        hidden = tmodel.model.embed_tokens(tids)
        for lyr in tmodel.model.layers:
            hidden = lyr(hidden, attention_mask=None, position_ids=tpos, position_embeddings=rope)
            hidden = hidden[0] if isinstance(hidden, tuple) else hidden
        return torch_grads(hidden, tdx, temb, params=tmodel.model.parameters())[:2]

    # final norm, tied head, next-token loss
    def head_fn(x, norm, w):
        hn = L.rms_norm(x, norm, c.rms_norm_eps).reshape(b * t, d)
        logits = jnp.einsum("td,vd->tv", hn, w).reshape(b, t, -1)  # [B, T, V]
        return M._next_token_loss(logits, ids)

    head = jax.jit(lambda x, norm, w: jax_vjp(head_fn, jnp.ones(()), x, norm, w))
    tnorm = tmodel.model.norm

    def torch_head():
        logits = tmodel.lm_head(tnorm(tx))
        loss = tmodel.loss_function(logits=logits, labels=tids, vocab_size=c.vocab_size)
        return torch_grads(loss, torch.ones(()), tx, params=tmodel.parameters())[:2]

    # AdamW: one update from the same parameters and gradients
    tx_opt = optax.adamw(M.LR, b1=M.BETAS[0], b2=M.BETAS[1], eps=M.EPS, weight_decay=M.WEIGHT_DECAY)
    _, params = nnx.split(model, nnx.Param)
    grads = jax.tree.map(lambda p: 1e-3 * p + 1e-4, params)
    opt = {"p": params, "s": tx_opt.init(params)}
    update = jax.jit(
        lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*tx_opt.update(g, s, p))
    )
    # the torch side updates its own copy (the other blocks keep their weights)
    tparams = [torch.nn.Parameter(p.detach().clone()) for p in tmodel.parameters()]
    tgrads = [1e-3 * p.detach() + 1e-4 for p in tparams]
    topt = torch.optim.AdamW(
        tparams, lr=M.LR, betas=M.BETAS, eps=M.EPS, weight_decay=M.WEIGHT_DECAY
    )

    def jax_adamw():
        opt["p"], opt["s"] = update(opt["p"], opt["s"], grads)
        return [opt["p"]["embed_tokens"].get_value()]

    def torch_adamw():
        for p, g in zip(tparams, tgrads, strict=True):
            p.grad = g
        topt.step()
        return [tparams[0].detach()]

    jx, jdx, jhx, jdhx = (jnp.asarray(a) for a in (x, dx, hx, dhx))
    jq, jk, jv, jdq = (jnp.asarray(a) for a in (q, k, v, dq))
    return [
        Block("attention core", lambda: attn(jq, jk, jv, jdq), torch_attention),
        Block("MLP", lambda: mlp(jhx, jdhx), torch_mlp),
        Block("decoder layer", lambda: layer(layer0, jx, jdx), torch_layer),
        Block("layer stack", lambda: stack(embed, stacked, jdx), torch_stack),
        Block("head + loss", lambda: head(jx, final_norm, embed), torch_head),
        Block("AdamW", jax_adamw, torch_adamw),
    ]


def time_blocks(
    named: Sequence[tuple[str, Callable[[], None], Callable[[], None]]], steps: int, warmup: int
) -> dict[str, tuple[float, float, float, float]]:
    """name -> (jax wall, torch wall, jax cpu, torch cpu), medians in seconds; the two sides of
    each block run in turn (`model_step.back_to_back`), block after block, ``steps`` rounds."""
    for _, run_jax, run_torch in named:
        for _ in range(warmup):
            run_jax()
            run_torch()
    samples: dict[str, list[list[float]]] = {name: [[], [], [], []] for name, _, _ in named}
    for _ in range(steps):
        for name, run_jax, run_torch in named:
            for side, run in enumerate((run_jax, run_torch)):
                wall, cpu = M.back_to_back(run)
                samples[name][side].append(wall)
                samples[name][2 + side].append(cpu)
    return {name: tuple(statistics.median(s) for s in v) for name, v in samples.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12, help="timed rounds (medians)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--scan-unroll", type=int, default=1, help="ModelOptions.scan_unroll")
    args = parser.parse_args(argv)
    for name in ("batch", "seq", "steps", "scan_unroll"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ModuleNotFoundError as e:
        sys.exit(f"benchmarks.model_blocks compares against PyTorch: {e} (the test extra)")
    ensure_environment(1, "benchmarks.model_blocks", sys.argv[1:] if argv is None else argv)

    config = M.BENCH_CONFIG
    print(
        f"config: {config.num_params() / 1e6:.1f}M params, batch {args.batch} x {args.seq}, fp32, "
        f"JAX scan_unroll {args.scan_unroll}; {os.cpu_count()} CPUs, jax {jax.__version__}"
    )
    pairs = blocks(config, args.batch, args.seq, args.scan_unroll)
    ids = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq))
    jstep = M.jax_side(config, ids.astype(np.int32), args.scan_unroll)
    tstep = M.torch_side(config, ids.astype(np.int32))
    named = [(p.name, lambda f=p.jax: jax.block_until_ready(f()), p.torch) for p in pairs]
    named.append(("train step", jstep.step, tstep.step))
    med = time_blocks(named, args.steps, args.warmup)

    print(
        f"\n{'block':16s} {'jax ms':>8s} {'torch ms':>9s} {'torch/jax':>9s} "
        f"{'jax cpu ms':>10s} {'torch cpu ms':>12s} {'torch/jax cpu':>13s}"
    )
    for name, (jw, tw, jc, tc) in med.items():
        print(
            f"{name:16s} {1e3 * jw:8.1f} {1e3 * tw:9.1f} {tw / jw:9.2f} "
            f"{1e3 * jc:10.1f} {1e3 * tc:12.1f} {tc / jc:13.2f}"
        )
    parts = ("layer stack", "head + loss", "AdamW")
    jsum, tsum = (sum(med[p][side] for p in parts) for side in (0, 1))
    jw, tw = med["train step"][:2]
    print(
        f"\nstep vs its blocks (layer stack + head + AdamW): JAX {1e3 * jw:.0f} ms vs "
        f"{1e3 * jsum:.0f} ms ({jw / jsum:.2f}x), PyTorch {1e3 * tw:.0f} ms vs {1e3 * tsum:.0f} ms "
        f"({tw / tsum:.2f}x)"
    )


if __name__ == "__main__":
    main()
