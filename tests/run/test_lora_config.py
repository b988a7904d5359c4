"""LoRA in a run's config (`model.lora_*`): the model options it gives, what it refuses, and a
PEFT adapter as the starting point of the policy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from bapo_jax.models import lora as lora_lib
from bapo_jax.models.config import LORA_TARGETS, LoRAConfig
from bapo_jax.overrides import apply_overrides
from bapo_jax.run.build import build_policy, model_options
from bapo_jax.run.config import RunConfig, RunConfigError, validate_run


def test_lora_keys_give_the_model_its_adapters():
    config = apply_overrides(RunConfig(), ["model.lora_rank=4", "model.lora_alpha=8"])
    assert model_options(config).lora == LoRAConfig(4, 8.0, LORA_TARGETS)
    assert model_options(RunConfig()).lora is None  # 0: full fine-tuning
    mlp = apply_overrides(config, ['model.lora_targets=["down_proj","gate_proj"]'])
    assert model_options(mlp).lora.targets == ("gate_proj", "down_proj")


@pytest.mark.parametrize(
    "override, message",
    [
        ("model.lora_rank=-1", "lora_rank must be an int >= 0, got -1"),
        ('model.lora_targets=["qkv"]', "lora: LoRAConfig.targets"),
        ("model.lora_alpha=0", "lora: LoRAConfig.alpha"),
    ],
)
def test_bad_lora_keys_are_refused(override, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(RunConfig(), ["model.lora_rank=4", override])


def test_lora_on_vllm_syncs_adapters_and_refuses_in_flight_updates(tmp_path):
    """A LoRA run on vLLM: its launched servers serve adapters up to the run's rank (vLLM's
    next allowed --max-lora-rank, runtime loading on); in-flight updates are refused before
    compute (a request's adapter is fixed when it starts)."""
    from bapo_jax.rollout import serve
    from bapo_jax.run.build import server_spec

    base = ["model.lora_rank=4", "engine.kind=vllm", "engine.vllm_urls=[http://h:1]"]
    config = apply_overrides(RunConfig(), base)
    validate_run(config, check_servers=False)
    spec = server_spec(apply_overrides(config, [f"model.hf_dir={tmp_path}"]))
    argv, env = serve.build_command(spec)
    flags = argv[argv.index("--enable-lora") :][:5]
    assert flags == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "1"]
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    inflight = apply_overrides(config, ["trainer.offpolicy.inflight=true"])
    with pytest.raises(RunConfigError, match=r"^trainer.offpolicy.inflight: a LoRA run's requests"):
        validate_run(inflight, check_servers=False)
    with pytest.raises(ValueError, match=r"max_lora_rank must be one of"):
        apply_overrides(config, ["engine.server.max_lora_rank=4"])


def test_a_peft_adapter_starts_the_policy(tmp_path):
    base = RunConfig()
    arch = base.model.architecture()
    lora = LoRAConfig(rank=2, alpha=4.0, targets=("q_proj", "up_proj"))
    adapters = lora_lib.initial_adapters(arch, lora, seed=3)
    rng = np.random.default_rng(0)
    adapters = {k: rng.normal(size=v.shape).astype(np.float32) for k, v in adapters.items()}
    lora_lib.save_peft(tmp_path / "adapter", adapters, lora)
    config = apply_overrides(base, [f"model.lora_adapter={tmp_path / 'adapter'}"])
    validate_run(config, check_servers=False)
    assert model_options(config).lora == lora
    model = build_policy(config, None, None, seed=0)
    got = model.layers.adapters(jnp.float32)
    for name, array in adapters.items():
        np.testing.assert_array_equal(np.asarray(got[name]), array)
    with pytest.raises(RunConfigError, match="has rank 2"):
        apply_overrides(config, ["model.lora_rank=8"]).model.lora()
    missing = apply_overrides(base, [f"model.lora_adapter={tmp_path}"])
    with pytest.raises(RunConfigError, match=r"has no adapter_config\.json"):
        validate_run(missing, check_servers=False)
