"""Training-curve PNGs from the metric history: one per panel plus an overview grid.

A panel is a title and the metric keys drawn against the step on one set of axes; reference
keys (targets such as rho0) are drawn dashed. A panel none of whose main keys has been logged
is skipped. Rendering uses matplotlib's Agg canvas on a bare `Figure` (no pyplot, no global
backend switch), and every PNG is written to a hidden temp file in the same directory and
`os.replace`d over the old one, so a viewer never sees a half-written image.

The overview is a grid of min(n, OVERVIEW_COLUMNS) columns and ceil(n / columns) rows of cells
PANEL_SIZE_IN * DPI pixels each; every axes sits at the same fixed margins inside its cell (no
layout engine, whose text measuring costs more than the drawing). The figure is drawn once and
each panel PNG is its cell, cut from the overview's pixels, so a refresh draws every curve once.
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from PIL import Image

__all__ = ["DEFAULT_PANELS", "OVERVIEW_NAME", "Panel", "render_plots", "write_atomically"]

# steps, values (NaN where a value was not finite / null): one metric's curve.
Series = tuple[Sequence[int], Sequence[float]]

OVERVIEW_NAME = "overview.png"
OVERVIEW_COLUMNS = 2
PANEL_SIZE_IN = (5.0, 3.2)
DPI = 100
# The axes' box inside its cell, as fractions of the cell: room for the y tick labels on the
# left, the x label below and the title above.
_AXES_BOX = (0.14, 0.15, 0.83, 0.71)  # left, bottom, width, height
_PNG_COMPRESS_LEVEL = 1  # zlib level: faster than the default 6, for a somewhat larger file
_MARKER_MAX_POINTS = 40  # below this many points each point also gets a marker


@dataclasses.dataclass(frozen=True)
class Panel:
    """One plot: `keys` drawn solid, `reference_keys` dashed, x axis = step."""

    title: str
    keys: tuple[str, ...]
    reference_keys: tuple[str, ...] = ()

    @property
    def filename(self) -> str:
        return re.sub(r"[^a-z0-9]+", "_", self.title.lower()).strip("_") + ".png"


DEFAULT_PANELS = (
    Panel("reward & accuracy", ("reward/mean", "accuracy")),
    Panel("entropy", ("entropy",)),
    Panel("rho", ("rho",), reference_keys=("rho0",)),
    Panel("BAPO bounds", ("c_low", "c_high")),
    Panel("clip fractions", ("clip_high_frac", "clip_low_frac")),
    Panel("grad norm", ("grad_norm",)),
    Panel("response length", ("response_length/mean",)),
    Panel("staleness", ("staleness/mean", "staleness/max")),
    Panel(
        "iteration seconds", ("time/generate", "time/update", "time/sync_write", "time/sync_load")
    ),
    Panel("generation hidden by the update", ("overlap/hidden_share",)),
    Panel("behaviour log-prob gap", ("agreement/mean_abs", "agreement/max_abs")),
)


def write_atomically(path: str | os.PathLike, data: bytes) -> None:
    """Writes `data` to a hidden temp file beside `path`, fsyncs, os.replace()s it over `path`."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)  # make the rename itself durable
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _draw(ax, panel: Panel, history: Mapping[str, Series]) -> None:
    for key in panel.keys + panel.reference_keys:
        if key not in history:
            continue
        steps, values = history[key]
        reference = key in panel.reference_keys
        ax.plot(
            steps,
            values,
            label=key,
            linestyle="--" if reference else "-",
            color="0.4" if reference else None,
            marker="." if len(steps) < _MARKER_MAX_POINTS and not reference else None,
        )
    ax.set_title(panel.title)
    ax.set_xlabel("step", labelpad=1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")


def _last_step(panels: Sequence[Panel], history: Mapping[str, Series]) -> int:
    return max(history[k][0][-1] for p in panels for k in p.keys if len(history.get(k, ((),))[0]))


def _png(pixels: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG", compress_level=_PNG_COMPRESS_LEVEL)
    return buffer.getvalue()


def render_plots(
    history: Mapping[str, Series],
    plots_dir: str | os.PathLike,
    panels: Sequence[Panel] = DEFAULT_PANELS,
) -> list[Panel]:
    """Writes `<panel>.png` for each panel with a logged point of one of its main keys and
    `overview.png`; returns those panels."""
    drawn = [p for p in panels if any(len(history.get(k, ((), ()))[0]) for k in p.keys)]
    if not drawn:
        return []
    plots_dir = Path(plots_dir)
    plots_dir.mkdir(parents=True, exist_ok=True)
    columns = min(OVERVIEW_COLUMNS, len(drawn))
    rows = math.ceil(len(drawn) / columns)
    width, height = PANEL_SIZE_IN
    fig = Figure(figsize=(columns * width, rows * height), dpi=DPI)
    canvas = FigureCanvasAgg(fig)
    left, bottom, box_width, box_height = _AXES_BOX
    step_label = f"step {_last_step(drawn, history)}"
    for i, panel in enumerate(drawn):
        row, column = divmod(i, columns)
        x0, y0 = column / columns, 1 - (row + 1) / rows  # the cell's lower-left corner
        ax = fig.add_axes(
            (
                x0 + left / columns,
                y0 + bottom / rows,
                box_width / columns,
                box_height / rows,
            )
        )
        _draw(ax, panel, history)
        # In every cell, so that each panel PNG cut from the overview says which step it shows.
        fig.text(x0 + 0.01 / columns, y0 + 0.97 / rows, step_label, fontsize="small", va="top")
    canvas.draw()
    pixels = np.asarray(canvas.buffer_rgba())[..., :3]  # [rows*h, columns*w, RGB]
    cell_h, cell_w = pixels.shape[0] // rows, pixels.shape[1] // columns
    for i, panel in enumerate(drawn):
        row, column = divmod(i, columns)
        cell = pixels[row * cell_h : (row + 1) * cell_h, column * cell_w : (column + 1) * cell_w]
        write_atomically(plots_dir / panel.filename, _png(cell))
    write_atomically(plots_dir / OVERVIEW_NAME, _png(pixels))
    return drawn
