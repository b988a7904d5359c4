"""MetricsLogger: JSONL rows, restart truncation, followers (any `MetricSink`; TensorBoard
through tensorboardX), summary, progress. W&B: tests/train/test_tracking.py."""

import dataclasses
import io
import json
import math
import os

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from bapo_jax.algorithms.registry import get_loss
from bapo_jax.train import plots
from bapo_jax.train.metrics import MetricsLogger, read_jsonl

QUIET = dict(tensorboard=False, plots=False, progress=False)


def _metrics(step):
    """Deterministic per-step metrics of every kind the trainer logs."""
    return {
        "reward/mean": 0.1 * step,
        "accuracy": np.float32(step / 8),
        "rho": jnp.asarray(0.3 + 0.01 * step, dtype=jnp.float32),
        "tokens": np.int64(1000 + step),
        "reached": step % 2 == 0,
        "phase": "warmup" if step < 2 else "main",
    }


def test_jsonl_rows_convert_values_and_write_null_for_non_finite(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=4, **QUIET)
    logger.log(0, _metrics(0))
    logger.log(np.int64(3), {"loss": math.nan, "grad_norm": -math.inf, "n": jnp.int32(7)})
    # Each row is on disk (flushed and fsync'd) before close.
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    logger.close()

    assert rows == [
        {"step": 0, "reward/mean": 0.0, "accuracy": 0.0, "rho": float(np.float32(0.3)),
         "tokens": 1000, "reached": True, "phase": "warmup"},
        {"step": 3, "loss": None, "grad_norm": None, "n": 7},
    ]  # fmt: skip
    assert [type(v) for v in rows[0].values()] == [int, float, float, float, int, bool, str]
    text = (tmp_path / "metrics.jsonl").read_text()
    assert text.endswith("\n") and "NaN" not in text and "Infinity" not in text
    assert list(logger.history) == ["reward/mean", "accuracy", "rho", "tokens", "reached",
                                    "loss", "grad_norm", "n"]  # fmt: skip
    assert logger.history["reached"] == ([0], [1.0])
    assert math.isnan(logger.history["loss"][1][0])
    assert logger.history["grad_norm"] == ([3], [-math.inf])


def test_resume_drops_later_rows_and_a_torn_line(tmp_path, monkeypatch):
    straight = tmp_path / "straight"
    logger = MetricsLogger(straight, total_steps=8, **QUIET)
    for step in range(8):
        logger.log(step, _metrics(step))
    logger.close()

    # Killed while writing step 6; the last checkpoint covers step 3.
    restarted = tmp_path / "restarted"
    logger = MetricsLogger(restarted, total_steps=8, **QUIET)
    for step in range(6):
        logger.log(step, _metrics(step))
    logger.close()
    with open(restarted / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "reward/me')

    replaced = []
    real_replace = os.replace
    monkeypatch.setattr(
        plots.os, "replace", lambda src, dst: (replaced.append((src, dst)), real_replace(src, dst))
    )
    logger = MetricsLogger(restarted, total_steps=8, resume_step=3, **QUIET)
    assert [row["step"] for row in read_jsonl(restarted / "metrics.jsonl")] == [0, 1, 2, 3]
    assert logger.history["reward/mean"][0] == [0, 1, 2, 3]
    (src, dst), = replaced  # fmt: skip
    assert dst == restarted / "metrics.jsonl"
    assert os.path.dirname(src) == str(restarted)  # same filesystem: os.replace is atomic
    for step in range(4, 8):
        logger.log(step, _metrics(step))
    logger.close()

    assert (restarted / "metrics.jsonl").read_bytes() == (straight / "metrics.jsonl").read_bytes()
    assert sorted(os.listdir(restarted)) == ["metrics.jsonl"]  # no temp file left


def test_fresh_start_replaces_old_rows(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=3, **QUIET)
    logger.log(0, {"x": 1.0})
    logger.log(1, {"x": 2.0})
    logger.close()
    logger = MetricsLogger(tmp_path, total_steps=3, **QUIET)
    assert read_jsonl(tmp_path / "metrics.jsonl") == []
    logger.log(0, {"x": 5.0})
    logger.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 0, "x": 5.0}]


class _RecordingSink:
    """A follower built on the interface alone (`tracking.MetricSink`, not subclassed)."""

    def __init__(self, *, start_step):
        self.start_step, self.rows, self.images, self.closed = start_step, [], [], False

    def log(self, step, values, images):
        assert not self.closed
        self.rows.append({"step": step, **values})
        self.images.append((step, sorted(images)))

    def add_images(self, step, images):
        self.images.append((step, sorted(images)))

    def close(self):
        self.closed = True


def _as_in_jsonl(row):
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}


def test_a_follower_gets_the_jsonl_rows_and_after_a_resume_only_the_later_ones(tmp_path):
    sinks = []

    def open_recorder(*, start_step):
        sinks.append(_RecordingSink(start_step=start_step))
        return sinks[-1]

    def metrics(step):
        return {**_metrics(step), "grad_norm": math.inf if step in (1, 6) else 0.5}

    common = dict(total_steps=8, followers=[open_recorder], tensorboard=False, progress=False)
    logger = MetricsLogger(tmp_path, plots=False, **common)
    for step in range(6):
        logger.log(step, metrics(step))
    logger.close()
    killed_rows = read_jsonl(tmp_path / "metrics.jsonl")
    (first,) = sinks
    assert first.start_step == 0 and first.closed
    assert [_as_in_jsonl(row) for row in first.rows] == killed_rows
    assert first.rows[1]["grad_norm"] == math.inf  # the real value; the file holds null

    logger = MetricsLogger(tmp_path, resume_step=3, plot_every=3, **common)
    for step in range(4, 8):
        logger.log(step, metrics(step))
    logger.close()
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    resumed = sinks[1]
    assert [row["step"] for row in rows] == list(range(8))
    assert resumed.start_step == 4 and resumed.closed
    assert [_as_in_jsonl(row) for row in resumed.rows] == rows[4:]
    # PNGs: refreshed at the third call (step 6), redrawn at close for the last row (step 7).
    pngs = sorted(f"plots/{path.stem}" for path in (tmp_path / "plots").glob("*.png"))
    assert pngs and resumed.images == [(4, []), (5, []), (6, pngs), (7, []), (7, pngs)]


def test_a_follower_that_fails_to_open_closes_those_opened_before_it(tmp_path):
    opened = []

    def open_recorder(*, start_step):
        opened.append(_RecordingSink(start_step=start_step))
        return opened[-1]

    def fail(*, start_step):
        raise RuntimeError(f"backend down at {start_step}")

    with pytest.raises(RuntimeError, match="backend down at 3"):
        MetricsLogger(tmp_path, total_steps=4, resume_step=2, followers=[open_recorder, fail],
                      **QUIET)  # fmt: skip
    (recorder,) = opened
    assert recorder.closed and recorder.start_step == 3


def test_corrupt_complete_line_is_an_error(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON row"):
        MetricsLogger(tmp_path, total_steps=3, resume_step=1, **QUIET)
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"x": 1}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: a row must be an object with an int"):
        read_jsonl(tmp_path / "metrics.jsonl")


def test_bad_arguments_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="total_steps must be an int >= 1, got 0"):
        MetricsLogger(tmp_path, total_steps=0, **QUIET)
    with pytest.raises(ValueError, match="resume_step must be an int >= 0, got -1"):
        MetricsLogger(tmp_path, total_steps=3, resume_step=-1, **QUIET)
    with pytest.raises(ValueError, match="plot_every must be an int >= 1, got 0"):
        MetricsLogger(tmp_path, total_steps=3, plot_every=0, **QUIET)

    logger = MetricsLogger(tmp_path, total_steps=3, resume_step=1, **QUIET)
    with pytest.raises(ValueError, match="step must be greater than the last step 1, got 1"):
        logger.log(1, {"x": 1.0})
    with pytest.raises(ValueError, match="step must be an int, got True"):
        logger.log(True, {"x": 1.0})
    with pytest.raises(ValueError, match="other than 'step', got 'step'"):
        logger.log(2, {"step": 1.0})
    with pytest.raises(ValueError, match=r"metric 'v' must be a scalar, got shape \(2,\)"):
        logger.log(2, {"v": np.zeros(2)})
    with pytest.raises(ValueError, match="metric 'v' must be a number, bool or str, got NoneType"):
        logger.log(2, {"v": None})
    logger.log(2, {"x": 1.0})
    logger.close()
    with pytest.raises(RuntimeError, match="after close"):
        logger.log(3, {"x": 1.0})
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"step": 2, "x": 1.0}]


@dataclasses.dataclass(frozen=True)
class _Config:
    rho0: float
    bounds: tuple[float, float]


def test_summary_json_is_written_on_close(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=1, **QUIET)
    logger.close(
        summary={
            "final": {"accuracy": np.float32(0.5), "steps": np.int64(1)},
            "curve": jnp.arange(3),
            "diverged": math.nan,
            "out": tmp_path / "x",
            "config": _Config(rho0=0.4, bounds=(0.6, 1.2)),
        }
    )
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary == {
        "final": {"accuracy": 0.5, "steps": 1},
        "curve": [0, 1, 2],
        "diverged": None,
        "out": str(tmp_path / "x"),
        "config": {"rho0": 0.4, "bounds": [0.6, 1.2]},
    }
    assert sorted(os.listdir(tmp_path)) == ["metrics.jsonl", "summary.json"]

    logger = MetricsLogger(tmp_path / "bad", total_steps=1, **QUIET)
    with pytest.raises(ValueError, match=r"summary\['cfg'\]\['f'\] is not JSON-serialisable"):
        logger.close(summary={"cfg": {"f": object()}})


def test_tensorboard_scalars_and_restart(tmp_path):
    common = dict(total_steps=8, plots=False, progress=False)
    logger = MetricsLogger(tmp_path, **common)
    for step in range(6):
        logger.log(step, {**_metrics(step), "run": 1.0, "only_old": 1.0})
    logger.close()
    logger = MetricsLogger(tmp_path, resume_step=2, **common)
    for step in range(3, 8):
        logger.log(step, {**_metrics(step), "run": 2.0})
    logger.close()

    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    assert sorted(acc.Tags()["scalars"]) == sorted(  # strings are not scalars
        ["reward/mean", "accuracy", "rho", "tokens", "reached", "run", "only_old"]
    )
    # The restart purges every tag, also one the resumed run never logs again.
    assert [e.step for e in acc.Scalars("only_old")] == [0, 1, 2]
    run = [(e.step, e.value) for e in acc.Scalars("run")]
    assert run == [(s, 1.0 if s < 3 else 2.0) for s in range(8)]
    reward = [(e.step, e.value) for e in acc.Scalars("reward/mean")]
    assert reward == [(s, float(np.float32(0.1 * s))) for s in range(8)]
    assert [e.value for e in acc.Scalars("reached")] == [1.0, 0.0] * 4


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_progress_prints_one_line_per_log_when_not_a_terminal(tmp_path):
    stream = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=10, resume_step=2, stream=stream,
                           tensorboard=False, plots=False,
                           progress_fields=(("rho", "rho", ".3g"),))  # fmt: skip
    for step in (3, 4, 5):
        logger.log(step, {"reward/mean": 0.5, "rho": 0.25, "tokens_per_s": 1234.4, "other": 9.0})
    logger.close()
    lines = stream.getvalue().split("\n")
    assert lines[-1] == "" and len(lines) == 4
    for line, done in zip(lines[:3], (4, 5, 6), strict=True):
        assert line.startswith("train:") and f"{done}/10" in line
        assert line.endswith("reward=0.5, rho=0.25, tok/s=1234]")
        assert "\r" not in line


def test_progress_bar_on_a_terminal_and_off(tmp_path):
    terminal = _Terminal()
    logger = MetricsLogger(
        tmp_path,
        total_steps=10,
        stream=terminal,
        tensorboard=False,
        plots=False,
        progress_fields=get_loss("bapo").progress,
    )  # the loss declares them
    for step in range(3):
        logger.log(step, {"c_low": 0.6, "c_high": 1.25})
    logger.close()
    out = terminal.getvalue()
    assert "\r" in out and "3/10" in out and "c_low=0.6, c_high=1.25" in out

    silent = _Terminal()
    logger = MetricsLogger(tmp_path, total_steps=10, stream=silent, **QUIET)
    logger.log(0, {"c_low": 0.6})
    logger.close()
    assert silent.getvalue() == ""
