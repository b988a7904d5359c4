"""`python -m bapo_jax.rollout.serve`: every flag documented in --help, and --max-model-len
required (it must hold the run's prompt + response caps, never a silent 4,096)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import subprocess
import sys

import pytest

from bapo_jax.rollout import serve, serve_cli

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _module(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "bapo_jax.rollout.serve", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_help_documents_every_flag_of_the_parser():
    proc = _module("--help")
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())  # argparse wraps lines
    actions = [a for a in serve_cli.build_parser()._actions if a.dest != "help"]
    assert len(actions) == 22  # 15 settings (14 fields + --vllm-python), 6 others, settings
    for action in actions:
        assert action.help and action.help is not argparse.SUPPRESS, action.dest
        for option in action.option_strings:
            assert re.search(rf"(^|[\s\[,]){re.escape(option)}\b", text), option
        # each flag's own help sentence is there, however argparse wrapped it
        assert "".join(action.help.split()) in "".join(text.split()), action.help
    assert "required: tokens per sequence" in text and "9216" in text


def test_max_model_len_is_required():
    proc = _module("--model", REPO)
    assert proc.returncode == 2
    assert "the following arguments are required: --max-model-len, --sync-root" in proc.stderr
    with pytest.raises(SystemExit):
        serve_cli.parse(["--model", REPO])


def test_the_command_line_becomes_the_spec(tmp_path):
    args, spec = serve_cli.parse(
        [
            "--model", str(tmp_path), "--num-servers", "2", "--max-model-len", "9216",
            "--sync-root", str(tmp_path / "sync"),
            "--devices", "4,5;6,7", "--tensor-parallel-size", "2",
            "--gpu-memory-utilization", "0.85", "--vllm-python", "/opt/vllm/bin/python",
            "cpu_kvcache_gib=2", "--", "--max-num-seqs", "64",
        ]
    )  # fmt: skip
    assert args.num_servers == 2
    assert spec == serve.ServerSpec(
        model=str(tmp_path),
        max_model_len=9216,
        server=serve.ServerSettings(
            python="/opt/vllm/bin/python",
            devices=("4,5", "6,7"),
            tensor_parallel_size=2,
            gpu_memory_utilization=0.85,
            cpu_kvcache_gib=2,
            args=("--max-num-seqs", "64"),
        ),
        sync_root=str(tmp_path / "sync"),
    )
    argv, env = serve.build_command(spec, 1)
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.85"
    assert argv[-3:] == ["--skip-tokenizer-init", "--max-num-seqs", "64"]
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_a_device_list_that_is_not_the_tensor_parallel_size_is_refused(tmp_path):
    proc = _module(
        "--model", str(tmp_path), "--max-model-len", "9216", "--sync-root", str(tmp_path),
        "--devices", "4,5;6",
        "--tensor-parallel-size", "2",
    )  # fmt: skip
    assert proc.returncode == 2
    assert "devices must be tensor_parallel_size=2 GPUs per server, got '6'" in proc.stderr


def test_the_settings_are_the_run_configs_engine_server_section():
    """One declaration: the command line's settings are the run config's engine.server
    section (same class, same defaults), and every field has a help text."""
    from bapo_jax.run.config import EngineSection

    assert EngineSection().server == serve.ServerSettings()
    for field in dataclasses.fields(serve.ServerSettings):
        assert field.metadata.get("help"), field.name
    assert set(serve_cli.FLAGS.values()) | {"args"} == {
        f.name for f in dataclasses.fields(serve.ServerSettings)
    }


def test_a_network_host_without_a_secret_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("BAPO_RUN_SECRET_FILE", raising=False)
    proc = _module(
        "--model", str(tmp_path), "--max-model-len", "64", "--sync-root", str(tmp_path),
        "--host", "0.0.0.0",
    )  # fmt: skip
    assert proc.returncode == 2
    assert "--host 0.0.0.0 without a secret: every route would be open" in proc.stderr
    secret = tmp_path / "run_secret"
    secret.write_text("0123456789abcdef0123456789abcdef\n")
    secret.chmod(0o600)
    _, spec = serve_cli.parse(
        ["--model", str(tmp_path), "--max-model-len", "64", "--sync-root", str(tmp_path),
         "--host", "0.0.0.0", "--secret-file", str(secret)]
    )  # fmt: skip
    argv, env = serve.build_command(spec, 0)
    assert (
        argv[argv.index("--middleware") + 1] == "bapo_jax.rollout.server_auth.BearerTokenMiddleware"
    )
    assert env["BAPO_RUN_SECRET_FILE"] == str(secret)
    assert env["BAPO_SYNC_ROOT"] == os.path.realpath(tmp_path)
    assert str(secret) not in argv  # the secret's path in the environment, never its text
