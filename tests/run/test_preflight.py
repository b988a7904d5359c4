"""Before a run computes (`run.preflight`): the platform decision, the trainer's devices and
mesh, JAX's memory pool, the memory plan's refusal, and the CLI's errors in a real process.

The GPU paths (a CUDA backend, `jax_cuda_visible_devices`) cannot run on this CPU machine: the
decision is a pure function of what JAX and the machine report (`check_platform`), tested with
those reports as arguments; the GPU count comes from a fake /proc tree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import chex
import jax
import pytest

from bapo_jax.models.config import Qwen2Config
from bapo_jax.overrides import apply_overrides, config_from_dict, config_to_dict
from bapo_jax.run import preflight
from bapo_jax.run.build import model_options
from bapo_jax.run.config import ModelSection, RunConfig, RunConfigError
from bapo_jax.run.dry_run import stand_in
from bapo_jax.sharding import memory_plan
from bapo_jax.train.config import AlgorithmConfig, RolloutConfig, TrainerConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _platform(**kw) -> int:
    """`check_platform` for an 8-GPU node running one trainer process on a 4-device mesh."""
    args = dict(
        platform="gpu",
        local_devices=8,
        process_count=1,
        mesh="7b",
        mesh_devices=4,
        trainer_devices=4,
        gpus_restricted=False,
        machine_gpus=8,
        cpu=False,
        dry_run=False,
    )
    return preflight.check_platform(**(args | kw))


def test_training_on_cpu_on_a_machine_with_gpus_is_refused_unless_asked_for():
    with pytest.raises(RunConfigError, match=r"JAX_PLATFORMS: this machine has 8 GPU\(s\)"):
        _platform(platform="cpu")
    with pytest.raises(RunConfigError, match=r"pip install -e '\.\[gpu\]'"):
        _platform(platform="cpu", local_devices=1, trainer_devices=None, mesh_devices=1)
    # JAX_PLATFORMS=cpu on purpose, or a dry run (CPU by design), or no GPU on the machine.
    chex.assert_equal(_platform(platform="cpu", cpu=True), 4)
    chex.assert_equal(_platform(platform="cpu", dry_run=True), 4)
    chex.assert_equal(_platform(platform="cpu", machine_gpus=0), 4)


def test_a_mesh_needing_more_devices_than_the_platform_has_names_mesh_and_trainer_devices():
    with pytest.raises(RunConfigError, match=r"trainer_devices: 4 devices asked for, but the cpu"):
        _platform(platform="cpu", machine_gpus=0, local_devices=1)
    with pytest.raises(RunConfigError, match=r"trainer_devices: ids \[8\] do not exist"):
        _platform(trainer_devices=(5, 6, 7, 8))
    with pytest.raises(
        RunConfigError, match=r"--mesh / mesh: '32b' needs 16 devices, but the trainer has 8"
    ):
        _platform(mesh="32b", mesh_devices=16, trainer_devices=None)
    # All 8 GPUs visible, a 4-device mesh: give the rest to vLLM, or use a bigger mesh.
    with pytest.raises(RunConfigError, match=r"set trainer_devices=4 .* or a --mesh of 8"):
        _platform(trainer_devices=None)


def test_the_trainer_devices_that_make_up_the_mesh_pass():
    chex.assert_equal(_platform(), 4)
    chex.assert_equal(_platform(trainer_devices=(4, 5, 6, 7)), 4)
    chex.assert_equal(_platform(mesh_devices=8, trainer_devices=None), 8)
    # Two trainer nodes of 8 GPUs each make the 16-device 32b mesh.
    chex.assert_equal(
        _platform(mesh="32b", mesh_devices=16, trainer_devices=None, process_count=2), 8
    )
    # JAX restricted to the trainer's GPUs sees exactly them, renumbered from 0.
    chex.assert_equal(_platform(local_devices=4, gpus_restricted=True), 4)
    with pytest.raises(RunConfigError, match=r"asks for 4 GPU\(s\), but JAX sees 2"):
        _platform(local_devices=2, gpus_restricted=True)


def test_gpu_restriction_needs_gpus_and_refuses_ids_beyond_them():
    # What `restrict_gpus` would set is a CUDA-only effect; here only its decisions run.
    assert preflight.restrict_gpus(None, visible_gpus=8) is None  # all GPUs are the trainer's
    assert preflight.restrict_gpus(4, visible_gpus=0) is None  # no GPU: nothing to restrict
    with pytest.raises(RunConfigError, match=r"trainer_devices: GPU\(s\) \[8, 9\] do not exist"):
        preflight.restrict_gpus((6, 7, 8, 9), visible_gpus=8)
    chex.assert_equal(jax.config.read("jax_cuda_visible_devices"), "all")


def test_simulated_cpu_devices_only_for_a_dry_run_or_jax_platforms_cpu():
    count = preflight.simulated_device_count
    chex.assert_equal(count(4, 4, dry_run=False, cpu=False), 1)
    chex.assert_equal(count(16, None, dry_run=True, cpu=False), 16)
    chex.assert_equal(count(4, 4, dry_run=False, cpu=True), 4)
    chex.assert_equal(count(4, (4, 5, 6, 7), dry_run=True, cpu=False), 8)
    assert preflight.cpu_requested({"JAX_PLATFORMS": "cpu"})
    assert not preflight.cpu_requested({}) and not preflight.cpu_requested(
        {"JAX_PLATFORMS": "cuda"}
    )


def test_machine_gpu_count_reads_the_driver_and_cuda_visible_devices(tmp_path):
    chex.assert_equal(preflight.machine_gpu_count({}, root=str(tmp_path)), 0)
    gpus = tmp_path / "proc" / "driver" / "nvidia" / "gpus"
    for i in range(8):
        (gpus / f"0000:{i:02x}:00.0").mkdir(parents=True)
    chex.assert_equal(preflight.machine_gpu_count({}, root=str(tmp_path)), 8)
    env = {"CUDA_VISIBLE_DEVICES": "0,1,2"}
    chex.assert_equal(preflight.machine_gpu_count(env, root=str(tmp_path)), 3)
    chex.assert_equal(preflight.machine_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, str(tmp_path)), 0)
    dev = tmp_path / "other" / "dev"  # no /proc entry: the /dev/nvidiaN nodes
    dev.mkdir(parents=True)
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"):
        (dev / name).touch()
    chex.assert_equal(preflight.machine_gpu_count({}, root=str(tmp_path / "other")), 2)


def test_memory_fraction_is_the_plans_budget_unless_the_user_set_one():
    env: dict[str, str] = {}
    fraction = preflight.set_memory_fraction(env)
    chex.assert_equal(fraction, memory_plan.FIT_FRACTION)
    chex.assert_equal(env["XLA_PYTHON_CLIENT_MEM_FRACTION"], "0.85")
    chex.assert_equal(preflight.set_memory_fraction({"XLA_CLIENT_MEM_FRACTION": "0.7"}), 0.7)
    with pytest.raises(RunConfigError, match=r"XLA_PYTHON_CLIENT_MEM_FRACTION must be in"):
        preflight.set_memory_fraction({"XLA_PYTHON_CLIENT_MEM_FRACTION": "1.5"})


def test_run_config_keys_parse_from_the_command_line():
    config = apply_overrides(
        RunConfig(),
        [
            "mesh=data=1,fsdp=4,tensor=2",
            "trainer_devices=0,1,2,3",
            "accelerator=h200",
            "model.attention=blockwise",
            "model.remat=dots_saveable",
            "model.scan_unroll=2",
        ],
    )
    chex.assert_equal(config.trainer_devices, (0, 1, 2, 3))
    chex.assert_equal(config.mesh_config().shape, (1, 4, 2))
    chex.assert_equal(config.mesh_config().device_memory_bytes, 141 * 10**9)
    chex.assert_equal((config.model.attention, config.model.remat), ("blockwise", "dots_saveable"))
    chex.assert_equal(model_options(config).scan_unroll, 2)
    four = RunConfig(mesh="fsdp=4")
    chex.assert_equal(apply_overrides(four, ["trainer_devices=4"]).trainer_devices, 4)
    chex.assert_equal(apply_overrides(RunConfig(), ["trainer_devices=[5]"]).trainer_devices, (5,))
    chex.assert_equal(apply_overrides(RunConfig(), ["model.remat=false"]).model.remat, "none")
    again = config_from_dict(RunConfig, config_to_dict(config))
    chex.assert_equal(again, config)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["mesh=data=1,fsdp=x"], r"mesh: mesh axis fsdp must be an int, got 'x'"),
        (["mesh=fsdp=4,memory_gb=40"], r"mesh: .*takes its device memory from accelerator="),
        (["accelerator=v100"], r"accelerator: one of .*'h100'.*got 'v100'"),
        (["mesh=fsdp=4", "trainer_devices=3"], r"trainer_devices: 3 devices per trainer process"),
        (["trainer_devices=1,1"], r"trainer_devices: repeats a device"),
        (["model.attention=flash"], r"model\.attention"),
        (["model.remat=most"], r"model\.remat"),
        (["model.scan_unroll=0"], r"model: scan_unroll must be an int >= 1, got 0"),
    ],
)
def test_bad_device_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides(RunConfig(), overrides)


def test_trainer_mesh_is_built_from_the_trainer_devices():
    devices = jax.devices()
    chex.assert_equal(len(devices), 8)  # conftest: 8 simulated CPU devices
    assert preflight.trainer_mesh(RunConfig()) is None  # cpu1: the unsharded path
    mesh = preflight.trainer_mesh(RunConfig(mesh="data=1,fsdp=4,tensor=1", trainer_devices=4))
    chex.assert_equal(list(mesh.devices.flat), devices[:4])
    mesh = preflight.trainer_mesh(
        RunConfig(mesh="data=1,fsdp=2,tensor=2", trainer_devices=(4, 5, 6, 7))
    )
    chex.assert_equal(list(mesh.devices.flat), devices[4:])
    chex.assert_equal(dict(mesh.shape), {"data": 1, "fsdp": 2, "tensor": 2})
    with pytest.raises(RunConfigError, match=r"--mesh / trainer_devices: .*needs 4 devices"):
        preflight.trainer_mesh(RunConfig(mesh="fsdp=4", trainer_devices=(0, 1)))


def _tiny_run(**kw) -> RunConfig:
    trainer = TrainerConfig(
        rollout=RolloutConfig(
            prompts_per_step=2, samples_per_prompt=4, max_prompt_tokens=32, max_response_tokens=32
        ),
        algorithm=AlgorithmConfig(micro_batches=2),
    )
    model = ModelSection(preset="tiny", compute_dtype="float32", attention="blockwise")
    return RunConfig(trainer=trainer, model=model, mesh="data=1,fsdp=2,tensor=2", **kw)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_the_memory_plan_check_passes_a_fitting_step_and_refuses_one_naming_its_buffers():
    config = _tiny_run()
    devices = jax.devices()[:4]
    report = preflight.check_memory_plan(config, devices, memory_plan.FIT_FRACTION)
    chex.assert_equal(report["seq_len"], 64)
    assert 0 < report["peak_bytes_per_device"] < report["budget_bytes"] == 68 * 10**9
    # The same step against a budget of a few bytes: refused, with the numbers and buffers.
    with pytest.raises(RunConfigError) as refused:
        preflight.check_memory_plan(config, devices, 1e-9)
    message = str(refused.value)
    assert message.startswith("mesh: the train step of tiny on mesh 'data=1,fsdp=2,tensor=2'")
    assert "largest per-device arrays:" in message and " GB  f32[" in message
    assert "--skip-plan" in message and "model.attention=blockwise" in message
    skipped = preflight.check_memory_plan(_tiny_run(skip_plan=True), devices, 1e-9)
    chex.assert_equal(skipped, {"skipped": "skip_plan"})


def _cli(*args: str, **env_changes: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.pop("JAX_PLATFORMS", None)
    env.update(env_changes)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_the_cli_stops_before_compute_when_the_mesh_needs_more_devices(tmp_path):
    # No JAX_PLATFORMS: the real platform (CPU here, 1 device), no simulated devices.
    out = str(tmp_path / "run")
    proc = _cli("-m", "experiments.aime_7b", "--out-dir", out, "engine.kind=embedded")
    chex.assert_equal(proc.returncode, 2)
    assert "error: trainer_devices: 8 devices asked for, but the cpu platform has 1" in (
        proc.stderr
    ), proc.stderr[-3000:]
    # JAX_PLATFORMS=cpu simulates the trainer's 8 devices; a 16-device mesh does not fit them.
    proc = _cli(
        "-m", "experiments.aime_7b", "--out-dir", out, "--mesh", "data=1,fsdp=8,tensor=2",
        "engine.kind=embedded", JAX_PLATFORMS="cpu",
    )  # fmt: skip
    chex.assert_equal(proc.returncode, 2)
    assert "error: --mesh / mesh: 'data=1,fsdp=8,tensor=2' needs 16 devices, but the trainer " in (
        proc.stderr
    ), proc.stderr[-3000:]
    assert not os.path.exists(os.path.join(out, "checkpoints"))


def test_importing_the_cli_does_not_start_the_jax_backend():
    """The memory fraction and the GPU restriction are set in-process after these imports, so
    the imports must leave the backend unstarted."""
    code = (
        "import bapo_jax.run.cli, bapo_jax.run.preflight, experiments.aime_7b\n"
        "from jax._src import xla_bridge\n"
        "assert not xla_bridge._backends, xla_bridge._backends\n"
    )
    proc = _cli("-c", code, JAX_PLATFORMS="cpu")
    chex.assert_equal(proc.returncode, 0)


def test_the_dry_runs_stand_in_keeps_the_runs_model_options(tmp_path):
    run = apply_overrides(
        RunConfig(), ["model.remat=dots_saveable", "model.scan_unroll=4", "model.attention=plain"]
    )
    model = stand_in(run, str(tmp_path)).model
    chex.assert_equal(
        (model.preset, model.remat, model.scan_unroll), ("tiny-tied", "dots_saveable", 4)
    )


def test_rows_longer_than_the_models_context_are_refused_while_validating(tmp_path):
    """Qwen2.5-Math-7B's config (4,096 positions) with aime_7b's 1,024 + 8,192-token rows:
    the CLI refuses it naming both numbers, exit 2, before the memory plan's compile or any
    model load (the directory holds a config.json and no weights)."""
    model = tmp_path / "qwen2.5-math-7b"
    model.mkdir()
    hf = Qwen2Config.preset("qwen2.5-7b").replace(max_position_embeddings=4096).to_hf_dict()
    (model / "config.json").write_text(json.dumps(hf))
    out = str(tmp_path / "run")
    proc = _cli(
        "-m", "experiments.aime_7b", "--dry-run", "--model-dir", str(model), "--out-dir", out
    )
    chex.assert_equal(proc.returncode, 2)
    assert (
        "error: trainer.rollout.max_response_tokens: a row of 1024 prompt + 8192 response tokens "
        "= 9216 is longer than the model's context, max_position_embeddings 4096"
    ) in proc.stderr, proc.stderr[-3000:]
    assert "compiled" not in proc.stdout and not os.path.exists(out)
    proc = _cli(
        "-m", "experiments.aime_7b", "--dry-run", "--model-dir", str(model), "--out-dir", out,
        "trainer.rollout.max_response_tokens=3072",
    )  # fmt: skip
    chex.assert_equal(proc.returncode, 2)
    assert "error: eval.max_tokens: 1024 prompt + 8192 eval tokens = 9216" in proc.stderr


@pytest.mark.slow  # a CLI start up to the device check: in `make test-slow` (CI runs it)
def test_a_slurm_job_started_without_srun_runs_single_process_and_says_so(tmp_path):
    """The batch script of a 4-task SLURM job starting the trainer directly: no srun step of
    several tasks, so no jax.distributed start (which would wait for 3 peers that never come);
    the run prints why and goes on single-process (here to the device check's refusal, before
    any compile)."""
    out = str(tmp_path / "run")
    proc = _cli(
        "-m", "experiments.aime_7b", "--out-dir", out, "engine.kind=embedded",
        SLURM_JOB_ID="7", SLURM_NTASKS="4",
    )  # fmt: skip
    chex.assert_equal(proc.returncode, 2)
    assert "multi-process: SLURM job of 4 tasks, but this process is not in an srun step" in (
        proc.stdout
    ), proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "error: trainer_devices: 8 devices asked for" in proc.stderr
