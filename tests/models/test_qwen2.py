"""The NNX Qwen2 model: logical axes, scan, remat, dtypes, attention core, masks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bapo_jax.models import (
    ModelOptions,
    Qwen2Config,
    Qwen2ForCausalLM,
    abstract_model,
    init_model,
    logical_axes,
    logical_partition_specs,
)
from bapo_jax.models import layers as L

AXIS_NAMES = {"layers", "vocab", "embed", "q_heads", "kv_heads", "head_dim", "mlp"}


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, (*prefix, k))
        else:
            yield (*prefix, k), v


@pytest.mark.parametrize("preset", ["tiny", "tiny-tied", "qwen2.5-7b"])
def test_every_parameter_declares_logical_axes_of_its_rank(preset):
    config = Qwen2Config.preset(preset)
    axes = dict(_flat(logical_axes(config)))
    shapes = dict(_flat(nnx.to_pure_dict(nnx.state(abstract_model(config), nnx.Param))))
    assert axes.keys() == shapes.keys()
    for path, names in axes.items():
        assert len(names) == len(shapes[path].shape), path
        assert set(names) <= AXIS_NAMES, path
        assert (names[0] == "layers") == (path[0] == "layers"), path
    assert axes[("embed_tokens",)] == ("vocab", "embed")
    assert axes[("layers", "q_proj")] == ("layers", "embed", "q_heads", "head_dim")
    assert axes[("layers", "k_proj")] == ("layers", "embed", "kv_heads", "head_dim")
    assert axes[("layers", "down_proj")] == ("layers", "mlp", "embed")
    assert (("lm_head",) in axes) == (not config.tie_word_embeddings)
    specs = logical_partition_specs(config)
    assert specs["layers"]["o_proj"].get_value() == jax.sharding.PartitionSpec(
        "layers", "q_heads", "head_dim", "embed"
    )


def test_abstract_model_allocates_nothing_and_counts_parameters():
    config = Qwen2Config.preset("qwen2.5-32b")
    model = abstract_model(config, ModelOptions(param_dtype=jnp.bfloat16))
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert sum(x.size for x in leaves) == config.num_params()
    assert 32.0e9 < config.num_params() < 33.5e9
    assert {x.dtype for x in leaves} == {jnp.dtype(jnp.bfloat16)}
    assert model.layers.gate_proj.get_value().shape == (64, 5120, 27648)


def test_layers_run_in_one_scan_whatever_the_depth():
    def scans(layers):
        config = Qwen2Config.preset("tiny").replace(num_hidden_layers=layers)
        graphdef, state = nnx.split(abstract_model(config))  # shapes only
        ids = jnp.zeros((1, 4), jnp.int32)
        jaxpr = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(ids))(state)
        found = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
        return [e.params["length"] for e in found], len(str(jaxpr))

    (l2, size2), (l9, size9) = scans(2), scans(9)
    assert l2 == [2] and l9 == [9]
    assert size9 == size2  # the traced program does not grow with depth


def _loss_and_grads(model, ids, mask):
    graphdef, params = nnx.split(model, nnx.Param)

    def loss(p):
        logits = nnx.merge(graphdef, p)(ids, attention_mask=mask)
        return jnp.sum(jax.nn.log_softmax(logits)[..., 0] * mask)

    return jax.jit(jax.value_and_grad(loss))(params)


REMAT_CONFIG = Qwen2Config.preset("tiny").replace(num_hidden_layers=3)
REMAT_IDS = jnp.asarray(np.random.default_rng(0).integers(0, 512, (2, 7)), jnp.int32)
REMAT_MASK = jnp.asarray([[0, 0, 1, 1, 1, 1, 1], [1] * 7], jnp.int32)


@pytest.fixture(scope="module")
def no_remat_loss_and_grads():
    return _loss_and_grads(init_model(REMAT_CONFIG), REMAT_IDS, REMAT_MASK)


@pytest.mark.parametrize("remat", ["full", "dots_saveable", "dots_with_no_batch_dims_saveable"])
def test_remat_policies_change_nothing_numerically(remat, no_remat_loss_and_grads):
    base_loss, base_grads = no_remat_loss_and_grads
    model = init_model(REMAT_CONFIG, ModelOptions(remat=remat))
    loss, grads = _loss_and_grads(model, REMAT_IDS, REMAT_MASK)
    np.testing.assert_allclose(loss, base_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(base_grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_scan_unroll_changes_nothing_numerically_forward_or_backward():
    config = Qwen2Config.preset("tiny").replace(num_hidden_layers=4)
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 512, (2, 5)), jnp.int32)
    scanned, unrolled = init_model(config), init_model(config, ModelOptions(scan_unroll=4))
    np.testing.assert_allclose(scanned(ids), unrolled(ids), rtol=1e-6, atol=1e-6)
    mask = jnp.ones(ids.shape, jnp.int32)
    loss_a, grads_a = _loss_and_grads(scanned, ids, mask)
    loss_b, grads_b = _loss_and_grads(unrolled, ids, mask)
    np.testing.assert_allclose(loss_a, loss_b, rtol=1e-6)
    for ga, gb in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_allclose(ga, gb, rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_bf16_compute_with_fp32_params_stays_close_to_fp32():
    config = Qwen2Config.preset("tiny-hd64")
    ids = jnp.asarray(np.random.default_rng(2).integers(0, 1024, (2, 9)), jnp.int32)
    f32 = init_model(config, seed=4)
    bf16 = init_model(config, ModelOptions(compute_dtype=jnp.bfloat16), seed=4)
    assert bf16.layers.q_proj.get_value().dtype == jnp.float32  # params stay fp32
    h = bf16.hidden_states(ids)
    assert h.dtype == jnp.bfloat16
    out = bf16(ids)
    assert out.dtype == jnp.float32  # logits always fp32
    np.testing.assert_allclose(out, f32(ids), atol=5e-2)


def test_gqa_attention_equals_attention_with_repeated_kv():
    rng = np.random.default_rng(3)
    b, t, n, k, h = 2, 6, 6, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, n, h)), jnp.float32)
    kk = jnp.asarray(rng.normal(size=(b, t, k, h)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, k, h)), jnp.float32)
    mask = L.causal_mask(jnp.asarray([[0, 1, 1, 1, 1, 1], [1] * 6]))
    out = L.attention(q, kk, v, mask)
    # reference: repeat each KV head for its G = n // k query heads, plain softmax attention
    kr, vr = jnp.repeat(kk, n // k, axis=2), jnp.repeat(v, n // k, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, kr) / np.sqrt(h)
    s = jnp.where(mask[:, None], s, -jnp.inf)
    ref = jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(s, axis=-1), vr)
    np.testing.assert_allclose(out[0, 1:], ref[0, 1:], atol=1e-5)  # row 0 query 0 sees nothing
    np.testing.assert_allclose(out[1], ref[1], atol=1e-5)
    assert np.isfinite(np.asarray(out)).all()


def test_positions_and_masks_for_left_padding():
    mask = jnp.asarray([[0, 0, 1, 1], [1, 1, 1, 1], [0, 0, 0, 1]])
    np.testing.assert_array_equal(L.positions(mask), [[0, 0, 0, 1], [0, 1, 2, 3], [0, 0, 0, 0]])
    m = np.asarray(L.causal_mask(mask))
    assert m.shape == (3, 4, 4)
    np.testing.assert_array_equal(m[0, 3], [False, False, True, True])
    np.testing.assert_array_equal(m[1], np.tril(np.ones((4, 4), bool)))
    assert not m[2, 2].any()  # a padding query sees no key


def test_rope_matches_the_rotate_half_formula():
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(1, 3, 2, 8)), jnp.float32)
    pos = jnp.asarray([[0, 5, 100]])
    cos, sin = L.rope_cos_sin(pos, 8, 10000.0)
    inv = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)
    ang = np.concatenate([np.asarray(pos)[..., None] * inv] * 2, axis=-1)[:, :, None]
    xn = np.asarray(x)
    rot = np.concatenate([-xn[..., 4:], xn[..., :4]], axis=-1)
    ref = xn * np.cos(ang) + rot * np.sin(ang)
    np.testing.assert_allclose(L.apply_rope(x, cos, sin), ref, atol=1e-5)


def test_model_call_checks_its_inputs():
    model = init_model(Qwen2Config.preset("tiny"))
    with pytest.raises(AssertionError):
        model(jnp.zeros((4,), jnp.int32))
    with pytest.raises(AssertionError):
        model(jnp.zeros((1, 4), jnp.float32))
    with pytest.raises(AssertionError):
        model(jnp.zeros((1, 4), jnp.int32), attention_mask=jnp.ones((1, 5), jnp.int32))


def test_model_is_an_nnx_module_with_tied_head():
    model = init_model(Qwen2Config.preset("tiny-tied"))
    assert isinstance(model, Qwen2ForCausalLM) and model.lm_head is None
    np.testing.assert_array_equal(model.unembedding(), model.embed_tokens.get_value())
    n = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert n == model.config.num_params()
