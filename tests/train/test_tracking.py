"""TensorBoard (tensorboardX) and W&B (offline) logging, each read back by its own tool's reader.

TensorBoard: `EventAccumulator` and `plugin_event_accumulator` (tensorboard's loaders).
W&B 0.31 moved its transaction-log reader into the Go `wandb-core`; the Python package keeps
the record schema (`wandb.proto.wandb_internal_pb2.Record`), so `_wandb_files` frames the
`.wandb` file (a LevelDB log: ":W&B" header, 32 KiB blocks of CRC-checked chunks) and decodes
every record with it.
"""

from __future__ import annotations

import json
import os
import struct
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing import event_accumulator, plugin_event_accumulator
from tensorboard.util import tensor_util

from bapo_jax.train.config import LoggingConfig
from bapo_jax.train.metrics import MetricsLogger
from bapo_jax.train.tracking import STATE_FILE, WandbOptions, WandbRun, run_config

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

OFFLINE = WandbOptions(project="bapo-jax-tests", mode="offline")
QUIET = dict(plots=False, progress=False)
_BLOCK, _CHUNK_HEADER = 32768, 7
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@pytest.fixture(autouse=True, scope="module")
def offline_wandb(tmp_path_factory):
    """No network, no output, wandb's own config/cache under a temp dir; torn down after."""
    home = tmp_path_factory.mktemp("wandb_home")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WANDB_MODE", "offline")
        patch.setenv("WANDB_SILENT", "true")
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            patch.setenv(var, str(home))
        patch.delenv("WANDB_API_KEY", raising=False)
        yield
        wandb.teardown()


def _records(path: Path):
    """Every Record of one `.wandb` transaction log, in order (a torn tail ends the scan)."""
    blob = path.read_bytes()
    assert blob[:7] == b":W&B" + struct.pack("<HB", 0xBEE1, 0), f"{path}: not a W&B log"
    offset, pending = 7, b""
    while True:
        if _BLOCK - offset % _BLOCK < _CHUNK_HEADER:  # a block's tail too short for a header
            offset += _BLOCK - offset % _BLOCK
        if offset + _CHUNK_HEADER > len(blob):
            return
        crc, length, kind = struct.unpack("<IHB", blob[offset : offset + _CHUNK_HEADER])
        data = blob[offset + _CHUNK_HEADER : offset + _CHUNK_HEADER + length]
        if len(data) < length:
            return
        assert crc == zlib.crc32(data, zlib.crc32(bytes([kind]))), f"{path}: CRC at {offset}"
        offset += _CHUNK_HEADER + length
        pending = data if kind in (_FULL, _FIRST) else pending + data
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def _finished_records(path: Path, timeout: float = 60.0) -> list:
    """The records of a finished run's log. `run.finish()` returns once wandb-core has handled
    the exit, but its writer goroutine may still be flushing the file (seen here: 7 bytes right
    after finish, the whole log a moment later), so wait for the `exit` record, written last."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(_records(path))
        if records and records[-1].WhichOneof("record_type") == "exit":
            return records
        if time.monotonic() > deadline:
            raise AssertionError(f"{path}: no exit record {timeout} s after the run finished")
        time.sleep(0.05)


def _wandb_files(out_dir) -> list[dict]:
    """Each offline run file under out_dir/wandb: id, config and history rows, by start time."""
    runs = []
    for path in (Path(out_dir) / "wandb").glob("offline-run-*/run-*.wandb"):
        run = {"path": path, "config": {}, "history": []}
        for record in _finished_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["id"], run["start"] = record.run.run_id, record.run.start_time.ToNanoseconds()
                for item in record.run.config.update:
                    run["config"][item.key] = json.loads(item.value_json)
            elif kind == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                run["history"].append(items)
        runs.append(run)
    return sorted(runs, key=lambda run: run["start"])


def _wandb_scalars(runs) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over all files, as W&B will hold them (images left out)."""
    out: dict[str, list] = {}
    for run in runs:
        for row in run["history"]:
            for key, value in row.items():
                if not key.startswith("_") and not key.startswith("plots/"):
                    out.setdefault(key, []).append((row["_step"], float(value)))
    return out


def _tb_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _plugin_steps(logdir, tag) -> list[tuple[int, float]]:
    """The same through plugin_event_accumulator (tensorboard --load_fast=false)."""
    acc = plugin_event_accumulator.EventAccumulator(str(logdir), size_guidance={"tensors": 0})
    acc.Reload()
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(tag)]


def _as_float32(scalars):
    """Values rounded to float32 as TensorBoard stores them; NaN as "nan" so == compares it."""
    return {
        tag: [(s, "nan" if np.isnan(v) else float(np.float32(v))) for s, v in points]
        for tag, points in scalars.items()
    }


def _metrics(step, run=1.0):
    loss = float("nan") if step == 2 else 1.0 / (step + 1)
    return {"reward/mean": 0.1 * step, "grad_norm": 1000 + step, "reached": step % 2 == 0,
            "loss": loss, "phase": "x", "run": run}  # fmt: skip


def test_wandb_offline_holds_the_tensorboard_scalars_config_and_plots(tmp_path):
    config = {"trainer": {"steps": 4, "logging": {"wandb": True}}}
    logger = MetricsLogger(tmp_path, total_steps=4, plot_every=3, progress=False,
                           wandb=OFFLINE, run_config=config)  # fmt: skip
    for step in range(4):
        logger.log(step, _metrics(step))
    logger.close()

    (run,) = _wandb_files(tmp_path)
    tb = _tb_scalars(tmp_path / "tb")
    assert sorted(tb) == ["grad_norm", "loss", "reached", "reward/mean", "run"]  # no strings
    assert _as_float32(_wandb_scalars([run])) == _as_float32(tb)  # TensorBoard keeps float32
    assert tb["reward/mean"] == [(s, float(np.float32(0.1 * s))) for s in range(4)]
    assert np.isnan(dict(tb["loss"])[2])
    assert run["config"]["trainer"] == config["trainer"]
    assert json.loads((tmp_path / STATE_FILE).read_text()) == {"run_id": run["id"], "last_step": 3}
    # The PNGs at the refresh (call 3: step 2) and at close (step 3), merged into their rows.
    pngs = ["plots/grad_norm", "plots/overview", "plots/reward_accuracy"]
    images = {
        row["_step"]: sorted(k[:-6] for k in row if k.endswith("/_type")) for row in run["history"]
    }
    assert images == {0: [], 1: [], 2: pngs, 3: pngs}
    media = list(run["path"].parent.glob("files/media/images/plots/*.png"))
    assert len(media) == 6


def test_resumed_run_continues_the_same_wandb_run_without_repeating_a_step(tmp_path):
    """Killed after logging step 5, resumed from the checkpoint after step 3, runs to step 7."""
    common = dict(total_steps=8, wandb=OFFLINE, **QUIET)
    logger = MetricsLogger(tmp_path, **common)
    for step in range(6):
        logger.log(step, _metrics(step, run=1.0))
    logger.close()
    first_id = json.loads((tmp_path / STATE_FILE).read_text())["run_id"]

    logger = MetricsLogger(tmp_path, resume_step=3, **common)
    for step in range(4, 8):
        logger.log(step, _metrics(step, run=2.0))
    logger.close()

    runs = _wandb_files(tmp_path)
    assert [run["id"] for run in runs] == [first_id, first_id]
    steps = [row["_step"] for run in runs for row in run["history"]]
    assert steps == list(range(8))  # each step once: 4 and 5 stay the killed run's
    assert _wandb_scalars(runs)["run"] == [(s, 1.0 if s <= 5 else 2.0) for s in range(8)]
    assert json.loads((tmp_path / STATE_FILE).read_text()) == {"run_id": first_id, "last_step": 7}

    # TensorBoard shows every step once, the resumed run's values after the checkpoint.
    expected = [(s, 1.0 if s <= 3 else 2.0) for s in range(8)]
    assert _tb_scalars(tmp_path / "tb")["run"] == expected
    assert _plugin_steps(tmp_path / "tb", "run") == expected
    assert len(os.listdir(tmp_path / "tb")) == 2  # likely the same second: names still order

    # A fresh start (no checkpoint) in the same directory is a new W&B run from step 0.
    logger = MetricsLogger(tmp_path, total_steps=2, wandb=OFFLINE, **QUIET)
    logger.log(0, _metrics(0, run=3.0))
    logger.close()
    fresh = _wandb_files(tmp_path)[-1]
    assert fresh["id"] != first_id and [row["_step"] for row in fresh["history"]] == [0]
    assert _tb_scalars(tmp_path / "tb")["run"] == [(0, 3.0)]  # the old files are purged


def test_plots_redrawn_at_close_never_repeat_a_step_wandb_already_holds(tmp_path):
    """Killed after step 5, resumed after step 3, killed again after re-logging 4 and 5: W&B
    skips both rows, so the close-time PNGs of step 5 must not reach it either."""
    logger = MetricsLogger(tmp_path, total_steps=8, wandb=OFFLINE, **QUIET)
    for step in range(6):
        logger.log(step, _metrics(step))
    logger.close()
    logger = MetricsLogger(tmp_path, total_steps=8, resume_step=3, plot_every=10,
                           progress=False, tensorboard=False, wandb=OFFLINE)  # fmt: skip
    logger.log(4, _metrics(4))
    logger.log(5, _metrics(5))
    logger.close()
    assert (tmp_path / "plots" / "overview.png").exists()  # drawn at close
    first, resumed = _wandb_files(tmp_path)
    assert [row["_step"] for row in first["history"]] == list(range(6))
    assert resumed["id"] == first["id"] and resumed["history"] == []


def test_wandb_errors_name_the_setting(tmp_path, monkeypatch):
    (tmp_path / STATE_FILE).write_text('{"run_id": 7}')
    with pytest.raises(ValueError, match=r"wandb_run\.json: want .*run_id"):
        WandbRun(tmp_path, OFFLINE, start_step=4)
    with pytest.raises(ValueError, match=r"logging\.wandb_mode must be one of"):
        WandbRun(tmp_path, WandbOptions(mode="shared"), start_step=0)
    with pytest.raises(ValueError, match=r"wandb_mode must be one of \('offline', 'online'\)"):
        LoggingConfig(wandb=True, wandb_mode="dryrun")
    with pytest.raises(ValueError, match="wandb_project must be a non-empty string"):
        LoggingConfig(wandb_project=" ")
    with pytest.raises(ValueError, match="wandb_entity must be None or a non-empty string"):
        LoggingConfig(wandb_entity="")
    assert WandbOptions.from_logging(LoggingConfig()) is None
    on = LoggingConfig(wandb=True, wandb_run_name="r1", wandb_entity="me")
    assert WandbOptions.from_logging(on) == WandbOptions(entity="me", run_name="r1")

    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ImportError, match=r"logging\.wandb=true needs the wandb package"):
        MetricsLogger(tmp_path / "none", total_steps=1, wandb=OFFLINE, **QUIET)


def test_run_config_prefers_the_cli_config_json_of_this_trainer(tmp_path):
    trainer = {"steps": 3, "logging": {"wandb": True}}
    assert run_config(tmp_path, trainer) == {"trainer": trainer}
    whole = {"trainer": trainer, "model": {"preset": "tiny"}, "mesh": "cpu1"}
    (tmp_path / "config.json").write_text(json.dumps(whole))
    assert run_config(tmp_path, trainer) == whole
    assert run_config(tmp_path, {**trainer, "steps": 4}) == {"trainer": {**trainer, "steps": 4}}


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_trainer_logs_to_wandb_what_it_logs_to_tensorboard(tmp_path):
    import dataclasses

    from bapo_jax import overrides
    from tests.train.loop_fixtures import make_trainer, small_config

    base = small_config(steps=2)
    config = dataclasses.replace(
        base, logging=dataclasses.replace(base.logging, wandb=True, wandb_project="bapo-jax-tests")
    )
    make_trainer(config, tmp_path).run()

    (run,) = _wandb_files(tmp_path)
    tb = _tb_scalars(tmp_path / "tb")
    assert "reward/mean" in tb and "c_high" in tb
    assert _as_float32(_wandb_scalars([run])) == _as_float32(tb)
    assert [row["_step"] for row in run["history"]] == [0, 1]
    assert run["config"]["trainer"] == overrides.config_to_dict(config)
