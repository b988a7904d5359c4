"""The launcher's command line: the flags RL needs, loopback by default, per-server devices."""

from __future__ import annotations

import pytest

from bapo_jax.rollout import serve


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_build_command_has_the_rl_flags(tmp_path):
    spec = serve.ServerSpec(model=str(tmp_path), port=9000, devices=("0,1", "2,3"))
    argv, env = serve.build_command(spec, 1)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--port") == "9001" and _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--logprobs-mode") == "processed_logprobs"
    assert _flag(argv, "--generation-config") == "vllm"
    assert _flag(argv, "--worker-extension-cls") == serve.WORKER_EXTENSION
    assert "--skip-tokenizer-init" in argv and "--enforce-eager" not in argv
    assert env["VLLM_SERVER_DEV_MODE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "2,3"


def test_worker_extension_is_importable_by_name():
    module, _, name = serve.WORKER_EXTENSION.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    assert callable(cls.bapo_load) and callable(cls.bapo_state)


def test_bad_specs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="must be a checkpoint directory"):
        serve.ServerSpec(model=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"port must be in \(0, 65536\), got 0"):
        serve.ServerSpec(model=str(tmp_path), port=0)
    with pytest.raises(ValueError, match="devices names 1 servers, num_servers=2"):
        serve.launch(serve.ServerSpec(model=str(tmp_path), devices=("0",)), 2)
