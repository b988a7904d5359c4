"""The step's gradient split by advantage sign (`StepConfig.gradient_by_sign_every`) and the norm
after clipping: the split leaves the update unchanged, and g_- is the gradient of the
negative tokens alone."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.train import optim
from bapo_jax.train.reductions import combine_updates
from bapo_jax.train.state import init_train_state
from bapo_jax.train.step import StepConfig, make_logprob_fn, make_train_step
from tests.train.test_step import CONFIG, OPT, assert_params_close, make_batch, run_steps

BAPO = BAPOConfig(rho0=0.6)


@pytest.mark.parametrize("micro_batches", [1, pytest.param(4, marks=pytest.mark.slow)])
def test_split_leaves_the_update_unchanged(micro_batches):
    plain = StepConfig(loss="bapo", loss_config=BAPO, num_micro_batches=micro_batches)
    split = dataclasses.replace(plain, gradient_by_sign_every=1, max_grad_norm=1.0)
    plain_params, plain_history = run_steps(plain, None)
    split_params, split_history = run_steps(split, None)
    assert_params_close(split_params, plain_params)
    for a, b in zip(plain_history, split_history, strict=True):
        np.testing.assert_allclose(b["grad_norm"], a["grad_norm"], rtol=1e-5)
        assert "grad_share_neg" not in a and "grad_norm_clipped" not in a
        assert 0.0 < b["grad_share_neg"] < 1.0
        np.testing.assert_allclose(
            b["grad_share_neg"], b["grad_norm_neg"] / (b["grad_norm_neg"] + b["grad_norm_pos"])
        )
        # ||g_+ + g_-|| <= ||g_+|| + ||g_-|| (triangle inequality)
        assert b["grad_norm"] <= b["grad_norm_pos"] + b["grad_norm_neg"] + 1e-6
        np.testing.assert_allclose(b["grad_norm_clipped"], min(b["grad_norm"], 1.0), rtol=1e-6)


def test_sampled_every_other_update():
    """every = 2: steps 0 and 2 split (the update is the plain one's), step 1 logs NaN; an
    iteration's row is the mean over the updates that measured it."""
    plain = StepConfig(loss="bapo", loss_config=BAPO)
    plain_params, _ = run_steps(plain, None)
    params, history = run_steps(dataclasses.replace(plain, gradient_by_sign_every=2), None)
    assert_params_close(params, plain_params)
    shares = [float(m["grad_share_neg"]) for m in history]
    assert np.isnan(shares[1]) and 0 < shares[0] < 1 and 0 < shares[2] < 1
    row = combine_updates(history, "bapo")
    np.testing.assert_allclose(row["grad_share_neg"], (shares[0] + shares[2]) / 2, rtol=1e-6)
    assert np.isnan(combine_updates(history[1:2], "bapo")["grad_share_neg"])


def one_step(step_config: StepConfig, batch_of):
    """Metrics of one update from the seed-0 state on `batch_of(logp_fn, params)`."""
    optimizer = optim.make_optimizer(OPT)
    graphdef, state = init_train_state(CONFIG, optimizer, seed=0)
    batch = batch_of(make_logprob_fn(graphdef, step_config), state.params)
    _, metrics = make_train_step(graphdef, optimizer, step_config)(state, batch)
    return jax.device_get(metrics)


def test_negative_part_is_the_gradient_of_the_negative_tokens_alone():
    """For a per-token loss (PPO clip) with the token count fixed by the mask, zeroing the
    A >= 0 tokens' advantages leaves exactly the A < 0 tokens' gradient: its norm is
    ||g_-||; zeroing the A < 0 ones gives ||g_+||."""
    split = StepConfig(loss="ppo_clip", gradient_by_sign_every=1)

    def keeping(sign):
        def batch_of(logp_fn, params):
            batch = make_batch(0, logp_fn, params)
            kept = jnp.where(sign * batch.advantages > 0, batch.advantages, 0.0)
            return dataclasses.replace(batch, advantages=kept)

        return batch_of

    both = one_step(split, lambda logp_fn, params: make_batch(0, logp_fn, params))
    negative_only = one_step(StepConfig(loss="ppo_clip"), keeping(-1.0))
    positive_only = one_step(StepConfig(loss="ppo_clip"), keeping(1.0))
    np.testing.assert_allclose(both["grad_norm_neg"], negative_only["grad_norm"], rtol=1e-5)
    np.testing.assert_allclose(both["grad_norm_pos"], positive_only["grad_norm"], rtol=1e-5)


def test_one_sign_only():
    """All advantages negative: g_+ = 0 and the share is 1 (no entropy or KL term)."""

    def negative(logp_fn, params):
        batch = make_batch(1, logp_fn, params)
        return dataclasses.replace(batch, advantages=-jnp.abs(batch.advantages))

    m = one_step(StepConfig(loss="ppo_clip", gradient_by_sign_every=1), negative)
    assert m["grad_norm_pos"] == 0.0
    np.testing.assert_allclose(m["grad_share_neg"], 1.0)
    np.testing.assert_allclose(m["grad_norm_neg"], m["grad_norm"], rtol=1e-6)


def test_bad_fields_are_refused():
    with pytest.raises(ValueError, match="max_grad_norm"):
        StepConfig(max_grad_norm=0.0)
    for bad in (-1, True, 1.5):
        with pytest.raises(ValueError, match="gradient_by_sign_every"):
            StepConfig(gradient_by_sign_every=bad)
