"""Sequence packing: FFD layout, token budgets, and packed == padded through the train step."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.algorithms.losses import LossTerms
from bapo_jax.models import ModelOptions, Qwen2Config
from bapo_jax.train.batch import TrainBatch
from bapo_jax.train.packing import PackingConfig, first_fit_decreasing, pack_batch, unpack
from bapo_jax.train.state import init_train_state
from bapo_jax.train.step import StepConfig, make_logprob_fn, make_train_step

CONFIG = Qwen2Config.preset("tiny")
B, T, ROW = 8, 40, 48


def test_first_fit_decreasing_is_deterministic_and_respects_capacity():
    lengths = [30, 5, 20, 20, 9, 40, 1, 0, 15]
    bins = first_fit_decreasing(lengths, 40)
    assert bins == [[5], [0, 4, 6], [2, 3], [8, 1]]
    assert first_fit_decreasing(lengths, 40) == bins
    placed = sorted(i for b in bins for i in b)
    assert placed == [i for i, n in enumerate(lengths) if n > 0]
    assert all(sum(lengths[i] for i in b) <= 40 for b in bins)
    with pytest.raises(ValueError, match="length 41 > row_length=40"):
        first_fit_decreasing([41], 40)


def test_first_fit_decreasing_respects_the_scored_capacity():
    """A second capacity (trained tokens per row) opens a new row where length alone would not."""
    lengths, scored = [20, 15, 10], [18, 12, 2]
    assert first_fit_decreasing(lengths, 50) == [[0, 1, 2]]
    assert first_fit_decreasing(lengths, 50, scored, scored_capacity=20) == [[0, 2], [1]]
    with pytest.raises(ValueError, match="19 trained tokens > max_scored_per_row=18"):
        first_fit_decreasing([20], 50, [19], scored_capacity=18)


def test_packing_config_validates():
    with pytest.raises(ValueError, match="row_length must be an int >= 1"):
        PackingConfig(row_length=0)
    with pytest.raises(ValueError, match="multiple of row_multiple=2"):
        PackingConfig(row_length=8, rows_per_micro_batch=3, row_multiple=2)
    assert PackingConfig(row_length=8, rows_per_micro_batch=4).token_budget == 32


def _padded_batch(seed: int, logp_fn, params) -> TrainBatch:
    """Long-tailed lengths, left and right padding, prompts of 3-6 tokens."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, 7, size=B)
    total = np.minimum(prompt + np.ceil(rng.pareto(1.5, size=B) * 4 + 1).astype(int), T - 4)
    pad = rng.integers(0, T - total + 1)
    pos = np.arange(T)
    attention = (pos[None] >= pad[:, None]) & (pos[None] < (pad + total)[:, None])
    loss_mask = attention & (pos[None] >= (pad + prompt)[:, None])
    ids = np.where(attention, rng.integers(3, CONFIG.vocab_size, size=(B, T)), 0).astype(np.int32)
    logp, _ = logp_fn(params, jnp.asarray(ids), jnp.asarray(attention, jnp.int32))
    behavior = np.asarray(logp) + rng.normal(0.0, 0.3, size=(B, T)).astype(np.float32)
    adv = np.where(rng.random(B) < 0.5, 1.0, -1.0).astype(np.float32)[:, None]
    return TrainBatch(
        input_ids=ids,
        attention_mask=attention.astype(np.int32),
        loss_mask=loss_mask.astype(np.float32),
        advantages=(np.broadcast_to(adv, (B, T)) * loss_mask).astype(np.float32),
        behavior_logp=np.where(loss_mask, behavior, 0.0).astype(np.float32),
        ref_logp=np.where(loss_mask, np.asarray(logp) - 0.1, 0.0).astype(np.float32),
    )


def test_pack_batch_layout_and_unpack_roundtrip():
    rng = np.random.default_rng(0)
    lengths = np.array([10, 3, 25, 7, 0, 12])
    start = rng.integers(0, T - lengths + 1)
    pos = np.arange(T)
    attention = (pos[None] >= start[:, None]) & (pos[None] < (start + lengths)[:, None])
    ids = np.where(attention, np.arange(1, T + 1)[None] + 100 * np.arange(6)[:, None], 0)
    batch = TrainBatch(
        input_ids=ids.astype(np.int32),
        attention_mask=attention.astype(np.int32),
        loss_mask=np.zeros((6, T), np.float32),
        advantages=np.zeros((6, T), np.float32),
        behavior_logp=np.zeros((6, T), np.float32),
    )
    packed, layout = pack_batch(batch, PackingConfig(row_length=32, rows_per_micro_batch=2))
    packed.check()
    # FFD: [25, 7] | [12, 10, 3] -> 2 rows = 1 micro-batch of 2 rows.
    assert layout.num_micro_batches == 1
    np.testing.assert_array_equal(packed.segment_ids[0], [1] * 25 + [2] * 7)
    np.testing.assert_array_equal(packed.segment_ids[1], [1] * 12 + [2] * 10 + [3] * 3 + [0] * 7)
    np.testing.assert_array_equal(packed.positions[1, :12], np.arange(12))
    np.testing.assert_array_equal(packed.positions[1, 12:22], np.arange(10))
    np.testing.assert_array_equal(packed.attention_mask, packed.segment_ids > 0)
    np.testing.assert_array_equal(unpack(packed.input_ids, layout), batch.input_ids)
    assert packed.attention_mask.sum() == batch.attention_mask.sum()
    # A tight token budget makes more micro-batches, padded with empty rows.
    packed, layout = pack_batch(batch, PackingConfig(row_length=25))
    assert layout.num_micro_batches == packed.batch_size == 3


def test_pack_batch_fixed_micro_batch_count_and_dropped_sequences():
    """The trainer's fixed shape: bins dealt to the used micro-batches in turn, the rest empty;
    sequences without a trained token left out (unpacked as the fill value)."""
    lengths, trained = np.array([10, 3, 25, 7, 9, 12]), np.array([4, 1, 20, 0, 5, 6])
    pos = np.arange(T)
    attention = pos[None] < lengths[:, None]
    loss_mask = attention & (pos[None] >= (lengths - trained)[:, None])
    ids = np.where(attention, 1 + pos[None] + 100 * np.arange(6)[:, None], 0).astype(np.int32)
    zeros = np.zeros((6, T), np.float32)
    batch = TrainBatch(ids, attention.astype(np.int32), loss_mask.astype(np.float32), zeros, zeros)
    config = PackingConfig(
        row_length=26,
        rows_per_micro_batch=2,
        num_micro_batches=3,
        max_scored_per_row=20,
        drop_untrained=True,
    )
    packed, layout = pack_batch(batch, config)
    # FFD over 25|12|10|9|3 (7 dropped), trained <= 20 a row: [25] [12, 10, 3] [9] -> 3 bins,
    # 2 micro-batches used; bin k -> micro-batch k mod 2, split row r * 3 + m.
    assert (layout.num_micro_batches, layout.used_micro_batches, layout.used_rows) == (3, 2, 3)
    assert packed.batch_size == 6
    micro = packed.split(3)
    np.testing.assert_array_equal(micro.segment_ids[0, 0, :25], [1] * 25)  # bin 0
    np.testing.assert_array_equal(micro.segment_ids[1, 0, :25], [1] * 12 + [2] * 10 + [3] * 3)
    np.testing.assert_array_equal(micro.segment_ids[0, 1, :9], [1] * 9)  # bin 2
    assert micro.attention_mask[2].sum() == 0 and micro.attention_mask[1, 1].sum() == 0
    assert layout.row[3] == -1
    back = unpack(packed.input_ids, layout, fill=-1)
    np.testing.assert_array_equal(back[3], -1)
    keep = np.arange(6) != 3
    np.testing.assert_array_equal(back[keep], np.where(attention, ids, -1)[keep])
    with pytest.raises(ValueError, match="need 3 micro-batches of 1 rows > num_micro_batches=2"):
        pack_batch(batch, PackingConfig(row_length=26, num_micro_batches=2, max_scored_per_row=20))


def test_pack_batch_rejects_trained_first_token_and_holes():
    ones = np.ones((1, 4), np.float32)
    batch = TrainBatch(ones.astype(np.int32), ones.astype(np.int32), ones, ones, ones)
    with pytest.raises(ValueError, match="first real token has loss_mask != 0"):
        pack_batch(batch, PackingConfig(row_length=4))
    holes = TrainBatch(
        ones.astype(np.int32), np.array([[1, 0, 1, 1]], np.int32), 0 * ones, ones, ones
    )
    with pytest.raises(ValueError, match="not one contiguous run"):
        pack_batch(holes, PackingConfig(row_length=4))


@pytest.mark.parametrize(
    ("attention", "aggregation", "scored"),
    [
        ("plain", "token_mean", False),  # the quickest; the others long: in `make test-slow`
        pytest.param("blockwise", "seq_mean_token_mean", True, marks=pytest.mark.slow),
        pytest.param("plain", "seq_mean_token_sum", True, marks=pytest.mark.slow),
    ],
)
def test_packed_equals_padded_through_train_step(attention, aggregation, scored):
    """Same sequences, padded [8, 40] vs packed into 48-token rows (several segments a row,
    >= 2 micro-batches plus an empty one the step skips): same log-probs, loss, BAPO bounds and
    gradients (SGD with lr 1 turns the update into -grad), for token- and sequence-level
    aggregation (packed: a sequence is a segment) and with the head on scored positions only."""
    options = ModelOptions(attention=attention, attention_block_q=16, attention_block_kv=8)
    optimizer = optax.sgd(1.0)
    loss_config = BAPOConfig(rho0=0.6, kl_coef=0.05, entropy_coef=0.01, aggregation=aggregation)
    assert isinstance(loss_config, LossTerms)
    width = T if scored else None  # every row's trained tokens fit
    graphdef, state = init_train_state(CONFIG, optimizer, options=options, seed=0)
    params0 = jax.device_get(state.params)
    logp_fn = make_logprob_fn(graphdef, StepConfig(loss="bapo", loss_config=loss_config))
    padded = _padded_batch(0, logp_fn, state.params)
    packed, layout = pack_batch(padded, PackingConfig(row_length=ROW, rows_per_micro_batch=1))
    assert layout.num_micro_batches >= 2
    assert (packed.segment_ids.max(axis=1) >= 2).any()  # several segments share a row
    packed, layout = pack_batch(
        padded,
        PackingConfig(row_length=ROW, num_micro_batches=layout.num_micro_batches + 1),
    )
    assert layout.used_micro_batches == layout.num_micro_batches - 1

    # Token-aligned log-probs agree on every real token, unpacked back to the padded layout;
    # with a scored width, on the trained tokens (0 elsewhere).
    scored_fn = make_logprob_fn(graphdef, StepConfig(scored_length=T))
    logp_padded, _ = logp_fn(state.params, padded.input_ids, padded.attention_mask)
    packed_args = (packed.input_ids, packed.attention_mask, packed.segment_ids, packed.positions)
    logp_packed, _ = logp_fn(state.params, *packed_args)
    logp_scored, _ = scored_fn(state.params, *packed_args, packed.loss_mask)
    real = padded.loss_mask > 0
    for logp in (logp_packed, logp_scored):
        np.testing.assert_allclose(
            unpack(np.asarray(logp), layout)[real], np.asarray(logp_padded)[real], atol=1e-5
        )
    assert np.all(np.asarray(logp_scored)[packed.loss_mask == 0] == 0.0)

    results = {}
    for name, batch, m in (("padded", padded, 1), ("packed", packed, layout.num_micro_batches)):
        step_config = StepConfig(
            loss="bapo", loss_config=loss_config, num_micro_batches=m, scored_length=width
        )
        _, fresh = init_train_state(CONFIG, optimizer, options=options, seed=0)
        step = make_train_step(graphdef, optimizer, step_config)
        new_state, metrics = step(fresh, jax.tree.map(jnp.asarray, batch))
        grads = jax.tree.map(lambda a, b: a - b, params0, jax.device_get(new_state.params))
        results[name] = (jax.device_get(metrics), grads)

    (m_pad, g_pad), (m_pack, g_pack) = results["padded"], results["packed"]
    keys = ("loss", "pg_loss", "kl_ref", "c_low", "c_high", "rho", "entropy", "grad_norm")
    keys += ("ratio_min", "ratio_max", "clip_high_frac", "clip_low_frac", "iterations", "reached")
    for key in keys:
        np.testing.assert_allclose(m_pack[key], m_pad[key], atol=1e-5, rtol=1e-5, err_msg=key)
    assert m_pack["num_tokens"] == m_pad["num_tokens"]
    chex.assert_trees_all_close(g_pack, g_pad, atol=1e-5, rtol=1e-4)
