"""The run's secret and the bearer token on every route: the secret file's permissions, what
derives from it, the ASGI middleware (driven directly, as the vLLM server's app would drive
it), and a launched group whose servers require the token (stub servers that check it stand
in for vLLM: the real server is tested in test_vllm_real)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat
import sys
import urllib.error
import urllib.request

import pytest

from bapo_jax.rollout import run_secret, serve
from bapo_jax.rollout.server_auth import BearerTokenMiddleware

from .test_vllm_faults import _free_ports


def _secret(tmp_path) -> str:
    return run_secret.new_secret_file(tmp_path / "vllm")


def test_a_new_secret_is_owner_only_and_derives_two_unrelated_keys(tmp_path):
    path = _secret(tmp_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "vllm").st_mode) == 0o700
    secret = run_secret.read_secret(path)
    token, key = run_secret.bearer_token(secret), run_secret.manifest_key(secret)
    assert len(token) == 64 and len(key) == 32 and bytes.fromhex(token) != key
    assert run_secret.bearer_token(secret) == token  # deterministic
    assert run_secret.bearer_token(run_secret.read_secret(_secret(tmp_path / "b"))) != token


def test_a_secret_others_may_read_is_refused(tmp_path):
    path = _secret(tmp_path)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match=r"is readable by others \(mode -rw-r--r--\)"):
        run_secret.read_secret(path)
    os.chmod(path, 0o600)
    with open(path, "w") as f:
        f.write("short\n")
    with pytest.raises(ValueError, match="holds 5 characters, want >= 16"):
        run_secret.read_secret(path)


def _call(middleware, scope) -> list[dict]:
    sent, inner = [], []

    async def app(scope, receive, send):
        inner.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive():
        return {"type": "http.request"}

    async def send(message):
        sent.append(message)

    middleware.app = app
    asyncio.run(middleware(scope, receive, send))
    return [*sent, {"inner": inner}]


def test_the_middleware_guards_every_route(tmp_path, monkeypatch):
    path = _secret(tmp_path)
    monkeypatch.setenv(run_secret.SECRET_FILE_ENV, path)
    token = run_secret.bearer_token(run_secret.read_secret(path))
    mw = BearerTokenMiddleware(app=None)

    def http(route, authorization=None, method="POST"):
        headers = [] if authorization is None else [(b"authorization", authorization.encode())]
        return {"type": "http", "method": method, "path": route, "headers": headers}

    for route in ("/v1/models", "/pause", "/collective_rpc", "/update_weight_version", "/health"):
        for bad in (None, "Bearer wrong", f"Basic {token}", token):
            start, body, inner = _call(mw, http(route, bad))
            assert start["status"] == 401 and inner == {"inner": []}, (route, bad)
            assert b"Unauthorized" in body["body"]
        start, inner = _call(mw, http(route, f"Bearer {token}"))
        assert start["status"] == 200 and inner == {"inner": [route]}
    assert _call(mw, http("/pause", None, "OPTIONS"))[-1] == {"inner": ["/pause"]}  # CORS
    closed, inner = _call(mw, {"type": "websocket", "path": "/v1/realtime", "headers": []})
    assert closed == {"type": "websocket.close", "code": 1008} and inner == {"inner": []}
    monkeypatch.delenv(run_secret.SECRET_FILE_ENV)
    with pytest.raises(RuntimeError, match="needs \\$BAPO_RUN_SECRET_FILE"):
        BearerTokenMiddleware(app=None)


# A stand-in for vLLM's interpreter that serves /health only with the run's token, read the way
# the middleware reads it (the secret file its environment names).
STUB_WITH_AUTH = """#!{python}
import os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
from bapo_jax.rollout import run_secret
argv = sys.argv[1:]
assert argv[argv.index("--middleware") + 1] == "bapo_jax.rollout.server_auth.BearerTokenMiddleware"
token = run_secret.token_from_env()
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        ok = self.headers.get("Authorization") == "Bearer " + token
        self.send_response(200 if ok else 401)
        self.end_headers()
    def log_message(self, *a):
        pass
HTTPServer(("127.0.0.1", int(argv[argv.index("--port") + 1])), H).serve_forever()
"""


def test_a_launched_group_makes_a_fresh_secret_and_sends_its_token(tmp_path, monkeypatch):
    monkeypatch.delenv(run_secret.SECRET_FILE_ENV, raising=False)
    monkeypatch.setenv("PYTHONPATH", os.getcwd())
    stub = tmp_path / "python"
    stub.write_text(STUB_WITH_AUTH.format(python=sys.executable))
    stub.chmod(0o755)
    (tmp_path / "hf0").mkdir()
    settings = serve.ServerSettings(port=_free_ports(1), python=str(stub))
    spec = serve.ServerSpec(str(tmp_path / "hf0"), 64, settings, str(tmp_path / "sync"))
    group = serve.ServerGroup(spec, 1, log_dir=str(tmp_path / "logs"), boot_timeout_s=30)
    try:
        assert group.secret_file == str(tmp_path / "logs" / "run_secret")
        group.wait_healthy()  # only with the token: the stub answers 401 otherwise
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(group.urls[0] + "/health", timeout=5)
        assert refused.value.code == 401
        moved = serve.ServerSettings(port=_free_ports(1), python=str(stub))
        other = serve.ServerGroup(
            dataclasses.replace(spec, server=moved), 1, log_dir=str(tmp_path / "other")
        )
        other.stop()
        assert other.token != group.token  # a fresh secret per group (per run)
    finally:
        group.stop()
    logs = [p.read_text(errors="ignore") for p in (tmp_path / "logs").rglob("*") if p.is_file()]
    assert logs and not any(group.token in text for text in logs)  # the token is never written


def test_a_network_host_needs_a_secret(tmp_path):
    (tmp_path / "hf0").mkdir()
    spec = serve.ServerSpec(str(tmp_path / "hf0"), 64, serve.ServerSettings(host="0.0.0.0"))
    with pytest.raises(ValueError, match=r"host '0.0.0.0' without a secret_file"):
        serve.build_command(spec, 0)
