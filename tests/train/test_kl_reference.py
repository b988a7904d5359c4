"""KL to a frozen reference policy through the train step and the Trainer.

Train step (SGD with learning rate 1, so the parameter change IS minus the gradient): with
kl_coef = beta, the loss equals the no-KL loss plus beta * agg(KL_t) computed in numpy from the
policy's and the reference's log-probs, and the gradient gains beta * grad agg(KL_t). The
Trainer builds the reference (initial weights, or an HF directory; sharded like the policy),
computes log pi_ref in its log-prob pass and reports `kl_ref`; bad settings are refused.
"""

from __future__ import annotations

import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.algorithms.losses import PPOClipConfig
from bapo_jax.models import Qwen2Config, init_model, save_pretrained
from bapo_jax.run import build
from bapo_jax.run.config import RunConfig, RunConfigError
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.train import reference as reference_lib
from bapo_jax.train.config import AlgorithmConfig
from bapo_jax.train.state import init_train_state, split_model, state_shardings
from bapo_jax.train.step import StepConfig, make_logprob_fn, make_train_step, sequence_logprobs
from tests.algorithms.test_kl_reference import numpy_agg_weights, numpy_kl
from tests.train.loop_fixtures import MODEL, make_trainer, small_config
from tests.train.test_step import CONFIG, make_batch

SGD = optax.sgd(1.0)


def _state(seed: int):
    return init_train_state(CONFIG, SGD, seed=seed)


def _one_step(step_config: StepConfig, batch):
    """(params before, params after, metrics) of one SGD step from the seed-0 policy."""
    graphdef, state = _state(0)
    before = jax.tree.map(jnp.copy, state.params)  # the step donates the state
    step = make_train_step(graphdef, SGD, step_config)
    state, metrics = step(state, batch)
    return before, state.params, jax.device_get(metrics)


def _reference_batch(step_config: StepConfig, ref_seed: int | None):
    """make_batch's rows with ref_logp from the seed-`ref_seed` weights (None: the policy's
    own), 0 off the loss mask; also the policy's log-probs and the graphdef."""
    graphdef, state = _state(0)
    logp_fn = make_logprob_fn(graphdef, step_config)
    batch = make_batch(3, logp_fn, state.params)
    ref_params = state.params if ref_seed is None else _state(ref_seed)[1].params
    ref_logp, _ = logp_fn(ref_params, batch.input_ids, batch.attention_mask)
    policy_logp, _ = logp_fn(state.params, batch.input_ids, batch.attention_mask)
    batch = dataclasses.replace(batch, ref_logp=ref_logp * batch.loss_mask)
    batch.check()
    return batch, np.asarray(policy_logp), graphdef


CASES = [  # (loss, estimator, aggregation, micro-batches); the others long: in `make test-slow`
    pytest.param("ppo_clip", "k1", "token_mean", 1, marks=pytest.mark.slow),
    ("ppo_clip", "k3", "seq_mean_token_mean", 1),  # the quickest, in the default suite
    pytest.param("ppo_clip", "k1", "seq_mean_token_sum", 1, marks=pytest.mark.slow),
    pytest.param("bapo", "k3", "token_mean", 2, marks=pytest.mark.slow),
]


def _configs(loss: str, estimator: str, aggregation: str, micro: int, beta: float):
    make = BAPOConfig if loss == "bapo" else PPOClipConfig
    extra = {"rho0": 0.6} if loss == "bapo" else {}
    return tuple(
        StepConfig(
            loss=loss,
            loss_config=make(kl_coef=kl, kl_estimator=estimator, aggregation=aggregation, **extra),
            num_micro_batches=micro,
        )
        for kl in (0.0, beta)
    )


@pytest.mark.parametrize("loss, estimator, aggregation, micro", CASES)
def test_step_adds_beta_times_the_kl_term(loss, estimator, aggregation, micro):
    beta = 0.5
    base, with_kl = _configs(loss, estimator, aggregation, micro, beta)
    batch, policy_logp, graphdef = _reference_batch(base, ref_seed=1)
    mask = np.asarray(batch.loss_mask)
    ref_logp = np.asarray(batch.ref_logp)
    kl, _ = numpy_kl(policy_logp, ref_logp, mask, estimator, aggregation)
    assert kl != 0.0
    before, after0, m0 = _one_step(base, batch)
    _, after1, m1 = _one_step(with_kl, batch)
    np.testing.assert_allclose(m1["kl_ref"], kl, rtol=1e-4)
    np.testing.assert_allclose(m1["loss"], m0["loss"] + beta * kl, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m1["pg_loss"], m0["pg_loss"], rtol=1e-6, atol=1e-7)

    # The gradient's KL part: beta * grad sum(w * KL_t), the estimator written out in jnp.
    weights = jnp.asarray(numpy_agg_weights(mask, aggregation), jnp.float32)

    def kl_objective(params):
        logp, _ = sequence_logprobs(
            graphdef, params, batch.input_ids, batch.attention_mask, base, with_entropy=False
        )
        if estimator == "k1":
            per_token = logp - batch.ref_logp
        else:
            x = batch.ref_logp - logp
            per_token = jnp.exp(x) - x - 1.0
        return jnp.sum(weights * jnp.where(batch.loss_mask > 0, per_token, 0.0))

    kl_grad = jax.jit(jax.grad(kl_objective))(before)  # one program, not op by op
    grad0 = jax.tree.map(jnp.subtract, before, after0)  # SGD, lr 1: p - p' = g
    grad1 = jax.tree.map(jnp.subtract, before, after1)
    difference = jax.tree.map(jnp.subtract, grad1, grad0)
    expected = jax.tree.map(lambda g: beta * g, kl_grad)
    scale = max(float(jnp.max(jnp.abs(x))) for x in jax.tree.leaves(expected))
    assert scale > 1e-4  # the KL part moves the parameters
    chex.assert_trees_all_close(difference, expected, atol=2e-3 * scale, rtol=1e-3)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_reference_equal_to_policy_gives_zero_kl_and_the_same_update():
    base, with_kl = _configs("ppo_clip", "k3", "token_mean", 1, beta=0.5)
    batch, _, _ = _reference_batch(base, ref_seed=None)
    _, after0, m0 = _one_step(base, batch)
    _, after1, m1 = _one_step(with_kl, batch)
    assert abs(float(m1["kl_ref"])) < 1e-9
    np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-6)
    chex.assert_trees_all_close(after1, after0, atol=1e-7, rtol=0)


def test_step_refuses_kl_without_reference_logprobs():
    _, with_kl = _configs("ppo_clip", "k3", "token_mean", 1, beta=0.1)
    graphdef, state = _state(0)
    batch = make_batch(0, make_logprob_fn(graphdef, with_kl), state.params)
    step = make_train_step(graphdef, SGD, with_kl)
    with pytest.raises(ValueError, match=r"ppo_clip.kl_coef=0.1 > 0 needs TrainBatch.ref_logp"):
        step(state, batch)


# ---- the reference the Trainer holds ----------------------------------------------------------
def _kl_algorithm(kl_coef: float = 0.05, **fields) -> AlgorithmConfig:
    return AlgorithmConfig(bapo=BAPOConfig(kl_coef=kl_coef, kl_estimator="k3"), **fields)


def _leaves(params):
    return [np.asarray(x) for x in jax.tree.leaves(params)]


def test_reference_is_a_sharded_copy_of_the_initial_weights():
    mesh = mesh_lib.make_mesh(mesh_lib.mesh_preset("cpu-fsdp4-tp2"), jax.devices()[:8])
    model = init_model(MODEL, seed=0)
    _, params = split_model(model)
    ref = reference_lib.build_reference_params(_kl_algorithm(), model, mesh=mesh)
    for got, want in zip(jax.tree.leaves(ref), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        buffers = [s.data.unsafe_buffer_pointer() for s in got.addressable_shards]
        assert not set(buffers) & {s.data.unsafe_buffer_pointer() for s in want.addressable_shards}
    shardings = jax.tree.leaves(state_shardings(params, mesh))
    assert [x.sharding for x in jax.tree.leaves(ref)] == shardings
    assert any(not s.is_fully_replicated for s in shardings)
    assert reference_lib.build_reference_params(_kl_algorithm(0.0), model, mesh=mesh) is None


def test_reference_from_an_hf_directory(tmp_path):
    other = init_model(MODEL, seed=1)
    save_pretrained(other, tmp_path / "ref")
    algo = _kl_algorithm(reference_hf_dir=str(tmp_path / "ref"))
    ref = reference_lib.build_reference_params(algo, init_model(MODEL, seed=0))
    for got, want in zip(_leaves(ref), _leaves(split_model(other)[1]), strict=True):
        np.testing.assert_array_equal(got, want)


def test_missing_or_mismatched_reference_is_refused(tmp_path):
    missing = str(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"algorithm.reference_hf_dir: .*nowhere' is not a dir"):
        make_trainer(small_config(algorithm=_kl_algorithm(reference_hf_dir=missing)), tmp_path)
    # kl_coef == 0: the reference is never read nor built.
    trainer = make_trainer(
        small_config(algorithm=_kl_algorithm(0.0, reference_hf_dir=missing)), tmp_path
    )
    assert trainer.reference_params is None
    tied = Qwen2Config.preset("tiny-tied")
    save_pretrained(init_model(tied, seed=0), tmp_path / "tied")
    algo = _kl_algorithm(reference_hf_dir=str(tmp_path / "tied"))
    with pytest.raises(ValueError, match=r"reference_hf_dir: .*differs.*tie_word_embeddings"):
        make_trainer(small_config(algorithm=algo), tmp_path)
    with pytest.raises(ValueError, match=r"a reference model was given but bapo.kl_coef = 0"):
        make_trainer(small_config(), tmp_path, reference=init_model(MODEL, seed=1))


def test_run_build_refuses_a_missing_reference_before_any_compute(tmp_path):
    def task(*_):
        raise AssertionError("the task was built before the reference was checked")

    trainer = small_config(algorithm=_kl_algorithm(reference_hf_dir=str(tmp_path / "nowhere")))
    config = RunConfig(trainer=trainer)
    match = r"^trainer.algorithm.reference_hf_dir: .*nowhere"
    with (
        pytest.raises(RunConfigError, match=match),
        build.build_trainer(config, str(tmp_path), task=task),
    ):
        pass
    build.check_reference(RunConfig(trainer=small_config()))  # kl_coef 0: nothing to check


# ---- end to end ---------------------------------------------------------------------------------
def _rows(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_trainer_with_kl_runs_and_reports_it(tmp_path):
    """Iteration 0 updates from the initial weights = the reference: KL 0 and the same update
    as without the penalty (k3 has no gradient there); iteration 1 starts away from it."""
    make_trainer(small_config(steps=2, algorithm=_kl_algorithm(0.05)), tmp_path / "kl").run()
    make_trainer(small_config(steps=1), tmp_path / "plain").run()
    kl_rows, plain = _rows(tmp_path / "kl"), _rows(tmp_path / "plain")
    assert [r["step"] for r in kl_rows] == [0, 1]
    assert abs(kl_rows[0]["kl_ref"]) < 1e-6
    assert "kl_ref" not in plain[0]
    for key in ("loss", "pg_loss", "grad_norm", "c_low", "c_high"):
        assert kl_rows[0][key] == pytest.approx(plain[0][key], rel=1e-5, abs=1e-7), key
    assert kl_rows[1]["kl_ref"] > 1e-9 and np.isfinite(kl_rows[1]["loss"])
    assert kl_rows[1]["loss"] == pytest.approx(
        kl_rows[1]["pg_loss"] + 0.05 * kl_rows[1]["kl_ref"], rel=1e-4, abs=1e-7
    )


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_resumed_kl_run_equals_uninterrupted(tmp_path):
    """The reference is not checkpointed: the resumed Trainer rebuilds it from the same initial
    model, so the resumed run ends where the uninterrupted one does."""
    config = small_config(steps=3, algorithm=_kl_algorithm(0.05))
    make_trainer(config, tmp_path / "whole").run()
    make_trainer(dataclasses.replace(config, steps=2), tmp_path / "resumed").run()
    resumed = make_trainer(config, tmp_path / "resumed")
    summary = resumed.run()
    assert summary["resumed_from"] == 2
    whole, part = _rows(tmp_path / "whole"), _rows(tmp_path / "resumed")
    timing = ("time/", "compile/", "tokens_per_s", "model_flops_per_s", "mfu", "overlap/")
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith(timing)}
    assert [strip(r) for r in part] == [strip(r) for r in whole]
    assert part[2]["kl_ref"] > 0
