"""Supervised warm start: batch layout, the masked loss against a numpy cross-entropy, learning,
determinism."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from bapo_jax.models import Qwen2Config
from bapo_jax.train import optim
from bapo_jax.train import sft as sft_lib
from bapo_jax.train.state import init_train_state

PAD = 0
CONFIG = Qwen2Config(
    vocab_size=32,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=2,
    eos_token_id=3,
    pad_token_id=PAD,
    max_window_layers=2,
)
PROMPTS = [[2, 5, 6, 7], [2, 9], [2, 11, 12]]
TARGETS = [[20, 21, 3], [22, 23, 24, 25, 3], [26, 3]]


def numpy_target_nll(logits: np.ndarray, batch: sft_lib.SFTBatch) -> float:
    """Plain cross-entropy: token t (a target token) is predicted by the logits at t - 1."""
    logits = np.asarray(logits, np.float64)
    ids, mask = np.asarray(batch.input_ids), np.asarray(batch.loss_mask)
    total, count = 0.0, 0
    for b in range(ids.shape[0]):
        for t in range(1, ids.shape[1]):
            if mask[b, t]:
                z = logits[b, t - 1]
                log_z = np.log(np.sum(np.exp(z - z.max()))) + z.max()
                total -= z[ids[b, t]] - log_z
                count += 1
    return total / count


@pytest.fixture(scope="module")
def setup():
    """(graphdef, initial state, compiled step), built once: every test copies the state (the
    step donates its input)."""
    optimizer = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-2, weight_decay=0.0))
    graphdef, state = init_train_state(CONFIG, optimizer, seed=0)
    return graphdef, state, sft_lib.make_sft_step(graphdef, optimizer)


def copy(tree):
    return jax.tree.map(jnp.copy, tree)


def test_batch_layout_by_hand():
    batch = sft_lib.make_sft_batch(PROMPTS[:2], TARGETS[:2], pad_id=PAD, length=8)
    np.testing.assert_array_equal(
        batch.input_ids, [[2, 5, 6, 7, 20, 21, 3, 0], [2, 9, 22, 23, 24, 25, 3, 0]]
    )
    np.testing.assert_array_equal(batch.attention_mask, [[1] * 7 + [0], [1] * 7 + [0]])
    np.testing.assert_array_equal(
        batch.loss_mask, [[0, 0, 0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 1, 0]]
    )
    chex.assert_type(batch.input_ids, np.int32)


def test_batch_errors():
    with pytest.raises(ValueError, match="longer than length=6"):
        sft_lib.make_sft_batch(PROMPTS[:2], TARGETS[:2], pad_id=PAD, length=6)
    with pytest.raises(ValueError, match="equal length"):
        sft_lib.make_sft_batch(PROMPTS, TARGETS[:2], pad_id=PAD, length=12)
    with pytest.raises(ValueError, match="row 1: prompt and target must be non-empty"):
        sft_lib.make_sft_batch([[2], [2]], [[4], []], pad_id=PAD, length=12)


def test_loss_is_the_target_token_cross_entropy(setup):
    graphdef, state, _ = setup
    batch = sft_lib.make_sft_batch(PROMPTS, TARGETS, pad_id=PAD, length=10)
    loss, metrics = sft_lib.sft_loss(graphdef, state.params, batch)
    model = nnx.merge(graphdef, state.params)
    logits = model(batch.input_ids, attention_mask=batch.attention_mask)  # [B, T, V]
    expected = numpy_target_nll(np.asarray(logits), batch)
    np.testing.assert_allclose(float(loss), expected, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["num_tokens"]), 10.0)

    # Prompt tokens are context, never targets: moving the split point changes the loss.
    shifted = sft_lib.make_sft_batch(
        [p + t[:1] for p, t in zip(PROMPTS, TARGETS, strict=True)],
        [t[1:] for t in TARGETS],
        pad_id=PAD,
        length=10,
    )
    chex.assert_trees_all_equal(shifted.input_ids, batch.input_ids)
    shifted_loss, _ = sft_lib.sft_loss(graphdef, state.params, shifted)
    np.testing.assert_allclose(
        float(shifted_loss), numpy_target_nll(np.asarray(logits), shifted), rtol=1e-5
    )
    assert abs(float(shifted_loss) - float(loss)) > 1e-4

    # Padding contents do not matter (right padding is masked out of attention and loss).
    noisy = sft_lib.SFTBatch(
        np.where(np.asarray(batch.attention_mask) > 0, batch.input_ids, 17).astype(np.int32),
        batch.attention_mask,
        batch.loss_mask,
    )
    noisy_loss, _ = sft_lib.sft_loss(graphdef, state.params, noisy)
    np.testing.assert_allclose(float(noisy_loss), float(loss), rtol=1e-6)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_loss_decreases_on_a_fixed_batch(setup):
    _, initial, step = setup
    state = copy(initial)
    batch = sft_lib.make_sft_batch(PROMPTS, TARGETS, pad_id=PAD, length=10)
    losses = []
    for _ in range(40):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.2 * losses[0], losses
    assert int(state.step) == 40
    np.testing.assert_array_less(0.0, float(metrics["grad_norm"]))


def test_same_seed_same_run(setup):
    """Same initial state and batch-order seed -> bitwise the same parameters; another
    order seed -> different ones."""
    _, initial, step = setup
    rows = [p + t for p, t in zip(PROMPTS, TARGETS, strict=True)] * 2
    prompts, targets = [r[:2] for r in rows], [r[2:] for r in rows]

    def run(seed):
        state = copy(initial)
        batches = sft_lib.epoch_batches(len(rows), 3, seed)
        for _ in range(4):
            idx = next(batches)
            batch = sft_lib.make_sft_batch(
                [prompts[i] for i in idx], [targets[i] for i in idx], pad_id=PAD, length=10
            )
            state, _ = step(state, batch)
        return jax.device_get(state.params)

    chex.assert_trees_all_equal(run(0), run(0))
    with pytest.raises(AssertionError):
        chex.assert_trees_all_close(run(0), run(1))


def test_epoch_batches_cover_each_epoch_and_are_seeded():
    it = sft_lib.epoch_batches(10, 3, seed=4)
    first_epoch = [next(it) for _ in range(3)]
    seen = np.concatenate(first_epoch)
    assert len(set(seen.tolist())) == 9  # the remainder (1 example) is dropped
    again = sft_lib.epoch_batches(10, 3, seed=4)
    chex.assert_trees_all_equal([next(again) for _ in range(3)], first_epoch)
    second_epoch = [next(it) for _ in range(3)]
    assert not all(np.array_equal(a, b) for a, b in zip(first_epoch, second_epoch, strict=True))
    with pytest.raises(ValueError, match="batch_size must be in"):
        next(sft_lib.epoch_batches(2, 3, seed=0))
