"""The ranking of a pod's trainer / vLLM splits (`run.layouts`), with the memory plan stubbed by
a table (the real plan compiles the 7B step once per trainer size: `--rank`, docs/pod.md)."""

from __future__ import annotations

import pytest

from bapo_jax.models.config import Qwen2Config
from bapo_jax.run import estimate as est
from bapo_jax.run import layouts
from experiments import aime_7b

MODEL = Qwen2Config.preset("qwen2.5-7b")
PEAKS = {4: (51.0e9, ""), 8: (40.0e9, "")}


def _peak(config):
    devices = config.mesh_config().num_devices
    return PEAKS.get(devices, (None, f"mesh {config.mesh}: 3584 does not divide"))


def test_fitting_splits_are_ranked_and_the_rest_listed_once():
    ranked = layouts.rank(aime_7b.CONFIG, MODEL, est.Rates(), "h100", 1, peak=_peak)
    fitting = [c for c in ranked if c.estimate is not None and not c.layout.colocated]
    times = [c.estimate.iteration_s for c in fitting]
    assert times == sorted(times) and fitting
    assert {c.layout.trainer_gpus for c in fitting} == {4}  # 8 leaves no GPU to a server
    # 4 + 4 one-GPU servers, 4 + 2 two-GPU servers, 4 + 1 four-GPU server; k = 0 and 1
    assert {(c.layout.servers, c.layout.server_gpus) for c in fitting} == {(4, 1), (2, 2), (1, 4)}
    assert len(fitting) == 6
    refused = [c for c in ranked if c.estimate is None and not c.layout.colocated]
    assert all(c.layout.staleness == 0 for c in refused)
    assert {c.layout.trainer_gpus for c in refused} == {1, 2, 3, 5, 6, 7}
    assert {c.refusal for c in refused if c.layout.trainer_gpus == 3} == {
        "the 1024 rows of an update do not split over 3 devices"
    }
    assert all("does not divide" in c.refusal for c in refused if c.layout.trainer_gpus == 2)
    reference = [c for c in ranked if c.layout.reference]
    assert len(reference) == 1 and reference[0].layout.trainer_gpus == 8


def test_the_candidate_config_carries_the_layout():
    layout = est.Layout(trainer_gpus=2, servers=6, server_gpus=1, staleness=1)
    config = layouts.candidate_config(aime_7b.CONFIG, layout)
    assert config.mesh_config().fsdp == 2 and config.trainer_devices == 2
    assert config.trainer.algorithm.micro_batches == 1024 // 2  # one row per device
    assert config.trainer.offpolicy.staleness == 1 and config.engine.launch_servers == 6
    assert est.layout_of(config) == layout


def test_the_table_marks_the_baseline_the_default_and_the_speed_up():
    ranked = layouts.rank(aime_7b.CONFIG, MODEL, est.Rates(), "h100", 1, peak=_peak)
    baseline = est.Layout(trainer_gpus=4, servers=4, server_gpus=1, staleness=0)
    table = layouts.format_ranking(ranked, baseline, est.layout_of(aime_7b.SEPARATE))
    assert "4 trainer + 4 x 1 vLLM, staleness 0 (baseline) | 51.0 GB" in table
    assert "4 trainer + 4 x 1 vLLM, staleness 1 (default) | 51.0 GB" in table
    assert "| 1.00x |" in table and "does not fit: mesh" in table
    best = ranked[0].estimate.iteration_s
    base = next(c.estimate.iteration_s for c in ranked if c.layout == baseline)
    assert f"| {base / best:.2f}x |" in table


def test_a_plan_needs_the_simulated_devices():
    config = layouts.candidate_config(
        aime_7b.CONFIG, est.Layout(trainer_gpus=64, servers=1, server_gpus=1, staleness=0)
    )
    with pytest.raises(ValueError, match="needs as many simulated CPU devices"):
        layouts.plan_peak(config)
