"""Launcher: ``python -m bapo_jax.rollout.serve --model DIR [--num-servers N] ...`` (the command
line is `serve_cli`; docs/rollout.md, "vLLM servers").

Starts N vLLM OpenAI-compatible servers (ports ``port, port+1, ...``) with the flags RL needs:

    VLLM_SERVER_DEV_MODE=1                   /pause, /resume, /collective_rpc, ... endpoints
    --logprobs-mode processed_logprobs       log-probs after temperature / top-p / top-k
    --generation-config vllm                 ignore the checkpoint's generation_config.json
    --worker-extension-cls ...BapoWorkerExtension   the Orbax weight loader
    --enable-scale-out                       /inference/v1/generate: token ids in and out,
                                             with the weight version of every output token
    --host 127.0.0.1                         loopback unless the network is trusted
    --middleware ...server_auth.BearerTokenMiddleware   with a secret file (a `ServerGroup`
                                             always has one): every route needs the token

and, per server, ``CUDA_VISIBLE_DEVICES`` from ``--devices "0,1;2,3"`` (GPU pods), or on a
CPU build ``VLLM_CPU_OMP_THREADS_BIND`` from ``--cpu-cores`` and glibc's allocator setting of
``bapo_jax.malloc``. What a server serves is its `ServerSpec`, how it starts its
`ServerSettings` (`server_settings`). The servers run with the vLLM environment's interpreter,
never the trainer's (`vllm_python`).

``ServerGroup`` is the launcher as an object that can also restart one server in place (same
port, devices and flags; ``VLLMEngine(..., restart=group.restart, alive=group.alive)``). With a
log directory it records its servers' process groups in ``servers.json`` there; a group started
on the same directory (a run resumed after its trainer was killed) first stops the servers such
a record names, so no orphan keeps the ports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence

from bapo_jax.malloc import with_malloc_tunables, without_malloc_tunables
from bapo_jax.rollout.run_secret import (
    SECRET_FILE_ENV,
    auth_headers,
    bearer_token,
    new_secret_file,
    read_secret,
)
from bapo_jax.rollout.server_auth import MIDDLEWARE
from bapo_jax.rollout.server_settings import (
    LOOPBACK,
    SYNC_ROOT_ENV,
    VLLM_PYTHON_ENV,
    ServerSettings,
    ServerSpec,
    parse_cores,
    parse_devices,
)

__all__ = [
    "LOOPBACK",
    "VLLM_PYTHON_ENV",
    "ServerGroup",
    "ServerSettings",
    "ServerSpec",
    "build_command",
    "launch",
    "parse_devices",
    "project_vllm_python",
    "stop",
    "vllm_python",
    "wait_healthy",
]

WORKER_EXTENSION = "bapo_jax.rollout.vllm_worker.BapoWorkerExtension"
_RECORD = "servers.json"


def project_vllm_python() -> str:
    """The project's vLLM environment: ``<repository>/.venv-vllm/bin/python``."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(root, ".venv-vllm", "bin", "python")


def vllm_python(configured: str | None = None) -> str:
    """The vLLM interpreter: ``configured`` (``ServerSettings.python``) if given, else
    ``$BAPO_VLLM_PYTHON``, else ``project_vllm_python()``. Not checked here: ``launch`` and the
    run config's validation refuse a path that is not an interpreter, naming the key."""
    return configured or os.environ.get(VLLM_PYTHON_ENV) or project_vllm_python()


def missing_vllm_python(path: str) -> str | None:
    """Why ``path`` cannot be the vLLM interpreter (None: it can)."""
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        return (
            f"no vLLM interpreter at {path!r} (set engine.server.python / --vllm-python or "
            f"${VLLM_PYTHON_ENV}, or build the project's with `make .venv-vllm/.vllm-installed`)"
        )
    return None


# Runs the rest of the command line on the given cores: `python -c PIN -m vllm...` sets the
# process's CPU affinity (inherited by vLLM's engine and worker processes) and execs.
_PIN = (
    "import os, sys; os.sched_setaffinity(0, {cores}); "
    "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
)


def build_command(spec: ServerSpec, index: int = 0) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of server ``index``."""
    s, pin = spec.server, []
    if s.cpu_cores:  # the whole server on its cores, whatever the launcher's are
        pin = ["-c", _PIN.format(cores=sorted(parse_cores(s.cpu_cores[index])))]
    argv = [
        vllm_python(s.python), *pin, "-m", "vllm.entrypoints.openai.api_server",
        "--model", spec.model,
        "--served-model-name", s.served_model_name or spec.model,
        "--host", s.host,
        "--port", str(s.port + index),
        "--dtype", s.dtype,
        "--max-model-len", str(spec.max_model_len),
        "--tensor-parallel-size", str(s.tensor_parallel_size),
        "--logprobs-mode", "processed_logprobs",
        "--generation-config", "vllm",
        "--worker-extension-cls", WORKER_EXTENSION,
        "--enable-scale-out",
    ]  # fmt: skip
    if s.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
    if not s.with_tokenizer:
        argv.append("--skip-tokenizer-init")  # token ids in, token ids out
    if s.enforce_eager:
        argv.append("--enforce-eager")
    if s.max_lora_rank:  # adapters loaded at runtime (rollout.adapter_sync), one at a time
        argv += ["--enable-lora", "--max-lora-rank", str(s.max_lora_rank), "--max-loras", "1"]
    argv += list(s.args)
    if s.secret_file is not None:
        argv += ["--middleware", MIDDLEWARE]  # every route requires the run's token
    elif s.host not in LOOPBACK:
        raise ValueError(
            f"host {s.host!r} without a secret_file: the servers' dev endpoints would be open "
            "to the network (give the run's secret file, or bind to loopback)"
        )
    env = dict(os.environ)
    env.pop(SECRET_FILE_ENV, None)  # only the secret this spec names
    if s.secret_file is not None:
        env[SECRET_FILE_ENV] = os.path.abspath(s.secret_file)
    env.pop(SYNC_ROOT_ENV, None)
    if spec.sync_root is not None:
        env[SYNC_ROOT_ENV] = os.path.realpath(spec.sync_root)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    if s.max_lora_rank:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(s.cpu_kvcache_gib))
    # The worker's JAX (Orbax restore, checks) on the host CPU: a JAX with GPU support in the
    # vLLM environment would otherwise preallocate 75% of the server's GPUs.
    env["JAX_PLATFORMS"] = "cpu"
    if s.devices:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(s.devices[index], env)
    if s.cpu_cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = s.cpu_cores[index]
    if not s.devices:  # vLLM-cpu: its weights, KV cache and reloads are malloc'd memory
        env["GLIBC_TUNABLES"] = with_malloc_tunables(env.get("GLIBC_TUNABLES"))
    elif (kept := without_malloc_tunables(env.pop("GLIBC_TUNABLES", None))) is not None:
        env["GLIBC_TUNABLES"] = kept  # a GPU server: glibc's defaults, the user's own kept
    return argv, env


def launch(
    spec: ServerSpec, num_servers: int = 1, *, log_dir: str | None = None
) -> list[subprocess.Popen]:
    """Start ``num_servers`` servers (each in its own process group); logs to
    ``log_dir/server-i.log`` when given."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    for name in ("devices", "cpu_cores"):
        given = getattr(spec.server, name)
        if given and len(given) != num_servers:
            raise ValueError(f"{name} names {len(given)} servers, num_servers={num_servers}")
    if (why := missing_vllm_python(vllm_python(spec.server.python))) is not None:
        raise FileNotFoundError(why)
    return [_start(spec, i, log_dir) for i in range(num_servers)]


def _start(spec: ServerSpec, index: int, log_dir: str | None) -> subprocess.Popen:
    argv, env = build_command(spec, index)
    kwargs = dict(env=env, stderr=subprocess.STDOUT, start_new_session=True)
    if log_dir is None:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, **kwargs)
    os.makedirs(log_dir, exist_ok=True)
    with open(os.path.join(log_dir, f"server-{index}.log"), "ab") as out:  # appended on restart
        return subprocess.Popen(argv, stdout=out, **kwargs)


def visible_devices(gpus: str, env: dict[str, str]) -> str:
    """CUDA_VISIBLE_DEVICES of a server on GPUs ``gpus``: indices among the GPUs the launcher
    sees (its own CUDA_VISIBLE_DEVICES, as the trainer's ``trainer_devices``), else as given."""
    seen = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if not seen:
        return gpus
    ids = parse_devices(gpus)
    if max(ids) >= len(seen):
        raise ValueError(
            f"devices {gpus!r}: the launcher sees only {len(seen)} GPUs "
            f"(CUDA_VISIBLE_DEVICES={','.join(seen)})"
        )
    return ",".join(seen[i] for i in ids)


def wait_healthy(
    urls: Sequence[str],
    procs: Sequence[subprocess.Popen] = (),
    *,
    timeout_s: float = 600.0,
    token: str | None = None,
) -> None:
    """Poll ``/health`` (with the bearer ``token`` the servers require, if any) until every
    server answers 200; raise if one exits or time runs out."""
    deadline = time.monotonic() + timeout_s
    pending = list(urls)
    headers = auth_headers(token)
    while pending:
        for p in procs:
            if p.poll() is not None:
                raise RuntimeError(f"vLLM server exited with code {p.returncode} while booting")
        for url in list(pending):
            try:
                probe = urllib.request.Request(url + "/health", headers=headers)
                with urllib.request.urlopen(probe, timeout=2) as r:
                    if r.status == 200:
                        pending.remove(url)
            except (urllib.error.URLError, OSError):
                pass
        if pending and time.monotonic() > deadline:
            raise TimeoutError(f"vLLM servers not healthy after {timeout_s}s: {pending}")
        if pending:
            time.sleep(1.0)


def stop(procs: Sequence[subprocess.Popen], *, timeout_s: float = 30.0) -> None:
    """SIGTERM each server's process group, SIGKILL what is left after ``timeout_s``."""
    for p in procs:
        if p.poll() is None:
            _signal_pgid(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_pgid(p.pid, signal.SIGKILL)
            p.wait(timeout=10)
    from bapo_jax.rollout.node_share import remove_stale

    remove_stale()  # the stopped servers' sync buffers in shared memory (tensor-parallel ones)


class ServerGroup:
    """``num_servers`` servers of one spec, each restartable in place.

    ``urls[i]`` is server i (``http://host:port+i``). ``restart(url)`` stops that server's
    process group (SIGTERM, then SIGKILL) and boots it again with the same command, returning
    once it answers ``/health`` (it then serves the spec's ``--model`` weights, i.e. the boot
    version; the client reloads the version it wants).

    Every route of the group's servers requires ``token`` (`run_secret.bearer_token`), derived
    from ``secret_file``: the spec's, else ``$BAPO_RUN_SECRET_FILE``'s, else a fresh one made
    in ``log_dir`` (a temp directory without one) for this group."""

    def __init__(
        self,
        spec: ServerSpec,
        num_servers: int = 1,
        *,
        log_dir: str | None = None,
        boot_timeout_s: float = 900.0,
    ):
        if boot_timeout_s <= 0:
            raise ValueError(f"boot_timeout_s must be > 0, got {boot_timeout_s}")
        self._own_dir = None if log_dir else tempfile.mkdtemp(prefix="bapo-servers-")
        self.secret_file = (
            spec.server.secret_file
            or os.environ.get(SECRET_FILE_ENV)
            or new_secret_file(log_dir or self._own_dir)
        )
        self.token = bearer_token(read_secret(self.secret_file))
        spec = dataclasses.replace(
            spec, server=dataclasses.replace(spec.server, secret_file=self.secret_file)
        )
        self.spec, self.log_dir, self.boot_timeout_s = spec, log_dir, boot_timeout_s
        host, port = spec.server.host, spec.server.port
        self.urls = [
            f"http://{f'[{host}]' if ':' in host else host}:{port + i}" for i in range(num_servers)
        ]
        self.stale_stopped = stop_recorded(log_dir) if log_dir else []
        for i in range(num_servers):  # else another server's /health would pass for ours
            if not port_is_free(host, port + i):
                raise OSError(
                    f"port {port + i} on {host} is in use (another vLLM server?); "
                    "choose another first port (engine.server.port / --port)"
                )
        self.procs = launch(spec, num_servers, log_dir=log_dir)
        self.restarts = [0] * num_servers
        self._record()

    def wait_healthy(self) -> None:
        wait_healthy(self.urls, self.procs, timeout_s=self.boot_timeout_s, token=self.token)

    def index(self, url: str) -> int:
        url = url.rstrip("/")
        if url not in self.urls:
            raise ValueError(f"ServerGroup.restart: {url!r} is not one of {self.urls}")
        return self.urls.index(url)

    def alive(self, url: str) -> bool:
        """Whether server ``url``'s process is still running (it may still be booting)."""
        return self.procs[self.index(url)].poll() is None

    def restart(self, url: str) -> None:
        """Stop server ``url`` and boot it again; raises if it does not come back healthy."""
        i = self.index(url)
        stop([self.procs[i]])
        self.procs[i] = _start(self.spec, i, self.log_dir)
        self.restarts[i] += 1
        self._record()
        wait_healthy([url], [self.procs[i]], timeout_s=self.boot_timeout_s, token=self.token)

    def stop(self) -> None:
        stop(self.procs)
        if self._own_dir:  # the secret made for a group without a log directory
            shutil.rmtree(self._own_dir, ignore_errors=True)
        if self.log_dir:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.log_dir, _RECORD))

    def _record(self) -> None:
        """servers.json: each server's URL and process group, for ``stop_recorded``."""
        if not self.log_dir:
            return
        record = [{"url": u, "pgid": p.pid} for u, p in zip(self.urls, self.procs, strict=True)]
        tmp = os.path.join(self.log_dir, _RECORD + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(record, f)
        os.replace(tmp, os.path.join(self.log_dir, _RECORD))


def port_is_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def stop_recorded(log_dir: str, *, timeout_s: float = 30.0) -> list[int]:
    """Stop the servers a ``servers.json`` in ``log_dir`` names that still run a vLLM server
    (a group whose process was killed leaves them behind) and wait, up to ``timeout_s``, until
    their ports are free again (an exiting process releases its memory, and with it its
    command line, before its sockets); returns their process groups."""
    path = os.path.join(log_dir, _RECORD)
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except (FileNotFoundError, ValueError):
        return []
    stale = [entry for entry in record if _is_vllm_server(int(entry["pgid"]))]
    pgids = [int(entry["pgid"]) for entry in stale]
    for pgid in pgids:
        _signal_pgid(pgid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while any(_is_vllm_server(g) for g in pgids) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pgid in pgids:
        _signal_pgid(pgid, signal.SIGKILL)
    addresses = [urllib.parse.urlsplit(entry["url"]) for entry in stale]
    while time.monotonic() < deadline and not all(
        port_is_free(a.hostname, a.port) for a in addresses if a.hostname and a.port
    ):
        time.sleep(0.1)
    with contextlib.suppress(FileNotFoundError):
        os.remove(path)
    return pgids


def _is_vllm_server(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"vllm.entrypoints.openai.api_server" in f.read()
    except OSError:
        return False


def _signal_pgid(pgid: int, sig: int) -> None:
    """Signal a process group; one that exited meanwhile is no error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


if __name__ == "__main__":  # the command line: `serve_cli`
    from bapo_jax.rollout.serve_cli import main

    raise SystemExit(main())
