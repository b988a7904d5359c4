"""Shared by the real-vLLM tests of the CPU main job (``test_cpu_arithmetic_vllm*.py``; marker
``vllm``): the warm start every run starts from, the job as a user runs it (a subprocess), and
the checks every vLLM iteration must pass. Two test files so that ``make test-vllm``'s two
processes run the quick mode (its own server) beside the tests sharing one server."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import requests

from bapo_jax.rollout import run_secret, serve
from bapo_jax.tasks import arithmetic_job
from experiments import cpu_arithmetic as main_job
from tests.child_env import child_env

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Wall-clock measurements differ between any two runs.
TIMING = ("time/", "compile/", "tokens_per_s", "model_flops_per_s", "mfu", "overlap/")


def make_warm_start(tmp_path_factory) -> str:
    """The quick main job's warm start (tokenizer, SFT'd model, task), made once per module."""
    if (why := serve.missing_vllm_python(serve.vllm_python())) is not None:
        pytest.fail(why)
    directory = str(tmp_path_factory.mktemp("warm") / "warm_start")
    trainer = main_job.quick(main_job.VLLM_RUN).trainer
    arithmetic_job.prepare(
        main_job.QUICK_TASK,
        main_job.SHAPE,
        main_job.QUICK_WARM_START,
        4 * trainer.rollout.prompts_per_step,
        directory,
        eval_max_tokens=trainer.rollout.max_response_tokens,
    )
    return directory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics_rows(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def run_summary(out_dir) -> dict:
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


@contextlib.contextmanager
def module_secret(directory) -> Iterator[str]:
    """$BAPO_RUN_SECRET_FILE set to a fresh secret in `directory` while the block runs: the
    module's shared server, the runs given its URL and their children all use it."""
    path = run_secret.new_secret_file(directory)
    old = os.environ.get(run_secret.SECRET_FILE_ENV)
    os.environ[run_secret.SECRET_FILE_ENV] = path
    try:
        yield path
    finally:
        if old is None:
            os.environ.pop(run_secret.SECRET_FILE_ENV, None)
        else:
            os.environ[run_secret.SECRET_FILE_ENV] = old


def auth(secret_file=None) -> dict[str, str]:
    """The bearer header of servers holding the secret in `secret_file` (a run's own:
    <out-dir>/vllm/run_secret; default $BAPO_RUN_SECRET_FILE's); {} without a secret."""
    path = secret_file or os.environ.get(run_secret.SECRET_FILE_ENV)
    if not path:
        return {}
    return {"Authorization": "Bearer " + run_secret.bearer_token(run_secret.read_secret(path))}


def weight_version(url: str, secret_file=None) -> str:
    reply = requests.get(url + "/weight_info", headers=auth(secret_file), timeout=10)
    return reply.json()["weight_version"]


def job(out_dir, warm_start, *args) -> subprocess.Popen:
    """`python -m experiments.cpu_arithmetic --engine vllm --quick` in `out_dir`, from the
    test module's warm start (read back, not trained again); output in out_dir/job.log."""
    if not os.path.exists(os.path.join(out_dir, "warm_start")):
        shutil.copytree(warm_start, os.path.join(out_dir, "warm_start"))
    cmd = [sys.executable, "-m", "experiments.cpu_arithmetic", "--engine", "vllm", "--quick"]
    cmd += ["--out-dir", str(out_dir), f"engine.server.port={free_port()}", *args]
    env = child_env()
    log = open(os.path.join(out_dir, "job.log"), "ab")  # noqa: SIM115 (closed by finish)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, out_dir, timeout_s: float = 1200) -> int:
    code = proc.wait(timeout=timeout_s)
    proc.stdout and proc.stdout.close()
    if code not in (0, -signal.SIGKILL):
        with open(os.path.join(out_dir, "job.log"), errors="replace") as f:
            print(f.read()[-6000:])
    return code


def check_loop(rows: list[dict], staleness: list[int]) -> None:
    """Every iteration synced the next version to the server (as its worker reports), trained
    only tokens the server says the scheduled version sampled, and the trainer's own
    log-probs of every trained token agree with vLLM's (fp32 on both sides)."""
    assert [r["sync/engine_version"] for r in rows] == list(range(1, len(rows) + 1))
    assert [r["staleness/mean"] for r in rows] == staleness
    for r in rows:
        assert r["version_mismatch/tokens"] == 0 and r["trained_tokens"] > 0
        assert r["agreement/tokens"] == r["trained_tokens"]
        assert r["agreement/mean_abs"] <= 1e-3 and r["agreement/max_abs"] < 1e-2, r
        assert r["time/sync_write"] > 0 and r["time/sync_load"] > 0
