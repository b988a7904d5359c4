"""RunConfig validation: every impossible setting fails before compute, naming the key."""

from __future__ import annotations

import dataclasses

import pytest

from bapo_jax.rollout.serve import ServerSettings
from bapo_jax.run.config import (
    DataSection,
    EngineSection,
    ModelSection,
    RunConfig,
    RunConfigError,
    validate_run,
)
from bapo_jax.train.config import AlgorithmConfig, OffPolicyConfig, RolloutConfig, TrainerConfig


def _config(**kw) -> RunConfig:
    trainer = TrainerConfig(rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=4))
    return dataclasses.replace(RunConfig(trainer=trainer, model=ModelSection(preset="tiny")), **kw)


def test_a_valid_config_returns_the_architecture():
    assert validate_run(_config()).num_attention_heads == 4


def test_missing_model_dir_is_named(tmp_path):
    with pytest.raises(RunConfigError, match=r"model.hf_dir: .*nope.* is not a directory"):
        validate_run(_config(model=ModelSection(hf_dir=str(tmp_path / "nope"))))
    with pytest.raises(RunConfigError, match=r"has no config\.json"):
        validate_run(_config(model=ModelSection(hf_dir=str(tmp_path))))


def test_tensor_axis_that_does_not_divide_the_heads_is_refused():
    # tiny: 4 query / 2 KV heads; the 32b mesh splits heads over tensor=4.
    with pytest.raises(
        RunConfigError, match=r"mesh: .*tensor=4 does not divide .*key_value_heads=2"
    ):
        validate_run(_config(mesh="32b"))


def test_rows_that_do_not_split_over_the_mesh_are_refused():
    # 2 prompts x 4 samples = 8 rows, 4 micro-batches -> 2 rows over 8 fsdp devices.
    trainer = TrainerConfig(
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=4),
        algorithm=AlgorithmConfig(micro_batches=4),
    )
    with pytest.raises(RunConfigError, match=r"trainer.algorithm.micro_batches: 2 rows"):
        validate_run(_config(trainer=trainer, mesh="cpu-fsdp8"))


def test_unknown_data_and_unreachable_server_are_named(tmp_path):
    with pytest.raises(RunConfigError, match=r"data\.train"):
        validate_run(_config(data=DataSection(train=str(tmp_path / "missing.jsonl"))))
    engine = EngineSection(kind="vllm", vllm_urls=("http://127.0.0.1:9",))
    with pytest.raises(RunConfigError, match=r"engine.vllm_urls: http://127.0.0.1:9 does not"):
        validate_run(_config(engine=engine))
    with pytest.raises(RunConfigError, match=r"engine\.vllm_urls: give server URLs"):
        validate_run(_config(engine=EngineSection(kind="vllm")))


def test_inflight_updates_need_a_vllm_engine():
    trainer = TrainerConfig(
        rollout=RolloutConfig(prompts_per_step=2, samples_per_prompt=4),
        offpolicy=OffPolicyConfig(staleness=1, inflight=True),
    )
    with pytest.raises(
        RunConfigError, match=r"trainer\.offpolicy\.inflight: .*need engine\.kind=vllm, got"
    ):
        validate_run(_config(trainer=trainer))
    validate_run(_config(trainer=trainer), check_engine=False)  # a dry run's embedded stand-in


def test_section_fields_are_checked_where_they_are_born():
    with pytest.raises(RunConfigError, match="preset"):
        ModelSection(preset="qwen9")
    with pytest.raises(RunConfigError, match="mesh"):
        RunConfig(mesh="64b")
    with pytest.raises(RunConfigError, match=r"server.cpu_cores: one entry per launched server"):
        EngineSection(kind="vllm", launch_servers=2, server=ServerSettings(cpu_cores=("1",)))
    with pytest.raises(RunConfigError, match=r"sync_attempts: >= 1"):
        EngineSection(sync_attempts=0)
    with pytest.raises(RunConfigError, match=r"cpu_kernels: a bool, got 'no'"):
        EngineSection(cpu_kernels="no")


def test_launching_without_a_vllm_interpreter_names_the_key(tmp_path, monkeypatch):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    missing = str(tmp_path / "venv" / "bin" / "python")
    engine = EngineSection(kind="vllm", launch_servers=1, server=ServerSettings(python=missing))
    model = ModelSection(hf_dir=str(hf))
    with pytest.raises(RunConfigError, match=r"engine\.server\.python: no vLLM interpreter at"):
        validate_run(
            _config(engine=engine, model=model), architecture=_config().model.architecture()
        )
    monkeypatch.setenv("BAPO_VLLM_PYTHON", missing)  # the environment is the next fallback
    engine = dataclasses.replace(engine, server=ServerSettings())
    with pytest.raises(RunConfigError, match=r"engine\.server\.python: .*venv/bin/python"):
        validate_run(
            _config(engine=engine, model=model), architecture=_config().model.architecture()
        )


def test_directory_modes_are_octal_digits_named_by_their_key():
    from bapo_jax.train.config import CheckpointConfig

    assert EngineSection().sync_dir_mode == CheckpointConfig().dir_mode == "700"  # owner-only
    with pytest.raises(
        RunConfigError,
        match=r'sync_dir_mode must be permissions in octal digits, e\.g\. "700", got \'799\'',
    ):
        EngineSection(sync_dir_mode="799")
    with pytest.raises(ValueError, match=r"dir_mode must be permissions in octal digits.*got 448"):
        CheckpointConfig(dir_mode=448)
    assert CheckpointConfig(dir_mode="750").dir_mode == "750"
