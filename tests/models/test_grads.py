"""Gradients: the model's parameter gradients equal transformers' autograd, and each custom VJP
(`layers.rms_norm`, `layers.swiglu`, the attention core) equals plain autodiff of its formula."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from bapo_jax.models import layers as L  # noqa: E402
from bapo_jax.models.hf import load_pretrained, weight_map  # noqa: E402

from .hf_fixtures import TinySpec, hf_positions, left_padded_batch, make_hf_checkpoint  # noqa: E402


# ---- whole model vs transformers -----------------------------------------------------------------
@pytest.mark.parametrize(
    "spec",
    [
        TinySpec(heads=4, kv_heads=2, head_dim=16, tied=True),
        TinySpec(heads=6, kv_heads=2, head_dim=8, tied=False, layers=3, rope_theta=1e6),
    ],
    ids=["gqa2-tied", "gqa3-untied-3l"],
)
def test_parameter_gradients_match_transformers(tmp_path, spec):
    """Left-padded batch, masked next-token loss: every parameter's gradient (fp32)."""
    hf_model = make_hf_checkpoint(tmp_path, spec, seed=3).float()
    ids, mask = left_padded_batch(spec.vocab, [9, 5, 12], 12, seed=1)
    weight = (mask[:, 1:] * mask[:, :-1]).astype(np.float32)  # real (input, target) pairs

    # transformers / torch autograd
    hf_model.zero_grad()
    logits = hf_model(
        input_ids=torch.from_numpy(ids.astype(np.int64)),
        attention_mask=torch.from_numpy(mask.astype(np.int64)),
        position_ids=torch.from_numpy(hf_positions(mask).astype(np.int64)),
    ).logits[:, :-1]
    logp = torch.log_softmax(logits.float(), dim=-1)
    tgt = torch.from_numpy(ids[:, 1:].astype(np.int64))[..., None]
    nll = -torch.gather(logp, -1, tgt)[..., 0]
    (nll * torch.from_numpy(weight)).sum().backward()
    hf_grads = {n: p.grad.numpy() for n, p in hf_model.named_parameters()}

    # this port
    model = load_pretrained(tmp_path, dtype=jnp.float32)
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        out = nnx.merge(graphdef, p)(jnp.asarray(ids), attention_mask=jnp.asarray(mask))
        lp = jax.nn.log_softmax(out[:, :-1], axis=-1)
        nll = -jnp.take_along_axis(lp, jnp.asarray(ids[:, 1:])[..., None], axis=-1)[..., 0]
        return jnp.sum(nll * weight)

    grads = nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))
    checked = 0
    for m in weight_map(model.config):
        tree = grads
        for key in m.path:
            tree = tree[key]
        tree = np.asarray(tree)
        for i, name in enumerate(m.hf_names(model.config)):
            ours = tree[i] if m.stacked else tree
            ref = m.to_tree(hf_grads[name])
            scale = max(1e-3, float(np.max(np.abs(ref))))
            np.testing.assert_allclose(ours, ref, atol=2e-5 * scale, rtol=1e-3, err_msg=name)
            checked += 1
    assert checked == len(hf_grads)


# ---- custom VJPs vs autodiff of the plain formulas -----------------------------------------------
def _rms_norm_ref(x, weight, eps):
    x32 = x.astype(jnp.float32)
    var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    return weight.astype(x.dtype) * (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)


def _swiglu_ref(h, wg, wu, wd):
    return (jax.nn.silu(h @ wg) * (h @ wu)) @ wd


def _attention_ref(q, k, v, mask):
    """Repeated-KV softmax attention, autodiff only; padding queries -> 0."""
    n, h = q.shape[2:]
    g = n // k.shape[2]
    kr, vr = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, kr, preferred_element_type=jnp.float32) / np.sqrt(h)
    s = jnp.where(mask[:, None], s, jnp.finfo(jnp.float32).min)
    out = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1).astype(v.dtype), vr)
    return jnp.where(jnp.any(mask, axis=-1)[:, :, None, None], out, 0)


def _vjp(fn, args, seed):
    out, pullback = jax.vjp(fn, *args)
    cot = jax.random.normal(jax.random.key(seed), out.shape, jnp.float32).astype(out.dtype)
    return out, pullback(cot)


def _check(fn, ref, args, tol, seed=0):
    out, grads = _vjp(fn, args, seed)
    ref_out, ref_grads = _vjp(ref, args, seed)
    assert out.dtype == ref_out.dtype
    np.testing.assert_allclose(np.float32(out), np.float32(ref_out), atol=tol, rtol=tol)
    for a, b in zip(grads, ref_grads, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        scale = max(1.0, float(np.max(np.abs(np.float32(b)))))
        np.testing.assert_allclose(np.float32(a), np.float32(b), atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_rms_norm_vjp_equals_autodiff(dtype, tol):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(3, 5, 32)) * 3, dtype)
    w = jnp.asarray(rng.uniform(0.5, 1.5, size=(32,)), jnp.float32)
    _check(lambda x, w: L.rms_norm(x, w, 1e-6), lambda x, w: _rms_norm_ref(x, w, 1e-6), (x, w), tol)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.bfloat16, 3e-2)])
def test_swiglu_vjp_equals_autodiff(dtype, tol):
    rng = np.random.default_rng(1)
    h = jnp.asarray(rng.normal(size=(10, 16)), dtype)
    wg, wu = (jnp.asarray(rng.normal(size=(16, 24)) * 0.3, dtype) for _ in range(2))
    wd = jnp.asarray(rng.normal(size=(24, 16)) * 0.3, dtype)
    _check(L.swiglu, _swiglu_ref, (h, wg, wu, wd), tol)


@pytest.mark.parametrize(
    "dtype,tol",
    [(jnp.float32, 1e-5), pytest.param(jnp.bfloat16, 3e-2, marks=pytest.mark.slow)],
)
def test_attention_vjp_equals_autodiff(dtype, tol):
    """GQA (G = 3), a left-padded row (queries that see nothing), a packed-style mask."""
    rng = np.random.default_rng(2)
    b, t, n, k, h = 3, 7, 6, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), dtype)
    kk, v = (jnp.asarray(rng.normal(size=(b, t, k, h)), dtype) for _ in range(2))
    pad = jnp.asarray([[0, 0, 1, 1, 1, 1, 1], [1] * 7, [1, 1, 1, 0, 0, 0, 0]])
    mask = L.causal_mask(pad)
    _check(
        lambda q, k, v: L.attention(q, k, v, mask),
        lambda q, k, v: _attention_ref(q, k, v, mask),
        (q, kk, v),
        tol,
    )
    _, (dq, _, _) = _vjp(lambda q, k, v: L.attention(q, k, v, mask), (q, kk, v), 0)
    assert np.all(np.float32(dq)[0, :2] == 0.0)  # padding queries get no gradient
