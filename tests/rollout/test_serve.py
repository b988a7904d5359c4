"""The launcher: the flags RL needs, loopback by default, per-server devices and CPU cores, the
vLLM interpreter's resolution, and the record that lets a resumed run stop orphaned servers."""

from __future__ import annotations

import json
import os
import signal
import sys

import pytest

from bapo_jax.malloc import MALLOC_TUNABLES
from bapo_jax.rollout import serve

from .test_vllm_faults import STUB_SERVER, _free_ports

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _spec(model, **settings) -> serve.ServerSpec:
    return serve.ServerSpec(str(model), 4096, serve.ServerSettings(**settings))


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_build_command_has_the_rl_flags(tmp_path):
    spec = _spec(tmp_path, port=9000, devices=("0,1", "2,3"), tensor_parallel_size=2)
    argv, env = serve.build_command(spec, 1)
    assert _flag(argv, "--tensor-parallel-size") == "2"
    assert "--gpu-memory-utilization" not in argv  # vLLM's default unless given
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--port") == "9001" and _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert _flag(argv, "--generation-config") == "vllm"
    assert _flag(argv, "--worker-extension-cls") == serve.WORKER_EXTENSION
    assert "--skip-tokenizer-init" in argv and "--enforce-eager" not in argv
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert MALLOC_TUNABLES not in env.get("GLIBC_TUNABLES", "")  # a GPU server's malloc: glibc's


def test_gpu_servers_do_not_inherit_the_trainers_malloc_setting(tmp_path, monkeypatch):
    """A trainer runs with bapo_jax.malloc's setting (run.cli re-executes it so); the GPU
    servers it launches get glibc's defaults back, with the user's own tunables kept."""
    spec = _spec(tmp_path, devices=("0",))
    monkeypatch.setenv("GLIBC_TUNABLES", MALLOC_TUNABLES)
    assert "GLIBC_TUNABLES" not in serve.build_command(spec, 0)[1]
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0:" + MALLOC_TUNABLES)
    assert serve.build_command(spec, 0)[1]["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0"


def test_cpu_servers_keep_freed_memory_beside_the_users_tunables(tmp_path, monkeypatch):
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")
    env = serve.build_command(_spec(tmp_path), 0)[1]
    assert env["GLIBC_TUNABLES"] == "glibc.malloc.tcache_count=0:" + MALLOC_TUNABLES
    monkeypatch.setenv("GLIBC_TUNABLES", MALLOC_TUNABLES)  # already there: not repeated
    assert serve.build_command(_spec(tmp_path), 0)[1]["GLIBC_TUNABLES"] == (MALLOC_TUNABLES)


def test_worker_extension_is_importable_by_name():
    module, _, name = serve.WORKER_EXTENSION.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert callable(cls.bapo_load) and callable(cls.bapo_state)


def test_bad_specs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="must be a checkpoint directory"):
        _spec(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"port must be a port in \(0, 65536\), got 0"):
        _spec(tmp_path, port=0)
    with pytest.raises(ValueError, match="devices names 1 servers, num_servers=2"):
        serve.launch(_spec(tmp_path, devices=("0",)), 2)
    with pytest.raises(ValueError, match=r"devices must be tensor_parallel_size=1 GPUs per server"):
        _spec(tmp_path, devices=("0,1",))
    with pytest.raises(ValueError, match=r"GPU list '0,0': want distinct GPU indices"):
        _spec(tmp_path, devices=("0,0",), tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a share in \(0, 1\]"):
        _spec(tmp_path, gpu_memory_utilization=0)


def test_cpu_cores_pin_each_servers_openmp_threads(tmp_path):
    spec = _spec(tmp_path, cpu_cores=("1", "0"))
    assert serve.build_command(spec, 0)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert serve.build_command(spec, 1)[1]["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    with pytest.raises(ValueError, match=r"cpu_cores names 2 servers, num_servers=1"):
        serve.launch(spec, 1)


def test_vllm_python_is_the_key_then_the_environment_then_the_project_venv(monkeypatch):
    monkeypatch.delenv(serve.VLLM_PYTHON_ENV, raising=False)
    project = serve.project_vllm_python()
    assert project.endswith(os.path.join(".venv-vllm", "bin", "python"))
    assert os.path.dirname(os.path.dirname(os.path.dirname(project))) == REPO
    assert serve.vllm_python() == project
    monkeypatch.setenv(serve.VLLM_PYTHON_ENV, "/from/env/python")
    assert serve.vllm_python() == "/from/env/python"
    assert serve.vllm_python("/from/config/python") == "/from/config/python"


def test_a_missing_vllm_interpreter_is_refused_before_launch(tmp_path):
    missing = str(tmp_path / "no-venv" / "bin" / "python")
    spec = _spec(tmp_path, python=missing)
    assert spec.server.python == missing
    with pytest.raises(FileNotFoundError, match=r"engine\.server\.python"):
        serve.launch(spec, 1)


def test_a_group_on_the_same_log_dir_stops_the_servers_a_killed_run_left(tmp_path, monkeypatch):
    """A run whose trainer was SIGKILLed leaves its servers running (their own process
    groups). A new group on the same log directory stops them before it starts (stub servers
    stand in for vLLM's interpreter: this is the launcher's bookkeeping)."""
    stub = tmp_path / "python"
    stub.write_text(STUB_SERVER.format(python=sys.executable))
    stub.chmod(0o755)
    monkeypatch.setenv("STUB_LOG", str(tmp_path / "starts.jsonl"))
    model = tmp_path / "hf0"
    model.mkdir()
    logs = str(tmp_path / "logs")
    spec = _spec(model, port=_free_ports(2), python=str(stub))
    orphans = serve.ServerGroup(spec, 2, log_dir=logs, boot_timeout_s=30)
    orphans.wait_healthy()
    record = json.loads((tmp_path / "logs" / "servers.json").read_text())
    assert [r["pgid"] for r in record] == [p.pid for p in orphans.procs]
    group = serve.ServerGroup(spec, 2, log_dir=logs, boot_timeout_s=30)  # same ports
    try:
        assert sorted(group.stale_stopped) == sorted(p.pid for p in orphans.procs)
        for p in orphans.procs:
            assert p.wait(timeout=30) is not None
        group.wait_healthy()
        assert all(group.alive(url) for url in group.urls)
        os.killpg(group.procs[1].pid, signal.SIGKILL)
        group.procs[1].wait(timeout=30)
        assert group.alive(group.urls[0]) and not group.alive(group.urls[1])
    finally:
        group.stop()
    assert not (tmp_path / "logs" / "servers.json").exists()


def test_a_port_in_use_is_refused_before_launch(tmp_path):
    """Another server's /health must never pass for ours."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        spec = _spec(tmp_path, port=taken.getsockname()[1])
        assert not serve.port_is_free("127.0.0.1", spec.server.port)
        with pytest.raises(OSError, match=r"port \d+ on 127.0.0.1 is in use"):
            serve.ServerGroup(spec, 1)
