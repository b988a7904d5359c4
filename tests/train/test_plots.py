"""Plot panels: which PNGs are drawn, that they are valid images of the stated size, atomicity."""

import math
import os

import numpy as np
import pytest
from PIL import Image

from bapo_jax.train import metrics as metrics_module
from bapo_jax.train import plots
from bapo_jax.train.metrics import MetricsLogger
from bapo_jax.train.plots import OVERVIEW_NAME, render_plots, write_atomically

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _panel_pixels():
    width, height = plots.PANEL_SIZE_IN
    return round(width * plots.DPI), round(height * plots.DPI)


def _assert_png(path, size):
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as image:
        image.load()  # decodes every chunk: fails on a truncated file
        assert image.size == size
        colors = image.convert("RGB").getcolors(maxcolors=1 << 20)
    assert len(colors) > 10  # axes, text and curves, not a blank canvas


def _series(n, offset=0.0):
    return list(range(n)), [offset + 0.1 * i for i in range(n)]


def test_render_plots_draws_present_panels_only(tmp_path):
    history = {
        "reward/mean": _series(6),
        "rho": _series(6, 0.2),
        "rho0": _series(6, 0.4),
        "c_low": (list(range(6)), [0.6, 0.6, math.nan, 0.62, 0.62, 0.64]),
        "unrelated": _series(6),
    }
    drawn = render_plots(history, tmp_path / "plots")

    assert [p.title for p in drawn] == ["reward & accuracy", "rho", "BAPO bounds"]
    files = sorted(os.listdir(tmp_path / "plots"))
    assert files == sorted(["reward_accuracy.png", "rho.png", "bapo_bounds.png", OVERVIEW_NAME])
    width, height = _panel_pixels()
    for name in ("reward_accuracy.png", "rho.png", "bapo_bounds.png"):
        _assert_png(tmp_path / "plots" / name, (width, height))
    # 3 panels -> a 2-column grid with 2 rows.
    _assert_png(tmp_path / "plots" / OVERVIEW_NAME, (2 * width, 2 * height))
    # Each panel PNG is its cell of the overview, row by row (drawn once, cut out).
    overview = np.asarray(Image.open(tmp_path / "plots" / OVERVIEW_NAME))
    for i, name in enumerate(("reward_accuracy.png", "rho.png", "bapo_bounds.png")):
        row, column = divmod(i, 2)
        cell = overview[row * height : (row + 1) * height, column * width : (column + 1) * width]
        np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "plots" / name)), cell)


def test_reference_keys_alone_do_not_make_a_panel(tmp_path):
    history = {"rho0": _series(3), "entropy": _series(3)}
    drawn = render_plots(history, tmp_path)
    assert [p.title for p in drawn] == ["entropy"]
    width, height = _panel_pixels()
    _assert_png(tmp_path / OVERVIEW_NAME, (width, height))  # one panel -> 1 x 1 grid
    assert render_plots({"rho0": _series(3)}, tmp_path / "empty") == []
    assert not (tmp_path / "empty").exists()


def test_write_atomically_replaces_and_cleans_up_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "a.png"
    write_atomically(target, b"first")
    write_atomically(target, b"second")
    assert target.read_bytes() == b"second"

    def broken_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(plots.os, "fsync", broken_fsync)
    with pytest.raises(OSError, match="disk full"):
        write_atomically(target, b"third")
    assert target.read_bytes() == b"second"
    assert os.listdir(tmp_path) == ["a.png"]  # the temp file is gone


def test_logger_refreshes_plots_every_n_calls_and_at_close(tmp_path, monkeypatch):
    rendered = []

    def recording_render(history, plots_dir):
        rendered.append({k: list(v[0]) for k, v in history.items()})
        return render_plots(history, plots_dir)

    monkeypatch.setattr(metrics_module, "render_plots", recording_render)
    common = dict(total_steps=10, plot_every=2, tensorboard=False, progress=False)
    logger = MetricsLogger(tmp_path, **common)
    for step in range(5):
        logger.log(step, {"entropy": 1.0 - 0.1 * step, "grad_norm": np.float32(step), "tag": "x"})
    assert [h["entropy"] for h in rendered] == [[0, 1], [0, 1, 2, 3]]
    logger.close()
    assert rendered[-1]["entropy"] == [0, 1, 2, 3, 4]
    assert "tag" not in rendered[-1]  # strings are not plotted
    width, height = _panel_pixels()
    _assert_png(tmp_path / "plots" / "grad_norm.png", (width, height))
    _assert_png(tmp_path / "plots" / OVERVIEW_NAME, (2 * width, height))

    # Resumed after a checkpoint at step 2: the plotted history is reloaded from the JSONL.
    rendered.clear()
    logger = MetricsLogger(tmp_path, resume_step=2, **common)
    logger.log(3, {"entropy": 0.5, "grad_norm": 7.0})
    logger.log(4, {"entropy": 0.4, "grad_norm": 8.0})
    logger.close()
    assert len(rendered) == 1
    assert rendered[0]["entropy"] == [0, 1, 2, 3, 4]
    assert rendered[0]["grad_norm"] == [0, 1, 2, 3, 4]
