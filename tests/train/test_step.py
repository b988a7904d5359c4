"""The jitted train step: accumulation equals the full batch, meshes equal one device."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.models import ModelOptions, Qwen2Config
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.train import optim
from bapo_jax.train.batch import TrainBatch
from bapo_jax.train.state import init_train_state, state_shardings
from bapo_jax.train.step import StepConfig, make_logprob_fn, make_train_step, shard_batch

CONFIG = Qwen2Config.preset("tiny")
OPT = optim.OptimizerConfig(learning_rate=1e-3, warmup_steps=2, weight_decay=0.1)
B, T, PROMPT = 8, 24, 8


def make_batch(seed: int, logp_fn, params, lags: bool = False) -> TrainBatch:
    """Left-padded prompts + responses of varied length; behaviour log-probs = current log-probs
    plus noise (so ratios spread around 1); GRPO-like +-1 advantages per sequence; with `lags`,
    each sequence's tokens a lag of 0 to 3 versions."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, CONFIG.vocab_size, size=(B, T)).astype(np.int32)
    pad = rng.integers(0, 4, size=B)
    resp_len = rng.integers(4, T - PROMPT, size=B)
    pos = np.arange(T)
    attention = (pos[None] >= pad[:, None]) & (pos[None] < PROMPT + resp_len[:, None])
    loss_mask = (pos[None] >= PROMPT) & attention
    ids = np.where(attention, ids, 0)
    logp, _ = logp_fn(params, jnp.asarray(ids), jnp.asarray(attention, jnp.int32))
    behavior = np.asarray(logp) + rng.normal(0.0, 0.3, size=(B, T)).astype(np.float32)
    adv = np.where(rng.random(B) < 0.5, 1.0, -1.0).astype(np.float32)[:, None]
    lag = rng.integers(0, 4, size=(B, 1)) * loss_mask
    return TrainBatch(
        input_ids=jnp.asarray(ids),
        attention_mask=jnp.asarray(attention, jnp.int32),
        loss_mask=jnp.asarray(loss_mask, jnp.float32),
        advantages=jnp.asarray(np.broadcast_to(adv, (B, T)) * loss_mask, jnp.float32),
        behavior_logp=jnp.asarray(np.where(loss_mask, behavior, 0.0), jnp.float32),
        lags=jnp.asarray(lag, jnp.int32) if lags else None,
    )


@functools.cache
def run_steps(
    step_config: StepConfig,
    mesh_name: str | None,
    num_steps: int = 3,
    lags: bool = False,
    options: ModelOptions | None = None,
):
    """(params, per-step metrics) after `num_steps` updates; cached (configs are frozen);
    `options`: the model's (e.g. LoRA adapters)."""
    mesh = None
    if mesh_name is not None:
        cfg = mesh_lib.mesh_preset(mesh_name)
        mesh = mesh_lib.make_mesh(cfg, jax.devices()[: cfg.num_devices])
    optimizer = optim.make_optimizer(OPT)
    graphdef, state = init_train_state(CONFIG, optimizer, options=options, seed=0, mesh=mesh)
    logp_fn = make_logprob_fn(graphdef, step_config)
    shardings = None if mesh is None else state_shardings(state, mesh)
    step = make_train_step(
        graphdef,
        optimizer,
        step_config,
        learning_rate_fn=optim.learning_rate_schedule(OPT),
        state_shardings=shardings,
    )
    history = []
    for i in range(num_steps):
        batch = make_batch(i, logp_fn, state.params, lags)
        if mesh is not None:
            batch = shard_batch(batch, mesh)
        state, metrics = step(state, batch)
        history.append(jax.device_get(metrics))
    return jax.device_get(state.params), history


def test_step_runs_and_moves_bounds_metrics_complete():
    _, history = run_steps(StepConfig(loss="bapo", loss_config=BAPOConfig(rho0=0.6)), None)
    for metrics in history:
        for key in (
            "loss",
            "c_low",
            "c_high",
            "rho",
            "rho_before",
            "rho_fraction",
            "rho_fraction_before",
            "iterations",
            "grad_norm",
            "param_norm",
            "learning_rate",
            "entropy",
            "clip_high_frac",
            "ratio_mean",
        ):
            assert key in metrics, key
            assert np.isfinite(metrics[key]), (key, metrics[key])
    # rho0 = 0.6 with balanced +-1 advantages needs the search to move at least once.
    assert max(int(m["iterations"]) for m in history) > 0
    # Warm-up: lr 0.5e-3 then 1e-3.
    np.testing.assert_allclose([m["learning_rate"] for m in history], [5e-4, 1e-3, 1e-3])


@pytest.mark.parametrize(
    "loss",
    ["bapo", *(pytest.param(n, marks=pytest.mark.slow) for n in ("ppo_clip", "gspo", "cispo"))],
)
def test_gradient_accumulation_equals_full_batch(loss):
    kw = {"loss_config": BAPOConfig(rho0=0.6)} if loss == "bapo" else {}
    full_params, full = run_steps(StepConfig(loss=loss, **kw), None)
    acc_params, acc = run_steps(StepConfig(loss=loss, num_micro_batches=4, **kw), None)
    for a, b in zip(full, acc, strict=True):
        for key in ("loss", "c_low", "c_high", "grad_norm"):
            if key in a:
                np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert_params_close(acc_params, full_params)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_staleness_aware_bapo_accumulates_its_per_lag_search_exactly():
    """lag_buckets=3, scope="update": the micro-batches' per-bucket grid sums add to the full
    batch's search (the same bounds per lag), and the update equals the full batch's."""
    kw = {"loss_config": BAPOConfig(rho0=0.6, lag_buckets=3)}
    full_params, full = run_steps(StepConfig(loss="bapo", **kw), None, lags=True)
    acc_params, acc = run_steps(StepConfig(loss="bapo", num_micro_batches=4, **kw), None, lags=True)
    for a, b in zip(full, acc, strict=True):
        for b_key in ("c_low/lag0", "c_high/lag0", "c_low/lag2", "c_high/lag2"):
            assert float(a[b_key]) == float(b[b_key]), b_key
        for key in ("loss", "c_low", "c_high", "grad_norm"):
            np.testing.assert_allclose(b[key], a[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert_params_close(acc_params, full_params)
    assert any(float(m["c_high/lag0"]) != float(m["c_high/lag2"]) for m in full)


@pytest.mark.parametrize(  # the other meshes long: in `make test-slow` (CI runs it)
    "mesh_name",
    [
        pytest.param("cpu-fsdp8", marks=pytest.mark.slow),
        pytest.param("cpu-fsdp4-tp2", marks=pytest.mark.slow),
        "cpu-dp2-fsdp2-tp2",  # all three axes; its reference is the tests' above (cached)
    ],
)
def test_meshes_equal_single_device(mesh_name):
    step_config = StepConfig(loss="bapo", loss_config=BAPOConfig(rho0=0.6))
    ref_params, ref = run_steps(step_config, None)
    params, history = run_steps(step_config, mesh_name)
    for a, b in zip(ref, history, strict=True):
        assert float(a["c_low"]) == float(b["c_low"]) and float(a["c_high"]) == float(b["c_high"])
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-4, atol=1e-5)
    assert_params_close(params, ref_params)


def assert_params_close(params, ref_params, atol=1e-5, rtol=1e-4, outliers=1e-3):
    """Parameters after a few AdamW steps taken two ways (another summation order).

    Adam divides by sqrt(v): an element whose gradient is ~0 turns float32 summation-order noise
    into a step of up to ~lr, whatever the tolerance of the sums. So every element is within
    `atol + rtol |x|` except at most an `outliers` share (one element in 16k on an AVX2 CPU),
    and those are within one learning rate."""
    lr = OPT.learning_rate
    for path, a, b in zip(
        jax.tree_util.tree_leaves_with_path(params),
        jax.tree.leaves(params),
        jax.tree.leaves(ref_params),
        strict=True,
    ):
        diff = np.abs(np.asarray(a) - np.asarray(b))
        outside = diff > atol + rtol * np.abs(np.asarray(b))
        assert outside.mean() <= outliers, (path[0], outside.sum(), diff.max())
        assert diff.max() <= lr, (path[0], diff.max())


def test_recomputed_ratio_base_needs_old_logp():
    with pytest.raises(ValueError, match="ratio_base must be one of"):
        StepConfig(ratio_base="engine")
    with pytest.raises(ValueError, match="loss_config must be a PPOClipConfig"):
        StepConfig(loss="ppo_clip", loss_config=BAPOConfig())
    with pytest.raises(ValueError, match="num_micro_batches must be an int >= 1, got 0"):
        StepConfig(num_micro_batches=0)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_recomputed_ratio_base_with_matching_engine_equals_behavior_base():
    """With pi_old == pi_behaviour the IS weights are exactly 1 and r is the same ratio."""
    optimizer = optim.make_optimizer(OPT)
    behavior_cfg = StepConfig(loss="bapo", loss_config=BAPOConfig(rho0=0.6))
    recomputed_cfg = StepConfig(
        loss="bapo", loss_config=BAPOConfig(rho0=0.6), ratio_base="recomputed"
    )
    results = []
    for cfg in (behavior_cfg, recomputed_cfg):
        graphdef, state = init_train_state(CONFIG, optimizer, seed=0)
        batch = make_batch(0, make_logprob_fn(graphdef, cfg), state.params)
        batch = dataclasses.replace(batch, old_logp=batch.behavior_logp)
        _, metrics = make_train_step(graphdef, optimizer, cfg)(state, batch)
        results.append(jax.device_get(metrics))
    assert results[1]["is_weight_mean"] == pytest.approx(1.0)
    for key in ("loss", "c_high", "c_low", "grad_norm"):
        np.testing.assert_allclose(results[1][key], results[0][key], rtol=1e-6, err_msg=key)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
@pytest.mark.parametrize("is_mode", ["token_mask", "sequence_mask"])
def test_masked_importance_weights_in_the_step(is_mode):
    """pi_old one nat above pi_behaviour on half of the rows' tokens: w = e > 2 there, so the
    token mask drops exactly those tokens and the sequence mask the rows whose geometric mean
    leaves the band; the masked share is the loss metric, and the step still trains."""
    optimizer = optim.make_optimizer(OPT)
    cfg = StepConfig(
        loss="bapo", loss_config=BAPOConfig(rho0=0.6, is_mode=is_mode), ratio_base="recomputed"
    )
    graphdef, state = init_train_state(CONFIG, optimizer, seed=0)
    batch = make_batch(0, make_logprob_fn(graphdef, cfg), state.params)
    shift = np.zeros(batch.behavior_logp.shape, np.float32)
    shift[::2] = 1.0  # every other row: w = e on all its tokens
    batch = dataclasses.replace(batch, old_logp=batch.behavior_logp + jnp.asarray(shift))
    _, metrics = make_train_step(graphdef, optimizer, cfg)(state, batch)
    mask = np.asarray(batch.loss_mask)
    want = (mask * (shift > 0)).sum() / mask.sum()  # whole rows either way
    assert float(metrics["is_masked_frac"]) == pytest.approx(want, rel=1e-5)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0


def test_the_step_reports_its_tokens_gap_to_the_behaviour_log_probs():
    """|log pi_theta - log pi_behaviour| summed over the update's tokens, its max and the
    token count, by hand: make_batch's behaviour is the current log-prob plus noise."""
    from bapo_jax.train.reductions import first_update_gap

    optimizer = optim.make_optimizer(OPT)
    graphdef, state = init_train_state(CONFIG, optimizer, seed=0)
    config = StepConfig(num_micro_batches=2)
    logp_fn = make_logprob_fn(graphdef, config)
    batch = make_batch(0, logp_fn, state.params)
    logp, _ = logp_fn(state.params, batch.input_ids, batch.attention_mask)
    gap = np.abs(np.asarray(logp) - np.asarray(batch.behavior_logp)) * np.asarray(batch.loss_mask)
    _, metrics = make_train_step(graphdef, optimizer, config)(state, batch)
    metrics = jax.device_get(metrics)
    np.testing.assert_allclose(metrics["behavior_gap_sum"], gap.sum(), rtol=1e-4)
    np.testing.assert_allclose(metrics["behavior_gap_max"], gap.max(), rtol=1e-4)
    tokens = float(np.asarray(batch.loss_mask).sum())
    assert metrics["behavior_gap_tokens"] == tokens
    stats = [dict(metrics), dict(metrics)]
    out = first_update_gap(stats)
    assert out["mismatch/mean_abs"] == pytest.approx(gap.sum() / tokens, rel=1e-4)
    assert all("behavior_gap_sum" not in s for s in stats)  # removed from every update's
