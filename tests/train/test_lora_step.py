"""The train step with LoRA adapters: only the adapters train (the optimizer's state covers
them alone), the base stays bit-identical, and the first update is AdamW's by hand."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.models import ModelOptions
from bapo_jax.models.config import LoRAConfig
from bapo_jax.models.lora import LoRAParam
from bapo_jax.train import optim
from bapo_jax.train import state as state_lib
from bapo_jax.train.state import init_train_state
from bapo_jax.train.step import StepConfig, make_logprob_fn, make_train_step
from tests.train.test_step import CONFIG, OPT, make_batch

LORA = LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "v_proj", "down_proj"))


@pytest.fixture(scope="module")
def trained():
    optimizer = optim.make_optimizer(OPT)
    graphdef, state = init_train_state(CONFIG, optimizer, options=ModelOptions(lora=LORA), seed=0)
    start = jax.device_get(state.params)
    config = StepConfig(loss="bapo", loss_config=BAPOConfig(rho0=0.6), num_micro_batches=2)
    logp_fn = make_logprob_fn(graphdef, config)
    step = make_train_step(graphdef, optimizer, config)
    history = []
    for i in range(3):
        state, metrics = step(state, make_batch(i, logp_fn, state.params))
        history.append(jax.device_get(metrics))
        if i == 0:
            first = jax.device_get(state.params)
    return start, first, jax.device_get(state), history


def _parts(params):
    trainable, frozen = state_lib.split_trainable(params)
    return nnx.to_pure_dict(trainable), nnx.to_pure_dict(frozen)


def test_only_the_adapters_train(trained):
    start, _, state, history = trained
    adapters0, base0 = _parts(start)
    adapters, base = _parts(state.params)
    assert set(adapters["layers"]) == {f"{t}_lora_{w}" for t in LORA.targets for w in "ab"}
    jax.tree.map(np.testing.assert_array_equal, base, base0)  # bit-identical
    moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), adapters, adapters0)
    assert all(jax.tree.leaves(moved))
    # AdamW's moments cover the adapters alone
    moments = [x for x in jax.tree.leaves(state.opt_state) if getattr(x, "ndim", 0) >= 2]
    assert len(moments) == 2 * 2 * len(LORA.targets)  # mu and nu of each A and B
    assert all(np.isfinite(m["loss"]) for m in history)


def test_the_first_update_is_adamws_by_hand(trained):
    """B starts at 0, so dA = 0 and dB != 0 at step 0: Adam's bias-corrected first step is
    -lr g / (|g| + eps), and decoupled decay moves A only: A (1 - lr wd)."""
    start, first, _, _ = trained
    lr = OPT.learning_rate / OPT.warmup_steps  # the warm-up's first step
    adapters0, _ = _parts(start)
    adapters1, _ = _parts(first)
    for target in LORA.targets:
        a0, a1 = adapters0["layers"][f"{target}_lora_a"], adapters1["layers"][f"{target}_lora_a"]
        np.testing.assert_allclose(a1, a0 * (1 - lr * OPT.weight_decay), rtol=1e-6)
        b1 = np.abs(adapters1["layers"][f"{target}_lora_b"])
        assert np.all(adapters0["layers"][f"{target}_lora_b"] == 0)
        # |B| = lr |g| / (|g| + eps): at most lr, lr itself where |g| >> Adam's eps 1e-8
        assert np.all(b1 <= lr * (1 + 1e-6))
        assert np.mean(np.abs(b1 - lr) < 1e-3 * lr) > 0.8


def test_a_model_without_adapters_trains_every_param():
    optimizer = optim.make_optimizer(OPT)
    _, state = init_train_state(CONFIG, optimizer, seed=0)
    trainable, frozen = state_lib.split_trainable(state.params)
    assert frozen is None and trainable is state.params
    assert not any(
        isinstance(v, LoRAParam)
        for v in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
    )


@pytest.mark.slow  # a mesh's compiles: in `make test-slow` (CI runs it)
def test_lora_on_a_mesh_equals_single_device():
    """The adapters' shardings derive from their matrices' logical axes (the rank replicated):
    on the data x fsdp x tensor mesh, B of q_proj splits its heads over `tensor` as q_proj
    does, and three LoRA updates equal the single-device ones."""
    from bapo_jax.sharding import mesh as mesh_lib
    from tests.train.test_step import assert_params_close, run_steps

    options = ModelOptions(lora=LORA)
    cfg = mesh_lib.mesh_preset("cpu-dp2-fsdp2-tp2")
    mesh = mesh_lib.make_mesh(cfg, jax.devices()[: cfg.num_devices])
    _, state = init_train_state(
        CONFIG, optim.make_optimizer(OPT), options=options, seed=0, mesh=mesh
    )
    layers = state.params["layers"]
    base, adapter = layers["q_proj"].get_value(), layers["q_proj_lora_b"].get_value()
    assert "tensor" in jax.tree.leaves(tuple(base.sharding.spec))
    assert adapter.sharding.spec[-2] == base.sharding.spec[-2]  # the heads axis, both
    assert adapter.sharding.spec[1] is None  # the rank: replicated
    config = StepConfig(loss="bapo", loss_config=BAPOConfig(rho0=0.6))
    ref_params, ref = run_steps(config, None, options=options)
    params, history = run_steps(config, "cpu-dp2-fsdp2-tp2", options=options)
    for a, b in zip(ref, history, strict=True):
        assert float(a["c_low"]) == float(b["c_low"]) and float(a["c_high"]) == float(b["c_high"])
        np.testing.assert_allclose(b["loss"], a["loss"], rtol=1e-4, atol=1e-5)
    assert_params_close(params, ref_params)
