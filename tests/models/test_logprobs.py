"""Chunked token log-probs + entropy equal the full-logits computation, values and gradients."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.models import logprobs as lp

B, T, D, V = 2, 13, 16, 97  # V prime, so no vocab block size divides it


def make_inputs(seed=0, batch=B, length=T, dim=D, vocab=V):
    k_h, k_w, k_t, k_a, k_b = jax.random.split(jax.random.key(seed), 5)
    hidden = jax.random.normal(k_h, (batch, length, dim), jnp.float32)
    unembedding = 3.0 / math.sqrt(dim) * jax.random.normal(k_w, (vocab, dim), jnp.float32)
    targets = jax.random.randint(k_t, (batch, length), 0, vocab)
    weight_logp = jax.random.uniform(k_a, (batch, length), minval=-1.0, maxval=1.0)
    weight_ent = jax.random.uniform(k_b, (batch, length), minval=-1.0, maxval=1.0)
    return hidden, unembedding, targets, weight_logp, weight_ent


def weighted_grads(fn, hidden, unembedding, targets, weight_logp, weight_ent, **kwargs):
    def objective(h, w):
        logp, ent = fn(h, w, targets, **kwargs)
        total = jnp.sum(weight_logp * logp)
        return total if ent is None else total + jnp.sum(weight_ent * ent)

    return jax.grad(objective, argnums=(0, 1))(hidden, unembedding)


TILINGS = [  # (chunk_size, vocab_block_size): dividing, non-dividing, one token, larger than all
    (1, V),
    (5, 10),
    (13, 32),
    (26, 97),
    (7, 1),
    (64, 200),
]


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize(("chunk_size", "vocab_block_size"), TILINGS)
def test_values_match_full_logits(chunk_size, vocab_block_size, temperature):
    hidden, unembedding, targets, _, _ = make_inputs()
    logp, ent = lp.token_logprobs(
        hidden,
        unembedding,
        targets,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_block_size=vocab_block_size,
    )
    ref_logp, ref_ent = lp.full_token_logprobs(
        hidden, unembedding, targets, temperature=temperature
    )
    chex.assert_shape([logp, ent], (B, T))
    chex.assert_type([logp, ent], jnp.float32)
    chex.assert_trees_all_close((logp, ent), (ref_logp, ref_ent), atol=1e-5, rtol=0)
    # The data is not degenerate: entropies and log-probs vary across positions.
    assert float(ent.std()) > 0.2 and float(logp.std()) > 0.5


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize(("chunk_size", "vocab_block_size"), [(5, 10), (13, 97), (64, 32)])
def test_gradients_match_full_logits(chunk_size, vocab_block_size, temperature):
    inputs = make_inputs(seed=1)
    grads = weighted_grads(
        lp.token_logprobs,
        *inputs,
        temperature=temperature,
        chunk_size=chunk_size,
        vocab_block_size=vocab_block_size,
    )
    ref = weighted_grads(lp.full_token_logprobs, *inputs, temperature=temperature)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, ref)
    chex.assert_trees_all_close(grads, ref, atol=1e-5, rtol=0)
    assert all(float(jnp.abs(g).max()) > 0.1 for g in ref)  # gradients are not trivially zero


def test_uniform_logits_have_closed_form():
    hidden, _, targets, _, _ = make_inputs()
    logp, ent = lp.token_logprobs(hidden, jnp.zeros((V, D)), targets, chunk_size=4)
    np.testing.assert_allclose(logp, np.full((B, T), -math.log(V)), rtol=1e-6)
    np.testing.assert_allclose(ent, np.full((B, T), math.log(V)), rtol=1e-6)


def test_without_entropy():
    inputs = make_inputs(seed=2)
    hidden, unembedding, targets, _, _ = inputs
    logp, ent = lp.token_logprobs(
        hidden, unembedding, targets, chunk_size=6, vocab_block_size=40, return_entropy=False
    )
    assert ent is None
    ref_logp, _ = lp.full_token_logprobs(hidden, unembedding, targets)
    chex.assert_trees_all_close(logp, ref_logp, atol=1e-5, rtol=0)
    grads = weighted_grads(
        lp.token_logprobs, *inputs, chunk_size=6, vocab_block_size=40, return_entropy=False
    )
    ref = weighted_grads(lp.full_token_logprobs, *inputs, return_entropy=False)
    chex.assert_trees_all_close(grads, ref, atol=1e-5, rtol=0)


def test_jit_and_vmap_agree_with_eager():
    hidden, unembedding, targets, _, _ = make_inputs(seed=3)
    kwargs = dict(chunk_size=8, vocab_block_size=30, temperature=0.8)
    eager = lp.token_logprobs(hidden, unembedding, targets, **kwargs)
    jitted = jax.jit(lambda h, w, t: lp.token_logprobs(h, w, t, **kwargs))(
        hidden, unembedding, targets
    )
    chex.assert_trees_all_close(jitted, eager, atol=1e-6, rtol=0)
    # vmap over a leading axis of independent [1, T] problems.
    per_row = jax.vmap(lambda h, t: lp.token_logprobs(h[None], unembedding, t[None], **kwargs))(
        hidden, targets
    )
    chex.assert_shape(per_row, (B, 1, T))
    chex.assert_trees_all_close(tuple(x[:, 0] for x in per_row), eager, atol=1e-6, rtol=0)


def test_bf16_compute_matches_bf16_full_path():
    inputs = make_inputs(seed=4)
    hidden, unembedding, targets, _, _ = inputs
    kwargs = dict(compute_dtype=jnp.bfloat16)
    logp, ent = lp.token_logprobs(
        hidden, unembedding, targets, chunk_size=5, vocab_block_size=20, **kwargs
    )
    ref_logp, ref_ent = lp.full_token_logprobs(hidden, unembedding, targets, **kwargs)
    chex.assert_type([logp, ent], jnp.float32)
    # Same bf16 operands and fp32 accumulation: only summation order differs.
    chex.assert_trees_all_close((logp, ent), (ref_logp, ref_ent), atol=1e-4, rtol=0)
    fp32_logp, _ = lp.full_token_logprobs(hidden, unembedding, targets)
    assert float(jnp.abs(logp - fp32_logp).max()) > 1e-4  # bf16 really was used
    grads = weighted_grads(lp.token_logprobs, *inputs, chunk_size=5, vocab_block_size=20, **kwargs)
    ref = weighted_grads(lp.full_token_logprobs, *inputs, **kwargs)
    chex.assert_trees_all_equal_shapes_and_dtypes(grads, ref)
    chex.assert_trees_all_close(grads, ref, atol=2e-2, rtol=2e-2)


def test_bf16_parameters_get_bf16_gradients():
    inputs = make_inputs(seed=5)
    hidden, unembedding = inputs[0].astype(jnp.bfloat16), inputs[1].astype(jnp.bfloat16)
    d_h, d_w = weighted_grads(lp.token_logprobs, hidden, unembedding, *inputs[2:], chunk_size=4)
    chex.assert_type([d_h, d_w], jnp.bfloat16)
    ref_h, ref_w = weighted_grads(lp.full_token_logprobs, hidden, unembedding, *inputs[2:])
    chex.assert_trees_all_close((d_h, d_w), (ref_h, ref_w), atol=2e-2, rtol=2e-2)


def test_out_of_range_targets_give_nan():
    hidden, unembedding, targets, _, _ = make_inputs()
    bad = targets.at[0, 3].set(V).at[1, 0].set(-1)
    logp, ent = lp.token_logprobs(hidden, unembedding, bad, chunk_size=4, vocab_block_size=30)
    ref_logp, ref_ent = lp.full_token_logprobs(hidden, unembedding, bad)
    assert np.isnan(logp[0, 3]) and np.isnan(logp[1, 0])
    assert int(jnp.isnan(logp).sum()) == 2
    np.testing.assert_array_equal(np.isnan(ref_logp), np.isnan(logp))
    chex.assert_trees_all_close(ent, ref_ent, atol=1e-5, rtol=0)  # entropy is target-free


def test_empty_sequence():
    logp, ent = lp.token_logprobs(jnp.zeros((2, 0, D)), jnp.ones((V, D)), jnp.zeros((2, 0), int))
    chex.assert_shape([logp, ent], (2, 0))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(hidden=jnp.zeros((T, D))), r"hidden must be \[B, T, D\]"),
        (dict(unembedding=jnp.zeros((V, D + 1))), "must equal unembedding D"),
        (dict(targets=jnp.zeros((B, T + 1), jnp.int32)), r"targets must be \[B, T\]"),
        (dict(targets=jnp.zeros((B, T))), "targets must be integer"),
        (dict(temperature=0.0), "temperature must be finite and > 0, got 0.0"),
        (dict(temperature=jnp.float32(1.0)), "temperature must be a Python float"),
        (dict(chunk_size=0), "chunk_size must be an int >= 1, got 0"),
        (dict(vocab_block_size=2.5), "vocab_block_size must be an int >= 1, got 2.5"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    hidden, unembedding, targets, _, _ = make_inputs()
    args = dict(hidden=hidden, unembedding=unembedding, targets=targets) | kwargs
    with pytest.raises(ValueError, match=message):
        lp.token_logprobs(**args)


class FakeModel:
    """Duck-typed stand-in for the Qwen2 model: hidden states from an embedding lookup."""

    def __init__(self, embedding, head):
        self.embedding, self.head = embedding, head
        self.calls = []

    def hidden_states(self, input_ids, attention_mask=None, positions=None):
        self.calls.append(attention_mask)
        return jnp.tanh(self.embedding[input_ids])  # [B, T, D]

    def unembedding(self):
        return self.head


def test_model_token_logprobs_uses_hidden_states_and_unembedding():
    k_e, k_h, k_i = jax.random.split(jax.random.key(6), 3)
    model = FakeModel(jax.random.normal(k_e, (V, D)), jax.random.normal(k_h, (V, D)))
    input_ids = jax.random.randint(k_i, (B, T + 1), 0, V)
    mask = jnp.ones((B, T), jnp.int32).at[0, :2].set(0)
    logp, ent = lp.model_token_logprobs(
        model, input_ids[:, :-1], mask, input_ids[:, 1:], temperature=0.9, chunk_size=6
    )
    assert model.calls and model.calls[0] is mask
    ref = lp.full_token_logprobs(
        jnp.tanh(model.embedding[input_ids[:, :-1]]), model.head, input_ids[:, 1:], temperature=0.9
    )
    chex.assert_trees_all_close((logp, ent), ref, atol=1e-5, rtol=0)


def test_compiled_backward_temp_memory_is_far_below_full_logits():
    batch, length, dim, vocab = 2, 512, 32, 4096  # full logits: 2*512*4096*4 B = 16 MiB
    shapes = (
        jax.ShapeDtypeStruct((batch, length, dim), jnp.float32),
        jax.ShapeDtypeStruct((vocab, dim), jnp.float32),
        jax.ShapeDtypeStruct((batch, length), jnp.int32),
        jax.ShapeDtypeStruct((batch, length), jnp.float32),
        jax.ShapeDtypeStruct((batch, length), jnp.float32),
    )

    def temp_bytes(fn, **kwargs):
        compiled = jax.jit(lambda *a: weighted_grads(fn, *a, **kwargs)).lower(*shapes).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full = temp_bytes(lp.full_token_logprobs)
    chunked = temp_bytes(lp.token_logprobs, chunk_size=128, vocab_block_size=1024)
    logits_bytes = batch * length * vocab * 4
    assert full >= logits_bytes  # the full path really holds [B, T, V] fp32
    assert chunked < 0.15 * full, (chunked, full)


def test_batch_sharded_inputs_match_full_logits():
    devices = jax.devices()
    mesh = jax.sharding.Mesh(np.array(devices), ("data",))
    batch = len(devices)
    hidden, unembedding, targets, weight_logp, weight_ent = make_inputs(seed=7, batch=batch)
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    sharded = (
        jax.device_put(hidden, rows),
        jax.device_put(unembedding, replicated),
        jax.device_put(targets, rows),
    )
    kwargs = dict(chunk_size=5, vocab_block_size=40)
    values = jax.jit(lambda h, w, t: lp.token_logprobs(h, w, t, **kwargs))(*sharded)
    chex.assert_trees_all_close(
        values, lp.full_token_logprobs(hidden, unembedding, targets), atol=1e-5, rtol=0
    )
    grads = jax.jit(
        lambda h, w, t: weighted_grads(
            lp.token_logprobs, h, w, t, weight_logp, weight_ent, **kwargs
        )
    )(*sharded)
    ref = weighted_grads(
        lp.full_token_logprobs, hidden, unembedding, targets, weight_logp, weight_ent
    )
    chex.assert_trees_all_close(grads, ref, atol=1e-5, rtol=0)
