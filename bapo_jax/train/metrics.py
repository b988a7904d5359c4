"""Run observability for the RL trainer: metrics.jsonl (the record), PNG plots, and the
record's followers: TensorBoard, W&B, a progress bar.

    logger = MetricsLogger(out_dir, total_steps=N, resume_step=None)
    logger.log(step, {"reward/mean": 0.41, "rho": 0.37, ...})   # one row per RL iteration
    logger.close(summary={...})                                  # final plots, summary.json

Steps are 0-based RL iteration indices and strictly increasing. Outputs under out_dir:
- metrics.jsonl: one `{"step": s, **metrics}` object per `log` call, flushed and fsync'd.
  Values are converted to Python bool/int/float/str (numpy and JAX 0-d arrays included).
  Strict JSON has no NaN/inf, so a non-finite float is written as `null`; it reads back as
  NaN (the followers and the in-memory history get the real value).
- plots/*.png: see `bapo_jax.train.plots`; refreshed every `plot_every` log calls and at close.
- summary.json: written atomically by `close(summary=...)`.
- followers, each handed every row written (with the PNGs refreshed at its step) through
  `tracking.MetricSink` alone, so no backend has code here (`bapo_jax.train.tracking`): tb/
  holds the numeric metrics as TensorBoard scalars; with `wandb=WandbOptions(...)`, wandb/ and
  wandb_run.json hold the same in a W&B run, `run_config` as its config and each refreshed
  PNG as an image `plots/<name>`; the progress is a tqdm bar on stderr over total_steps, or one
  plain line per row when the stream is not a terminal (CI logs); and any `followers` given.

Resume is decided here, once. `resume_step=s` means the run restarted from a checkpoint taken
after step s: rows with step > s are dropped from metrics.jsonl (atomic rewrite: temp file +
os.replace), as is a torn last line (text after the last newline: the process died
mid-write), so after the restarted run re-logs s+1, s+2, ... the file equals an uninterrupted
run's. The plots' history is reloaded from the kept rows.
`resume_step=None` is a fresh start: existing rows are all dropped (a crash before the first
checkpoint restarts from step 0). Each follower then opens with start_step = s + 1 (0 when
fresh), the first step it will get: the bar starts with that many steps done, TensorBoard hides
the killed run's events at steps >= start_step, W&B continues the same run and skips the steps
it already holds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import numpy as np
from tqdm import tqdm

from bapo_jax.checks import check_int
from bapo_jax.train import tracking
from bapo_jax.train.plots import OVERVIEW_NAME, render_plots, write_atomically
from bapo_jax.train.tracking import Images, Scalar

__all__ = ["MetricsLogger", "read_jsonl", "to_scalar"]

_log = logging.getLogger(__name__)

ProgressField = tuple[str, str, str]  # metric key, short label, format
# Progress-bar postfix: these, with the loss's own (`LossSpec.progress`) after the entropy.
_POSTFIX_HEAD = (
    ("reward/mean", "reward", ".3g"),
    ("accuracy", "acc", ".3g"),
    ("entropy", "ent", ".3g"),
)
_POSTFIX_TAIL = (
    ("tokens_per_s", "tok/s", ".0f"),
    ("mfu", "mfu", ".1%"),
)


def to_scalar(key: str, value: Any) -> Scalar:
    """A metric value as a Python bool/int/float/str; 0-d numpy/JAX arrays are unwrapped."""
    if isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    if isinstance(value, np.generic) or hasattr(value, "__array__"):
        array = np.asarray(value)
        if array.ndim != 0:
            raise ValueError(f"metric {key!r} must be a scalar, got shape {array.shape}")
        if array.dtype.kind in "biuf":
            return array.item()
    raise ValueError(f"metric {key!r} must be a number, bool or str, got {type(value).__name__}")


def _json_value(value: Scalar) -> Scalar | None:
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _jsonable(obj: Any, where: str) -> Any:
    """`obj` as plain JSON data for summary.json: dataclasses as dicts, numpy/JAX arrays as
    (nested) lists, paths as strings, non-finite floats as None."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = dataclasses.asdict(obj)
    if isinstance(obj, Mapping):
        return {str(k): _jsonable(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if obj is None:
        return None
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    if hasattr(obj, "__array__") and np.asarray(obj).ndim > 0:
        return _jsonable(np.asarray(obj).tolist(), where)
    try:
        return _json_value(to_scalar(where, obj))
    except ValueError:
        raise ValueError(f"{where} is not JSON-serialisable: {type(obj).__name__}") from None


def _read_rows(path: str | os.PathLike) -> tuple[list[dict[str, Any]], bool]:
    text = Path(path).read_text(encoding="utf-8")
    # Every complete row ends in "\n"; whatever follows the last "\n" is a torn write.
    *lines, tail = text.split("\n")
    rows = []
    for number, line in enumerate(lines, start=1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not a JSON row ({error})") from None
        step = row.get("step") if isinstance(row, dict) else None
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{path}:{number}: a row must be an object with an int step")
        rows.append(row)
    return rows, bool(tail)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; a torn last line (no trailing newline) is dropped.

    Raises ValueError naming the line for a complete line that is not a JSON object with an
    integer "step" (torn writes only ever cut the last line, so that is corruption).
    """
    return _read_rows(path)[0]


class _Progress(tracking.MetricSink):
    """Follows with a tqdm bar on a terminal, one plain status line per row otherwise."""

    def __init__(
        self, total: int, stream: TextIO, fields: Sequence[ProgressField], *, start_step: int
    ):
        self._total, self._initial, self._stream = total, start_step, stream
        self._fields = (*_POSTFIX_HEAD, *fields, *_POSTFIX_TAIL)
        self._start = time.monotonic()
        self._bar = tqdm(
            total=total, initial=start_step, file=stream, unit="step", desc="train",
            dynamic_ncols=True,
        ) if stream.isatty() else None  # fmt: skip

    def log(self, step: int, values: Mapping[str, Scalar], images: Images) -> None:
        postfix = ", ".join(
            f"{label}={values[key]:{fmt}}"
            for key, label, fmt in self._fields
            if isinstance(values.get(key), int | float)
        )
        if self._bar is not None:
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.update(step + 1 - self._bar.n)
            return
        line = tqdm.format_meter(
            n=step + 1, total=self._total, elapsed=time.monotonic() - self._start,
            initial=self._initial, prefix="train", unit="step", postfix=postfix or None,
            ascii=True,
        )  # fmt: skip
        self._stream.write(line + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class MetricsLogger:
    """Writes each RL iteration's metrics to metrics.jsonl and PNG plots, and hands each row to
    its followers: TensorBoard, W&B, the progress bar and any given (see the module docstring).

    Args:
      out_dir: run directory (created).
      total_steps: number of RL iterations of the whole run (progress bar length).
      resume_step: None for a fresh run, else the last step the resumed checkpoint covers.
      plot_every: refresh the PNGs every this many `log` calls (and always at `close`).
      tensorboard, plots, progress: switch each output on or off.
      progress_fields: the loss's own progress-bar fields (metric key, label, format).
      stream: where the progress goes (default sys.stderr).
      wandb: log to Weights & Biases too (None: off; wandb is then never imported).
      run_config: the run's configuration, recorded as the W&B run's config.
      followers: more followers, each opened with the start step and then handed every row.
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        *,
        total_steps: int,
        resume_step: int | None = None,
        plot_every: int = 1,
        tensorboard: bool = True,
        plots: bool = True,
        progress: bool = True,
        progress_fields: Sequence[ProgressField] = (),
        stream: TextIO | None = None,
        wandb: tracking.WandbOptions | None = None,
        run_config: Mapping[str, Any] | None = None,
        followers: Sequence[tracking.OpenSink] = (),
    ):
        self.total_steps = check_int("total_steps", total_steps, 1)
        if resume_step is not None:
            resume_step = check_int("resume_step", resume_step, 0)
        self.plot_every = check_int("plot_every", plot_every, 1)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._plots = plots
        self._last_step = -1 if resume_step is None else resume_step
        # Numeric metric curves: key -> (steps, values as floats, NaN for null).
        self.history: dict[str, tuple[list[int], list[float]]] = {}
        self._calls = self._plotted_at = 0
        self._closed = False

        # W&B first: a failing wandb.init (not logged in, no network) opens nothing after it.
        opens: list[tracking.OpenSink] = []
        if wandb is not None:
            opens.append(partial(tracking.WandbRun, self.out_dir, wandb, config=run_config))
        if tensorboard:
            opens.append(partial(tracking.TensorBoardWriter, self.out_dir / "tb"))
        opens.extend(followers)
        if progress:
            stream = stream or sys.stderr
            opens.append(partial(_Progress, self.total_steps, stream, progress_fields))
        # The record first; whatever fails after it closes what was opened (ExitStack).
        with contextlib.ExitStack() as opened:
            for row in self._truncate_jsonl(self._last_step):
                self._remember(row["step"], {k: v for k, v in row.items() if k != "step"})
            self._jsonl = opened.enter_context(open(self.jsonl_path, "a", encoding="utf-8"))
            self._followers: list[tracking.MetricSink] = []
            for open_sink in opens:
                self._followers.append(open_sink(start_step=self._last_step + 1))
                opened.callback(self._followers[-1].close)
            self._opened = opened.pop_all()  # `close` closes them, the followers first

    @property
    def jsonl_path(self) -> Path:
        return self.out_dir / "metrics.jsonl"

    def _truncate_jsonl(self, keep_to: int) -> list[dict[str, Any]]:
        if not self.jsonl_path.exists():
            return []
        rows, torn = _read_rows(self.jsonl_path)
        kept = [row for row in rows if row["step"] <= keep_to]
        if len(kept) != len(rows) or torn:
            _log.warning(
                "%s: restart after step %d drops %d rows%s",
                self.jsonl_path, keep_to, len(rows) - len(kept), " and a torn line" if torn else "",
            )  # fmt: skip
        text = "".join(json.dumps(row) + "\n" for row in kept)
        write_atomically(self.jsonl_path, text.encode("utf-8"))
        return kept

    def _remember(self, step: int, values: Mapping[str, Scalar | None]) -> None:
        for key, value in values.items():
            if value is None or isinstance(value, bool | int | float):
                steps, series = self.history.setdefault(key, ([], []))
                steps.append(step)
                series.append(math.nan if value is None else float(value))

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Records one RL iteration's metrics (validated, converted, written, followed)."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log called after close()")
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            raise ValueError(f"step must be an int, got {step!r}")
        if step <= self._last_step:
            raise ValueError(
                f"step must be greater than the last step {self._last_step}, got {step}"
            )
        values: dict[str, Scalar] = {}
        for key, value in metrics.items():
            if not isinstance(key, str) or not key or key == "step":
                raise ValueError(
                    f"metric names must be non-empty strings other than 'step', got {key!r}"
                )
            values[key] = to_scalar(key, value)
        step = int(step)
        self._last_step = step
        self._calls += 1
        row = {"step": step, **{k: _json_value(v) for k, v in values.items()}}
        self._jsonl.write(json.dumps(row, allow_nan=False) + "\n")
        self._jsonl.flush()
        os.fsync(self._jsonl.fileno())
        self._remember(step, values)
        due = self._plots and self._calls % self.plot_every == 0
        images = self._plot() if due else {}
        for follower in self._followers:
            follower.log(step, values, images)

    def _plot(self) -> dict[str, Path]:
        """Redraws the PNGs; returns them as {"plots/<name>": path} (W&B image keys)."""
        plots_dir = self.out_dir / "plots"
        drawn = render_plots(self.history, plots_dir)
        self._plotted_at = self._calls
        names = [panel.filename for panel in drawn] + ([OVERVIEW_NAME] if drawn else [])
        return {f"plots/{Path(name).stem}": plots_dir / name for name in names}

    def close(self, summary: Mapping[str, Any] | None = None) -> None:
        """Final plots, closes the followers and the file; writes summary.json if given."""
        if self._closed:
            raise RuntimeError("MetricsLogger.close called twice")
        self._closed = True
        if self._plots and self._plotted_at != self._calls:
            images = self._plot()  # a step was logged since the last refresh: `_last_step`
            for follower in self._followers:
                follower.add_images(self._last_step, images)
        self._opened.close()
        if summary is not None:
            text = json.dumps(_jsonable(summary, "summary"), indent=2, allow_nan=False)
            write_atomically(self.out_dir / "summary.json", (text + "\n").encode("utf-8"))
