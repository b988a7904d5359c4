"""Followers of metrics.jsonl behind one interface, `MetricSink`: TensorBoard (tensorboardX)
and Weights & Biases. `MetricsLogger` decides resume and opens each follower (`OpenSink`) with
`start_step`, the first step it will hand it: 0 on a fresh start, s + 1 after a resume from the
checkpoint taken after step s (the trainer then re-logs s+1, s+2, ...). Earlier rows at steps
>= start_step are stale; neither backend ever shows a step twice. Both take the same `numeric`
values (bools as 0/1, strings dropped) under the same tags at the same step, the 0-based RL
iteration index.

TensorBoard. tensorboardX's `SummaryWriter(logdir, purge_step=start_step)` opens a new event
file whose first events are a file version and a SessionLog START at `start_step`; readers
drop every earlier-read event with step >= that START's step:
- the Python loaders (`EventAccumulator`; `plugin_event_accumulator` behind
  `tensorboard --load_fast=false`) purge on START, but `plugin_event_accumulator` ignores the
  FIRST START of a directory (it marks a start, not a restart). So a fresh run passes
  purge_step=0 as well: every file carries a START, and a resumed file's START at s+1 is never
  the first one. A fresh run in a directory with old files purges all of them.
- the Rust data server (default `--load_fast`) preempts per tag: a value at step k drops the
  tag's stored values at steps >= k (stale steps of a tag never logged again stay visible).
Readers read a directory's files in name order. tensorboardX names a file
`events.out.tfevents.<unix seconds>.<host><suffix>` and opens it with "wb" (same second, same
name: the old file would be truncated), so the suffix here is `.<time_ns>.<pid>`, zero-padded:
a restart within the same second still gets a new file that sorts after the old one.
All of a step's scalars go into one Event (`file_writer.add_summary`, exact tags: no
`_clean_tag` renaming, no per-NaN warning). tensorboardX writes on a background thread;
`flush_secs=1` plus a flush per step keep the file at most about a second behind, so a run
killed hard may miss its last second of points (a gap before the checkpoint, never a stale
step); `close` drains everything.

Weights & Biases (optional: `LoggingConfig.wandb`, `pip install -e '.[wandb]'`). `wandb` is
imported only when it is on. The run writes under `<out_dir>/wandb/` (offline:
`offline-run-<time>-<id>/`, upload later with `wandb sync <out_dir>/wandb/offline-run-*`).
System-metrics sampling and console capture are off unless `wandb_system_metrics`.
Resume: `<out_dir>/wandb_run.json` = {"run_id", "last_step"} is written atomically before
`wandb.init` on a fresh start and before every `run.log`. A resumed follower (start_step > 0)
re-opens the same run (`wandb.init(id=..., resume="allow")`) and skips every step <= last_step
(online also <= the server's last step): W&B never takes a step below its last one (online it
drops such a row with a warning; a resumed offline run writes a new local file that takes any
step, so the repeats would only meet the server at `wandb sync`), and a local offline file
cannot be rewound (`resume_from=<id>?_step=` rewinds only on the server, in beta). Steps
start_step..last_step therefore keep the killed run's values, which the restored run
recomputes anyway (same state, RNG and data). last_step is written before the row is handed to
wandb, so a kill in between leaves a missing step, never a duplicate. A fresh start
(start_step 0) begins a new W&B run with a new id: its history restarts at step 0. The PNGs
redrawn at close join the last row only if this process logged it (else a repeated step).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import string
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from bapo_jax.checks import check_choice
from bapo_jax.train.config import WandbMode
from bapo_jax.train.plots import write_atomically

__all__ = ["STATE_FILE", "Images", "MetricSink", "OpenSink", "Scalar", "TensorBoardWriter",
           "WandbOptions", "WandbRun", "numeric", "run_config"]  # fmt: skip

_log = logging.getLogger(__name__)

STATE_FILE = "wandb_run.json"

Scalar = bool | int | float | str  # a metric value, as `metrics.to_scalar` converts it
Images = Mapping[str, str | os.PathLike]  # image key "plots/<name>" -> PNG path


class MetricSink(Protocol):
    """A follower of metrics.jsonl: handed each row the logger writes, in step order, from the
    `start_step` it was opened with; it shows what its backend can. A subclass inherits the
    default `add_images` (shows none)."""

    def log(self, step: int, values: Mapping[str, Scalar], images: Images) -> None:
        """One row: the values of metrics.jsonl at `step` (non-finite floats as such, not null)
        and the PNGs refreshed at this step (mostly none)."""

    def add_images(self, step: int, images: Images) -> None:
        """The PNGs redrawn at close for `step`, the last step given to `log`."""

    def close(self) -> None:
        """Flushes and releases the backend; no call follows."""


class OpenSink(Protocol):
    """Opens a follower whose first row will be `start_step` (e.g. a partial of its class)."""

    def __call__(self, *, start_step: int) -> MetricSink: ...


def numeric(values: Mapping[str, Scalar]) -> dict[str, bool | int | float]:
    """The values a tracker shows: all but the strings."""
    return {k: v for k, v in values.items() if not isinstance(v, str)}


class TensorBoardWriter(MetricSink):
    """Scalar events in `logdir` through tensorboardX, purging steps >= start_step on read
    (images: none, the PNGs are in plots/)."""

    def __init__(self, logdir: str | os.PathLike, *, start_step: int):
        # Imported here: tensorboardX imports torch when torch is installed (~1.5 s).
        from tensorboardX import SummaryWriter
        from tensorboardX.proto.summary_pb2 import Summary

        self._summary = Summary
        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._writer = SummaryWriter(
            os.fspath(logdir),
            purge_step=start_step,
            flush_secs=1,
            filename_suffix=f".{time.time_ns():020d}.{os.getpid()}",
        )

    def log(self, step: int, values: Mapping[str, Scalar], images: Images) -> None:
        """One Event at `step` with a simple_value (float32) per numeric value, if any."""
        if scalars := numeric(values):
            tags = [self._summary.Value(tag=k, simple_value=float(v)) for k, v in scalars.items()]
            self._writer.file_writer.add_summary(self._summary(value=tags), global_step=step)
            self._writer.flush()

    def close(self) -> None:
        self._writer.close()


@dataclasses.dataclass(frozen=True)
class WandbOptions:
    """Where and how the W&B run is created (LoggingConfig's wandb_* keys).

    project / entity (None: the account's default entity) / run_name (None: W&B picks one);
    mode "offline" writes only local files (no network; `wandb sync` uploads them later),
    "online" streams to the server (needs `wandb login` or WANDB_API_KEY);
    system_metrics: let wandb-core sample CPU/GPU/memory every 15 s and capture the console.
    """

    project: str = "bapo-jax"
    entity: str | None = None
    mode: WandbMode = "offline"
    run_name: str | None = None
    system_metrics: bool = False

    @classmethod
    def from_logging(cls, config: Any) -> WandbOptions | None:
        """The options of a `LoggingConfig`, or None when `config.wandb` is off."""
        if not config.wandb:
            return None
        return cls(
            project=config.wandb_project,
            entity=config.wandb_entity,
            mode=config.wandb_mode,
            run_name=config.wandb_run_name,
            system_metrics=config.wandb_system_metrics,
        )


def run_config(out_dir: str | os.PathLike, trainer: Mapping[str, Any]) -> dict[str, Any]:
    """The config a W&B run records: the CLI's `<out_dir>/config.json` (the whole RunConfig:
    model, data, engine, eval, trainer) when its "trainer" section is `trainer`, else
    {"trainer": trainer} (a Trainer built in Python, or a stale file)."""
    path = Path(out_dir) / "config.json"
    try:
        whole = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        whole = None
    if isinstance(whole, dict) and whole.get("trainer") == dict(trainer):
        return whole
    return {"trainer": dict(trainer)}


def _new_run_id() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbRun(MetricSink):
    """One W&B run per run directory, continued across resumes (see the module docstring).
    `log` skips a step W&B already holds (<= last_step) and a row with nothing to show."""

    def __init__(
        self,
        out_dir: str | os.PathLike,
        options: WandbOptions,
        *,
        start_step: int,
        config: Mapping[str, Any] | None = None,
    ):
        check_choice("logging.wandb_mode", options.mode, WandbMode)
        try:
            import wandb
        except ImportError as error:
            raise ImportError(
                "logging.wandb=true needs the wandb package, which is not installed: "
                "pip install -e '.[wandb]' (or pip install 'wandb>=0.31,<0.32')"
            ) from error
        self._wandb = wandb
        self.state_path = Path(out_dir) / STATE_FILE
        state = self._read_state() if start_step > 0 else None
        run_id, last_step = (_new_run_id(), -1) if state is None else state
        self._write_state(run_id, last_step)
        self.run = self._wandb.init(
            project=options.project,
            entity=options.entity,
            name=options.run_name,
            id=run_id,
            resume="allow",
            mode=options.mode,
            dir=os.fspath(out_dir),
            config=dict(config or {}),
            settings=self._wandb.Settings(
                console="auto" if options.system_metrics else "off",
                x_disable_stats=not options.system_metrics,
            ),
            reinit="create_new",  # this object owns its run; never hand back another one
        )
        # Online, the server also reports where the resumed run stands.
        self.last_step = max(last_step, self.run.starting_step - 1)
        self._logged_step: int | None = None  # the last row this object handed to wandb
        if start_step > 0 and self.last_step >= start_step:
            _log.warning(
                "W&B run %s already holds steps up to %d; steps %d..%d keep the killed run's "
                "values and logging continues at step %d",
                run_id, self.last_step, start_step, self.last_step, self.last_step + 1,
            )  # fmt: skip

    def _read_state(self) -> tuple[str, int] | None:
        try:
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except ValueError as error:
            raise ValueError(f"{self.state_path}: not JSON ({error})") from None
        fields = state if isinstance(state, dict) else {}
        run_id, last = fields.get("run_id"), fields.get("last_step")
        if not (isinstance(run_id, str) and run_id and type(last) is int):  # a bool is no step
            raise ValueError(
                f"{self.state_path}: want {{'run_id': str, 'last_step': int}}, got {state!r}"
            )
        return run_id, last

    def _write_state(self, run_id: str, last_step: int) -> None:
        text = json.dumps({"run_id": run_id, "last_step": last_step}) + "\n"
        write_atomically(self.state_path, text.encode("utf-8"))

    def _images(self, images: Images) -> dict[str, Any]:
        return {k: self._wandb.Image(os.fspath(p)) for k, p in images.items()}

    def log(self, step: int, values: Mapping[str, Scalar], images: Images) -> None:
        """One history row at `step`: the numeric values plus `images` as wandb.Image."""
        scalars = numeric(values)
        if step <= self.last_step or not (scalars or images):
            return
        self._write_state(self.run.id, step)  # first: a kill in between loses, never repeats
        # Bools as 0/1, as in TensorBoard; W&B stores NaN/inf as "NaN"/"Infinity".
        row = {k: int(v) if isinstance(v, bool | int) else float(v) for k, v in scalars.items()}
        self.run.log({**row, **self._images(images)}, step=step)
        self.last_step = self._logged_step = step

    def add_images(self, step: int, images: Images) -> None:
        """Adds images to the row of `step` if this object logged it (W&B keeps a row open
        until a later step arrives, so this merges into it)."""
        if images and step == self._logged_step:
            self.run.log(self._images(images), step=step)

    def close(self) -> None:
        self.run.finish()
