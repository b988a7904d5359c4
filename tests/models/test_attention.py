"""Attention implementations: blockwise (custom VJP) and dot_product_attention equal plain."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bapo_jax.models import ModelOptions, Qwen2Config, init_model
from bapo_jax.models import attention as A
from bapo_jax.models import layers as L

B, T, N, K, H = 3, 37, 4, 2, 8


def plain_attention(q, k, v, segment_ids):
    """The plain implementation, the reference the others are tested against."""
    return A.attend(q, k, v, segment_ids, implementation="plain")


def _segments() -> jnp.ndarray:
    """Row 0 left-padded (one segment), row 1 packed (3 segments + tail padding), row 2 a
    right-padded row (one segment)."""
    seg = np.zeros((B, T), np.int32)
    seg[0, 5:] = 1
    seg[1, :10], seg[1, 10:25], seg[1, 25:33] = 1, 2, 3
    seg[2, :20] = 1
    return jnp.asarray(seg)


def _qkv(seed: int = 0, dtype=jnp.float32):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, N, H)), dtype)
    k = jnp.asarray(rng.normal(size=(B, T, K, H)), dtype)
    v = jnp.asarray(rng.normal(size=(B, T, K, H)), dtype)
    w = jnp.asarray(rng.normal(size=(B, T, N, H)), jnp.float32)  # cotangent weights
    return q, k, v, w


def _value_and_grads(fn, q, k, v, w, seg):
    def loss(q, k, v):
        return jnp.sum(fn(q, k, v, seg).astype(jnp.float32) * w)

    out = fn(q, k, v, seg)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    return out, grads


def test_segment_mask_and_positions():
    seg = jnp.asarray([[0, 0, 1, 1, 1, 0], [1, 1, 2, 2, 2, 0]], jnp.int32)
    mask = np.asarray(L.causal_mask(seg))
    # Row 1, query 3 (segment 2) sees keys 2, 3 only; padding queries see nothing.
    np.testing.assert_array_equal(mask[1, 3], [False, False, True, True, False, False])
    assert not mask[0, 0].any() and not mask[1, 5].any()
    np.testing.assert_array_equal(L.positions(seg), [[0, 0, 0, 1, 2, 0], [0, 1, 0, 1, 2, 0]])
    # A padded batch's 0/1 mask as segment ids: HF's cumsum(mask) - 1, 0 on padding.
    padded = np.asarray([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], np.int32)
    np.testing.assert_array_equal(
        L.positions(jnp.asarray(padded)), np.where(padded > 0, np.cumsum(padded, -1) - 1, 0)
    )


def test_plain_zeroes_padding_queries_and_matches_dense_reference():
    q, k, v, _ = _qkv()
    seg = _segments()
    out = plain_attention(q, k, v, seg)
    assert np.all(np.asarray(out)[np.asarray(seg) == 0] == 0.0)
    # Reference: repeat K/V per query head, masked softmax in numpy.
    qn, kn, vn = (np.asarray(x, np.float64) for x in (q, k, v))
    kn, vn = np.repeat(kn, N // K, axis=2), np.repeat(vn, N // K, axis=2)
    scores = np.einsum("btnh,bsnh->bnts", qn, kn) / np.sqrt(H)
    mask = np.asarray(L.causal_mask(seg))[:, None]
    scores = np.where(mask, scores, -np.inf)
    rows = mask.any(-1, keepdims=True)
    scores = np.where(rows, scores, 0.0)
    probs = np.exp(scores - scores.max(-1, keepdims=True)) * mask
    probs = probs / np.maximum(probs.sum(-1, keepdims=True), 1e-30)
    ref = np.einsum("bnts,bsnh->btnh", probs, vn)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("causal_block", [10, 12, 36])  # 4, 4, 2 blocks; no prefix of H keys
def test_plain_causal_blocks_equal_one_block(causal_block):
    """Queries in blocks, each against its causal key prefix, equal the whole [T, S] at once
    (values and gradients; fp32 summation order aside) on left-padded, packed and right-padded
    rows, and form only the scores on and below the diagonal blocks."""
    assert L.MAX_CAUSAL_BLOCKS == 4
    q, k, v, w = _qkv(5)
    seg = _segments()
    mask = L.causal_mask(seg)

    def blocked(block):
        return lambda q, k, v, s: L.attention(q, k, v, mask, causal_block=block)

    ref_out, ref_grads = _value_and_grads(jax.jit(blocked(None)), q, k, v, w, seg)
    out, grads = _value_and_grads(jax.jit(blocked(causal_block)), q, k, v, w, seg)
    chex.assert_trees_all_equal_shapes_and_dtypes((out, grads), (ref_out, ref_grads))
    chex.assert_trees_all_close((out, grads), (ref_out, ref_grads), atol=1e-6, rtol=1e-6)
    pad = np.asarray(seg) == 0
    assert np.all(np.asarray(out)[pad] == 0.0) and np.all(np.asarray(grads[0])[pad] == 0.0)

    def dot_shapes(jaxpr):  # output shapes of every dot_general, nested jaxprs included
        for e in jaxpr.eqns:
            if e.primitive.name == "dot_general":
                yield e.outvars[0].aval.shape
            for sub in e.params.values():
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from dot_shapes(inner)

    def scores_formed(block):  # elements of every [B, K, G*Q, S'] fp32 score tensor
        fn = jax.make_jaxpr(lambda q, k, v: L.attention(q, k, v, mask, causal_block=block))
        shapes = list(dot_shapes(fn(q, k, v).jaxpr))
        return sum(int(np.prod(s)) for s in shapes if s[-1] != H)  # not the [.., H] outputs

    ends = [min(lo + causal_block, T) for lo in range(0, T, causal_block)]
    keys_seen = sum((hi - lo) * hi for lo, hi in zip([0, *ends[:-1]], ends, strict=True))
    assert scores_formed(causal_block) == B * N * keys_seen  # G*Q rows x prefix, per (B, K)
    assert scores_formed(None) == B * N * T * T
    assert keys_seen < T * T
    # More than MAX_CAUSAL_BLOCKS blocks (8 of 5 tokens), or one (37 tokens): the whole square.
    assert scores_formed(5) == scores_formed(37) == B * N * T * T
    with pytest.raises(ValueError, match="causal_block must be an int >= 1 or None, got 0"):
        L.attention(q, k, v, mask, causal_block=0)


@pytest.mark.parametrize("block_q, block_kv", [(8, 8), (16, 8), (8, 16), (5, 7), (64, 64)])
def test_blockwise_equals_plain_values_and_grads(block_q, block_kv):
    q, k, v, w = _qkv(1)
    seg = _segments()

    def blockwise(q, k, v, s):
        return A.blockwise_attention(q, k, v, s, block_q=block_q, block_kv=block_kv)

    ref_out, ref_grads = _value_and_grads(plain_attention, q, k, v, w, seg)
    out, grads = _value_and_grads(jax.jit(blockwise), q, k, v, w, seg)
    chex.assert_trees_all_equal_shapes_and_dtypes(out, ref_out)
    chex.assert_trees_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)
    chex.assert_tree_all_finite((out, grads))
    # Padding queries: output 0 and no gradient reaches their q rows.
    pad = np.asarray(seg) == 0
    assert np.all(np.asarray(out)[pad] == 0.0)
    assert np.all(np.asarray(grads[0])[pad] == 0.0)


def test_tile_ranges_skip_tiles_without_a_visible_pair():
    """Hand case, blocks of 2: segments 1 | 1 2 | 2 | padding. Query block 2 (segment 2) needs
    no key of block 0 (segment 1); the padding block needs nothing; the causal-only ranges are
    the full triangle."""
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 0, 0]], jnp.int32)
    kv_lo, kv_hi, q_lo, q_hi = (np.asarray(x) for x in A._tile_ranges(seg, 2, 2, True))
    np.testing.assert_array_equal(kv_lo, [0, 0, 1, 0])
    np.testing.assert_array_equal(kv_hi, [1, 2, 3, 0])  # block 3: empty range
    np.testing.assert_array_equal(q_lo, [0, 1, 2, 0])
    np.testing.assert_array_equal(q_hi, [2, 3, 3, 0])
    kv_lo, kv_hi, q_lo, q_hi = (np.asarray(x) for x in A._tile_ranges(seg, 2, 2, False))
    np.testing.assert_array_equal(kv_lo, [0, 0, 0, 0])
    np.testing.assert_array_equal(kv_hi, [1, 2, 3, 4])
    np.testing.assert_array_equal(q_lo, [0, 1, 2, 3])
    np.testing.assert_array_equal(q_hi, [4, 4, 4, 4])
    # A tile is needed if any row needs it: a second row of one segment needs the triangle.
    two = jnp.asarray([[1, 1, 1, 2, 2, 2, 0, 0], [1] * 8], jnp.int32)
    np.testing.assert_array_equal(A._tile_ranges(two, 2, 2, True)[1], [1, 2, 3, 4])
    # Unequal blocks (query 4, keys 2): query block 1 (segment 2, padding) skips key block 0.
    kv_lo, kv_hi, q_lo, q_hi = (np.asarray(x) for x in A._tile_ranges(seg, 4, 2, True))
    np.testing.assert_array_equal(kv_lo, [0, 1])
    np.testing.assert_array_equal(kv_hi, [2, 3])
    np.testing.assert_array_equal(q_lo, [0, 0, 1, 0])
    np.testing.assert_array_equal(q_hi, [1, 2, 2, 0])


@pytest.mark.parametrize("block_q, block_kv", [(4, 4), (8, 4), (4, 8)])
def test_blockwise_skipping_tiles_changes_no_bit(block_q, block_kv):
    """Skipping tiles without a visible pair gives exactly the values and gradients of visiting
    every causal tile (a skipped tile would add exact zeros): a packed row with a padding tail
    and a right-padded row (a left-padded row in the batch would need the whole triangle)."""
    q, k, v, w = (x[1:] for x in _qkv(4))
    seg = _segments()[1:]
    rows, pad = seg.shape[0], -T % np.lcm(block_q, block_kv)  # blockwise_attention's padding

    def padded(x):  # [rows, T, ...] -> [rows, T + pad, ...]
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

    def heads_first(x):  # [rows, T + pad, K, (G,) H] -> [rows, K, (G,) T + pad, H]
        return jnp.moveaxis(x, 1, -2)

    qg = heads_first(padded((q * H**-0.5).reshape(rows, T, K, N // K, H)))
    kp, vp, sp = heads_first(padded(k)), heads_first(padded(v)), padded(seg)
    wg = heads_first(padded(w.reshape(rows, T, K, N // K, H)))
    visits = [
        sum(int(np.sum(hi - lo)) for lo, hi in (r[:2], r[2:]))
        for r in (A._tile_ranges(sp, block_q, block_kv, by) for by in (True, False))
    ]
    assert visits[0] < visits[1], visits  # the case does skip tiles

    def run(by_segment):
        def loss(q, k, v):
            return jnp.sum(A._flash(q, k, v, sp, block_q, block_kv, by_segment) * wg)

        out = A._flash(qg, kp, vp, sp, block_q, block_kv, by_segment)
        return out, jax.grad(loss, argnums=(0, 1, 2))(qg, kp, vp)

    out, grads = jax.jit(run, static_argnums=0)(True)
    ref_out, ref_grads = jax.jit(run, static_argnums=0)(False)
    chex.assert_trees_all_equal((out, grads), (ref_out, ref_grads))


def test_blockwise_bf16_close_to_plain():
    q, k, v, _ = _qkv(2, jnp.bfloat16)
    seg = _segments()
    out = A.blockwise_attention(q, k, v, seg, block_q=8, block_kv=8)
    ref = plain_attention(q, k, v, seg)
    assert out.dtype == jnp.bfloat16
    chex.assert_trees_all_close(
        out.astype(jnp.float32), ref.astype(jnp.float32), atol=2e-2, rtol=2e-2
    )


def test_blockwise_backward_saves_no_per_block_residuals():
    """The custom VJP keeps O(T) residuals: no [T, T]-sized or per-block stack survives the
    forward (plain autodiff through the scan would save every tile's probabilities)."""
    t = 256
    rng = np.random.default_rng(3)
    q = jnp.asarray(rng.normal(size=(1, t, N, H)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, t, K, H)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(1, t, K, H)), jnp.float32)
    seg = jnp.ones((1, t), jnp.int32)

    def saved_bytes(fn):
        # The VJP closure's leaves are exactly the residuals kept for the backward pass.
        _, vjp_fn = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(vjp_fn))

    blockwise = saved_bytes(
        lambda q, k, v, s: A.blockwise_attention(q, k, v, s, block_q=32, block_kv=32)
    )
    plain = saved_bytes(plain_attention)
    scores_bytes = N * t * t * 4
    # plain keeps the probabilities on and below the diagonal blocks: 3 of 4 blocks of 128
    assert A.PLAIN_CAUSAL_BLOCK == 128
    assert plain >= scores_bytes * 3 // 4
    assert blockwise < scores_bytes / 8, (blockwise, scores_bytes)


def test_dot_product_attention_xla_path_equals_plain():
    q, k, v, w = _qkv(4)
    seg = _segments()

    def xla(q, k, v, s):
        return A.dot_product_attention(q, k, v, s, implementation="xla")

    ref_out, ref_grads = _value_and_grads(plain_attention, q, k, v, w, seg)
    out, grads = _value_and_grads(xla, q, k, v, w, seg)
    chex.assert_trees_all_close(out, ref_out, atol=1e-5, rtol=1e-5)
    chex.assert_trees_all_close(grads, ref_grads, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="CPU behaviour of the cuDNN switch")
def test_cudnn_without_gpu_raises_clear_error():
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match="attention='cudnn' needs a GPU"):
        A.attend(q, k, v, _segments(), implementation="cudnn")
    model = init_model(Qwen2Config.preset("tiny"), ModelOptions(attention="cudnn"))
    with pytest.raises(ValueError, match="needs a GPU"):
        model(jnp.ones((1, 8), jnp.int32))


def test_bad_options_raise():
    with pytest.raises(ValueError, match=r"ModelOptions\.attention"):
        ModelOptions(attention="flash")
    with pytest.raises(ValueError, match="attention_block_q"):
        ModelOptions(attention_block_q=0)
    q, k, v, _ = _qkv()
    with pytest.raises(ValueError, match="block_kv must be an int >= 1"):
        A.blockwise_attention(q, k, v, _segments(), block_kv=0)
    with pytest.raises(ValueError, match="attention implementation must be"):
        A.attend(q, k, v, _segments(), implementation="flash")


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_model_blockwise_equals_plain_padded_and_packed():
    """The whole model (remat on) with blockwise attention: same logits and parameter grads."""
    config = Qwen2Config.preset("tiny")
    rng = np.random.default_rng(5)
    ids = jnp.asarray(rng.integers(3, config.vocab_size, size=(B, T)), jnp.int32)
    seg = _segments()
    models = {
        impl: init_model(
            config,
            ModelOptions(attention=impl, remat="full", attention_block_q=8, attention_block_kv=16),
            seed=0,
        )
        for impl in ("plain", "blockwise")
    }
    mask = (seg != 0).astype(jnp.int32)
    for kwargs in ({"attention_mask": mask}, {"segment_ids": seg}):
        outs = {}
        for impl, model in models.items():
            graphdef, params = nnx.split(model)

            def loss(params, kwargs=kwargs, graphdef=graphdef):
                logits = nnx.merge(graphdef, params)(ids, **kwargs)
                real = (seg != 0)[..., None]
                return jnp.sum(jnp.where(real, jax.nn.log_softmax(logits), 0.0)[..., :7])

            outs[impl] = jax.value_and_grad(loss)(params)
        chex.assert_trees_all_close(outs["blockwise"], outs["plain"], atol=1e-5, rtol=1e-4)
