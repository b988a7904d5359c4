"""Where a run's launched vLLM servers run and with what: the aime_7b default on one 8-GPU
node (trainer on all 8 GPUs, two servers x TP 4 colocated on them), asserted literally from
`serve.build_command` (no process: a CUDA-only layout cannot run here), and the command-line
flags that change it."""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest

from bapo_jax.models.config import Qwen2Config
from bapo_jax.overrides import apply_overrides
from bapo_jax.rollout import serve
from bapo_jax.rollout.serve import ServerSettings
from bapo_jax.run import build
from bapo_jax.run.cli import build_parser, resolve
from bapo_jax.run.config import EngineSection, RunConfigError, validate_run
from bapo_jax.run.estimate import requests_per_server
from experiments import aime_7b

VLLM_PYTHON = "/opt/vllm-env/bin/python"
_OURS = ("CUDA_VISIBLE_DEVICES", "VLLM_SERVER_DEV_MODE", "VLLM_CPU_KVCACHE_SPACE", "JAX_PLATFORMS")


@pytest.fixture
def clean_env(monkeypatch):
    for name in (*_OURS, "VLLM_CPU_OMP_THREADS_BIND", serve.VLLM_PYTHON_ENV):
        monkeypatch.delenv(name, raising=False)


def _aime(tmp_path, *argv: str):
    hf = tmp_path / "R1-Distill-Qwen-7B"
    hf.mkdir(exist_ok=True)
    args = build_parser("aime_7b").parse_intermixed_args(
        ["--model-dir", str(hf), "--vllm-python", VLLM_PYTHON, *argv]
    )
    return resolve(aime_7b.CONFIG, args), str(hf)


def _set_by_us(env: dict[str, str]) -> dict[str, str]:
    return {k: env[k] for k in _OURS if k in env}


def test_the_default_aime_7b_layout_is_two_tp4_servers_on_the_trainers_gpus(tmp_path, clean_env):
    config, hf = _aime(tmp_path)
    e = config.engine
    assert (e.launch_servers, e.server.devices, e.server.tensor_parallel_size, e.colocate) == (
        2, ("0,1,2,3", "4,5,6,7"), 4, True,
    )  # fmt: skip
    assert config.trainer_devices == 8 and config.mesh_config().fsdp == 8
    spec = build.server_spec(config)
    assert spec.server.python == VLLM_PYTHON  # engine.server.python: every launch path's key
    for i, gpus in enumerate(("0,1,2,3", "4,5,6,7")):
        argv, env = serve.build_command(spec, i)
        assert argv == [
            VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server",
            "--model", hf,
            "--served-model-name", hf,
            "--host", "127.0.0.1",
            "--port", str(8000 + i),
            "--dtype", "bfloat16",
            "--max-model-len", "9216",  # 1,024 prompt + 8,192 response tokens
            "--tensor-parallel-size", "4",
            "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm",
            "--worker-extension-cls", "bapo_jax.rollout.vllm_worker.BapoWorkerExtension",
            "--enable-scale-out",
            "--gpu-memory-utilization", "0.4",
            "--skip-tokenizer-init",
        ]  # fmt: skip
        assert _set_by_us(env) == {
            "CUDA_VISIBLE_DEVICES": gpus,
            "VLLM_SERVER_DEV_MODE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",  # CPU builds only; vLLM on GPUs ignores it
            "JAX_PLATFORMS": "cpu",  # the worker's JAX never takes the server's GPU
        }
        assert "VLLM_CPU_OMP_THREADS_BIND" not in env
    client = (e.requests_per_server, e.request_timeout_s)
    assert client == (None, 1800.0)
    # derived: the KV room of 4 H100s at 0.4 for the 7B (4 x 32 GB - 15.2 GB of weights: 564
    # sequences at the mean resident context), in prompts of 16 (run.estimate)
    assert requests_per_server(config, Qwen2Config.preset("r1-distill-qwen-7b")) == 36


def test_server_devices_flag_makes_two_tensor_parallel_servers(tmp_path, clean_env):
    config, hf = _aime(
        tmp_path, "--server-devices", "4,5;6,7", "--gpu-memory-utilization", "0.85",
        "--served-model-name", "policy", "--request-timeout", "900", "--requests-per-server", "8",
    )  # fmt: skip
    e = config.engine
    assert (e.launch_servers, e.server.devices, e.server.tensor_parallel_size) == (
        2,
        ("4,5", "6,7"),
        2,
    )
    assert (e.request_timeout_s, e.requests_per_server) == (900.0, 8)
    spec = build.server_spec(config)
    commands = [serve.build_command(spec, i) for i in range(2)]
    for i, (argv, env) in enumerate(commands):
        flags = {argv[j]: argv[j + 1] for j in range(3, len(argv) - 1) if argv[j].startswith("--")}
        assert flags["--served-model-name"] == "policy" and flags["--model"] == hf
        assert flags["--tensor-parallel-size"] == "2"
        assert flags["--gpu-memory-utilization"] == "0.85"
        assert flags["--max-model-len"] == "9216" and flags["--port"] == str(8000 + i)
        assert env["CUDA_VISIBLE_DEVICES"] == ("4,5", "6,7")[i]


def test_given_urls_replace_the_launched_servers(tmp_path):
    config, _ = _aime(tmp_path, "--vllm-url", "http://gpu-node-1:8000")
    e = config.engine
    assert (e.vllm_urls, e.launch_servers, e.server.devices) == (
        ("http://gpu-node-1:8000",), 0, (),
    )  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--server-devices", "4,5;6,7", "--tensor-parallel-size", "1"],
            "engine.server: devices must be tensor_parallel_size=1 GPUs per server, got '4,5'",
        ),
        (
            ["--server-devices", "4;4"],
            "engine.server: devices must be GPUs no two servers share (GPU 4: servers 0 and 1), "
            "got ('4', '4')",
        ),
        (
            ["--server-devices", "4-7"],
            "engine.server: devices: GPU list '4-7': want distinct GPU indices like '4' or '4,5'",
        ),
        (
            ["--gpu-memory-utilization", "1.5"],
            "engine.server: gpu_memory_utilization must be a share in (0, 1] (or None), got 1.5",
        ),
        (
            ["engine.server.args=--max-model-len,4096"],
            "engine.server: args must be free of --max-model-len (set by the spec's "
            "max_model_len, a run's prompt + response caps), got ('--max-model-len', '4096')",
        ),
        (
            ["engine.server.args=--gpu-memory-utilization=0.5"],
            "engine.server: args must be free of --gpu-memory-utilization (set by "
            "gpu_memory_utilization), got ('--gpu-memory-utilization=0.5',)",
        ),
    ],
)
def test_bad_server_settings_are_refused_naming_the_key(tmp_path, argv, message):
    with pytest.raises(ValueError) as error:
        _aime(tmp_path, *argv)
    assert str(error.value) == message


def test_server_devices_name_one_list_per_launched_server():
    with pytest.raises(ValueError, match=r"server.devices: one entry per launched server \(3\)"):
        EngineSection(kind="vllm", launch_servers=3, server=ServerSettings(devices=("4", "5")))
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an int >= 1, got 0"):
        ServerSettings(tensor_parallel_size=0)


def test_servers_on_the_trainers_gpus_are_refused_before_compute(tmp_path):
    hf = tmp_path / "R1-Distill-Qwen-7B"
    hf.mkdir()
    (hf / "config.json").write_text(
        json.dumps(Qwen2Config.preset("r1-distill-qwen-7b").to_hf_dict())
    )
    separate = ("--mesh", "7b", "engine.colocate=false", "--gpu-memory-utilization", "0.9")
    config, _ = _aime(tmp_path, *separate, "--trainer-devices", "4", "--server-devices", "3;4;5;6")
    config = apply_overrides(config, [f"engine.server.python={sys.executable}"])
    with pytest.raises(RunConfigError) as error:
        validate_run(config, check_servers=False)
    assert str(error.value) == (
        "engine.server.devices: server 0's GPUs [3] are the trainer's too (trainer_devices=4); "
        "give the servers other GPUs, or colocate them (engine.colocate=true)"
    )
    every_gpu = dataclasses.replace(config, trainer_devices=None)
    with pytest.raises(RunConfigError, match=r"trainer_devices: None \(every local GPU\) leaves"):
        validate_run(every_gpu, check_servers=False)
    ok, _ = _aime(
        tmp_path, *separate, "--trainer-devices", "0,1,2,3", "--server-devices", "4;5;6;7"
    )
    ok = apply_overrides(ok, [f"engine.server.python={sys.executable}"])
    assert validate_run(ok, check_servers=False).num_hidden_layers == 28


def test_server_gpus_are_indices_among_the_launchers_visible_gpus(tmp_path, clean_env, monkeypatch):
    """As trainer_devices: a launcher given GPUs 8-15 (e.g. by a scheduler) puts server 1 of
    the default layout on its GPUs 4-7, physical GPUs 12-15."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "8,9,10,11,12,13,14,15")
    config, _ = _aime(tmp_path)
    spec = build.server_spec(config)
    assert [serve.build_command(spec, i)[1]["CUDA_VISIBLE_DEVICES"] for i in range(2)] == [
        "8,9,10,11", "12,13,14,15",
    ]  # fmt: skip
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5")
    with pytest.raises(ValueError, match=r"devices '4,5,6,7': the launcher sees only 6 GPUs"):
        serve.build_command(spec, 1)
