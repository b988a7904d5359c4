"""Servers are checked through their /v1/models before any compute: the run's served name, and
a max length that holds the prompt + response caps; each refusal names the key. A real HTTP
server in the test answers with vLLM's /v1/models payload (`ModelCard`: id, max_model_len,
root, ...); a launched "server" is a stub interpreter in place of vLLM's, which serves the
payload its command line implies. Also: a model directory without tokenizer files is refused
naming the files and the key, before the policy loads."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bapo_jax.models import tokenizer as tok
from bapo_jax.models.config import Qwen2Config
from bapo_jax.rollout.serve import ServerSettings
from bapo_jax.run import build, servers
from bapo_jax.run.config import (
    EngineSection,
    EvalSection,
    ModelSection,
    RunConfig,
    RunConfigError,
    validate_run,
)
from bapo_jax.train.config import RolloutConfig, TrainerConfig

from ..rollout.test_vllm_faults import _free_ports


def _card(name: str, max_model_len: int | None) -> dict:
    card = {"id": name, "object": "model", "owned_by": "vllm", "root": "/models/x"}
    if max_model_len is not None:
        card["max_model_len"] = max_model_len
    return card


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self):
        models = self.server.models  # type: ignore[attr-defined]
        if self.path == "/v1/models" and models is not None:
            body = json.dumps({"object": "list", "data": models}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_response(200 if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def models_server(models: list[dict] | None):
    """A local HTTP server answering GET /v1/models with `models` (None: 404, not vLLM)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.models = models  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=10)


# The tiny model with room for those rows (validate_run refuses rows over the context).
TINY_LONG = Qwen2Config.preset("tiny").replace(max_position_embeddings=16384)


def _config(url: str | None = None, *, eval_every: int = 0, **engine) -> RunConfig:
    """The aime_7b caps (1,024 prompt + 8,192 response tokens) on a tiny model."""
    trainer = TrainerConfig(
        eval_every=eval_every,
        rollout=RolloutConfig(
            prompts_per_step=2, samples_per_prompt=4, max_prompt_tokens=1024,
            max_response_tokens=8192,
        ),
    )  # fmt: skip
    if url is not None:
        engine = {"kind": "vllm", "vllm_urls": (url,), **engine}
    return RunConfig(
        trainer=trainer,
        model=ModelSection(preset="tiny"),
        engine=EngineSection(**engine),
        eval=EvalSection(sets=("aime2024",), max_tokens=12000),
    )


def test_max_model_len_is_the_prompt_plus_the_response_or_eval_cap():
    assert servers.max_model_len(_config()) == 1024 + 8192
    assert servers.max_model_len(_config(eval_every=5)) == 1024 + 12000
    assert build.max_model_len is servers.max_model_len


def test_a_server_serving_the_run_with_room_for_its_sequences_is_accepted():
    with models_server([_card("policy", 9216)]) as url:
        config = _config(url, server=ServerSettings(served_model_name="policy"))
        assert validate_run(config, architecture=TINY_LONG).num_attention_heads == 4
        assert servers.check_server(config, url) == "policy"
        assert servers.check_server(_config(url), url) == "policy"  # its only model
        assert servers.check_server(config, url) == "policy"


def _refusal(models: list[dict] | None, **config) -> tuple[str, str]:
    """(url, message) of `validate_run`'s refusal of a server answering with `models`."""
    with models_server(models) as url:
        try:
            validate_run(_config(url, **config), architecture=TINY_LONG)
        except RunConfigError as error:
            return url, str(error)
    raise AssertionError(f"a server listing {models} was accepted")


def test_a_server_not_serving_the_configured_name_is_refused():
    named = ServerSettings(served_model_name="policy")
    url, message = _refusal([_card("other-model", 9216)], server=named)
    assert message == (
        f"engine.server.served_model_name: {url} does not serve 'policy' (it serves "
        "['other-model']); set engine.server.served_model_name to the server's "
        "--served-model-name"
    )


def test_a_server_with_a_short_context_is_refused_naming_the_caps():
    url, message = _refusal([_card("policy", 4096)])
    assert message == (
        f"engine.vllm_urls: {url} serves 'policy' with max_model_len 4096, fewer than the 9216 "
        "tokens the run needs (trainer.rollout.max_prompt_tokens 1024 + "
        "trainer.rollout.max_response_tokens 8192); start it with --max-model-len 9216 or lower "
        "those caps"
    )
    _, message = _refusal([_card("policy", 9216)], eval_every=5)  # trains, cannot evaluate
    assert "max_model_len 9216, fewer than the 13024 tokens" in message
    assert "+ max(trainer.rollout.max_response_tokens 8192, eval.max_tokens 12000)" in message


def test_other_unusable_servers_are_refused_naming_the_key():
    url, message = _refusal([_card("policy", None)])
    assert message.startswith(f"engine.vllm_urls: {url}/v1/models lists no max_model_len")
    url, message = _refusal([_card("a", 9216), _card("b", 9216)])
    assert message == (
        f"engine.server.served_model_name: {url} serves ['a', 'b']; name the one to use"
    )
    url, message = _refusal(None)  # answers /health, but has no /v1/models
    assert message.startswith(f"engine.vllm_urls: {url} does not answer GET /v1/models (404")


def test_the_vllm_client_gets_the_request_timeout_and_concurrency_keys(tmp_path):
    with models_server([_card("policy", 9216)]) as url:
        config = _config(url, request_timeout_s=1800.0, requests_per_server=16)
        with contextlib.ExitStack() as stack:
            engine, sync = build._vllm_engine(
                config, Qwen2Config.preset("tiny"), str(tmp_path), stack
            )
            assert engine.config.urls == (url,) and engine.config.model == "policy"
            assert sync.root == os.path.join(str(tmp_path), "weight_sync")
            assert sync.target is engine  # one process: the sync loads into the engine itself
            assert engine.config.request_timeout_s == 1800.0
            assert engine.config.max_inflight_per_server == 16
            assert (
                engine.config.sequences_per_server == 16 * config.trainer.rollout.samples_per_prompt
            )
    with pytest.raises(ValueError, match=r"request_timeout_s: > 0 seconds, got 0"):
        EngineSection(request_timeout_s=0)


# A stand-in for vLLM's interpreter: serves /health and the /v1/models card its command line
# implies (minus $STUB_SHORTEN tokens of max length), and records its argv and GPUs.
STUB_VLLM = """#!{python}
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
argv = sys.argv[1:]
flag = lambda name: argv[argv.index(name) + 1]
with open(os.environ["STUB_LOG"], "a") as f:
    f.write(json.dumps({{"argv": argv, "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}}) + "\\n")
card = {{"id": flag("--served-model-name"), "root": flag("--model"),
        "max_model_len": int(flag("--max-model-len")) - int(os.environ["STUB_SHORTEN"])}}
body = json.dumps({{"object": "list", "data": [card]}}).encode()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        found = self.path in ("/health", "/v1/models")
        self.send_response(200 if found else 404)
        self.send_header("Content-Length", str(len(body) if found else 0))
        self.end_headers()
        if found:
            self.wfile.write(body)
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(flag("--port"))), H).serve_forever()
"""


def _launched(tmp_path, monkeypatch, shorten: int) -> RunConfig:
    stub = tmp_path / "vllm-env-python"
    stub.write_text(STUB_VLLM.format(python=sys.executable))
    stub.chmod(0o755)
    monkeypatch.setenv("STUB_LOG", str(tmp_path / "starts.jsonl"))
    monkeypatch.setenv("STUB_SHORTEN", str(shorten))
    (tmp_path / "hf").mkdir()
    return dataclasses.replace(
        _config(),
        model=ModelSection(preset="tiny", hf_dir=str(tmp_path / "hf")),
        engine=EngineSection(
            kind="vllm",
            launch_servers=2,
            server=ServerSettings(
                python=str(stub),
                port=_free_ports(2),
                devices=("4,5", "6,7"),
                tensor_parallel_size=2,
            ),
        ),
    )


def test_launched_servers_are_checked_once_healthy(tmp_path, monkeypatch):
    config = _launched(tmp_path, monkeypatch, shorten=0)
    group = build.launch_servers(config, str(tmp_path / "run"))
    try:
        names = [servers.check_server(config, url, launched=True) for url in group.urls]
        assert names == [str(tmp_path / "hf")] * 2  # model.hf_dir: no served_model_name
    finally:
        group.stop()
    starts = [json.loads(line) for line in (tmp_path / "starts.jsonl").read_text().splitlines()]
    assert sorted(s["gpus"] for s in starts) == ["4,5", "6,7"]
    for s in starts:
        argv = s["argv"]
        assert argv[argv.index("--max-model-len") + 1] == "9216"
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"


def test_a_launched_server_with_a_shorter_context_is_refused_and_stopped(tmp_path, monkeypatch):
    config = _launched(tmp_path, monkeypatch, shorten=1)
    with pytest.raises(
        RunConfigError,
        match=r"engine\.launch_servers: http://127\.0\.0\.1:\d+ serves .* with max_model_len "
        r"9215, fewer than the 9216 tokens",
    ):
        build.launch_servers(config, str(tmp_path / "run"))
    # The group was stopped: its ports are free again, its record removed.
    port = config.engine.server.port
    from bapo_jax.rollout import serve

    assert serve.port_is_free("127.0.0.1", port) and serve.port_is_free("127.0.0.1", port + 1)
    assert not (tmp_path / "run" / "vllm" / "servers.json").exists()


def test_a_model_dir_without_tokenizer_files_is_refused_naming_them(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(TINY_LONG.to_hf_dict()))
    config = dataclasses.replace(_config(), model=ModelSection(hf_dir=str(hf)))
    assert tok.missing_tokenizer_files(hf) == (
        "tokenizer.json (or vocab.json + merges.txt)",
        "tokenizer_config.json",
    )
    with pytest.raises(RunConfigError) as error, build.build_trainer(config, str(tmp_path)):
        pass  # refused before the policy loads (there are no weights to load)
    assert str(error.value) == (
        f"model.hf_dir (--model-dir): {str(hf)!r} has no tokenizer: missing tokenizer.json (or "
        "vocab.json + merges.txt), tokenizer_config.json; copy them from the model's hub "
        "repository, or set model.tokenizer_dir to a directory with them"
    )
    shutil.copy(tok.SHIPPED_TOKENIZER_DIR / "vocab.json", hf)
    assert tok.missing_tokenizer_files(hf) == ("merges.txt", "tokenizer_config.json")
    with pytest.raises(
        RunConfigError, match=r"model\.tokenizer_dir: .* missing merges\.txt, tokenizer_config"
    ):
        build.build_tokenizer(
            dataclasses.replace(config, model=ModelSection(tokenizer_dir=str(hf)))
        )
    for name in ("merges.txt", "tokenizer_config.json"):
        shutil.copy(tok.SHIPPED_TOKENIZER_DIR / name, hf)
    assert tok.missing_tokenizer_files(hf) == ()
    assert build.build_tokenizer(config).eos_id == tok.IM_END_ID
