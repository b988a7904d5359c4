"""The memory plan counts the KL reference's params (kl_coef > 0 only)."""

import jax
import pytest

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.models import Qwen2Config
from bapo_jax.sharding import memory_plan, plan
from bapo_jax.sharding import mesh as mesh_lib
from bapo_jax.train import optim
from bapo_jax.train.state import abstract_train_state, state_shardings
from bapo_jax.train.step import StepConfig

pytestmark = pytest.mark.slow  # long: in `make test-slow` (CI runs it)


def test_reference_bytes_are_the_sharded_params_when_kl_is_on():
    config = Qwen2Config.preset("tiny")
    mesh_config = plan.parse_mesh("fsdp=2")
    optimizer = optim.make_optimizer(optim.OptimizerConfig())
    plans = {
        kl: memory_plan.plan_memory(
            config,
            mesh_config,
            seq_len=16,
            step_config=StepConfig(loss_config=BAPOConfig(kl_coef=kl)),
            optimizer=optimizer,
        )
        for kl in (0.0, 0.1)
    }
    assert plans[0.0].reference_bytes == 0
    # The policy's params, split like them over the 2 fsdp devices: about half of them each.
    _, abstract = abstract_train_state(config, optimizer)
    mesh = mesh_lib.make_mesh(mesh_config, jax.devices()[:2])
    params = memory_plan._with_shardings(abstract.params, state_shardings(abstract.params, mesh))
    want = memory_plan._per_device_bytes(params)
    assert plans[0.1].reference_bytes == want > 0
    full = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(abstract.params))
    assert full / 2 <= want < full
    # The KL step also reads ref_logp: one more [B, T] float32 input per device.
    assert plans[0.1].batch_bytes == plans[0.0].batch_bytes * 6 // 5
