"""The RL loop on the embedded engine: each off-policy mode acts and shows in the metrics."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest

from bapo_jax.train.config import AlgorithmConfig, OffPolicyConfig, TrainerConfig
from bapo_jax.train.metrics import read_jsonl
from tests.train.loop_fixtures import ToySource, make_trainer, small_config


def _run(config: TrainerConfig, out_dir, **kwargs) -> list[dict]:
    """Run; every mode writes its JSONL rows, TensorBoard events and PNG plots."""
    make_trainer(config, out_dir, **kwargs).run()
    events = os.listdir(os.path.join(out_dir, "tb"))
    assert any(name.startswith("events.out.tfevents") for name in events)
    plots = os.listdir(os.path.join(out_dir, "plots"))
    assert {"overview.png", "staleness.png", "bapo_bounds.png"} <= set(plots), plots
    return read_jsonl(os.path.join(out_dir, "metrics.jsonl"))


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_on_policy_run_writes_jsonl_tensorboard_and_plots(tmp_path):
    rows = _run(small_config(steps=3), tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["staleness/max"] == 0 and r["updates"] == 1 and r["replay/share"] == 0
        assert 0.6 <= r["c_low"] <= 0.9 and r["c_high"] >= 1.2  # BAPO's searched bounds
        assert r["tokens_per_s"] > 0 and np.isfinite(r["loss"])
    assert [r["optimizer_step"] for r in rows] == [1, 2, 3]
    events = os.listdir(tmp_path / "tb")
    assert any(name.startswith("events.out.tfevents") for name in events)
    assert any(name.endswith(".png") for name in os.listdir(tmp_path / "plots"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_stale_rollouts_follow_the_schedule(tmp_path):
    """Batch i comes from version max(0, i - k): observed staleness min(i, k), reaching k."""
    k = 2
    rows = _run(small_config(steps=5, offpolicy=OffPolicyConfig(staleness=k)), tmp_path)
    for i, r in enumerate(rows):
        assert r["staleness/mean"] == r["staleness/max"] == min(i, k), (i, r)
    assert rows[-1]["staleness/max"] == k


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_stale_tokens_are_scored_against_the_version_that_sampled_them(tmp_path):
    """k = 1: batch i is sampled by version i - 1 while its update starts from version i. The
    loss's behaviour log-prob of every token is version (i - 1)'s teacher-forced log-prob, so
    the update's ratio is pi_i / pi_{i-1}, not 1.

    All three from the rows: staleness says which version sampled the trained tokens; the
    teacher check (`logging.logprob_agreement`) recomputes every trained token's log-prob under
    the params published as that version and compares it with the behaviour log-prob the loss
    is given; the loss's ratio range, taken by the one update of each batch at the params it
    starts from, is 1 for batch 0 only."""
    config = small_config(steps=3, offpolicy=OffPolicyConfig(staleness=1))
    config = dataclasses.replace(
        config, logging=dataclasses.replace(config.logging, logprob_agreement=True)
    )
    rows = _run(config, tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [r["updates"] for r in rows] == [1, 1, 1]  # one update per batch
    assert [r["optimizer_step"] for r in rows] == [1, 2, 3]
    for i, r in enumerate(rows):
        # mean == max == 1 (0 for batch 0): every trained token is of version max(0, i - 1).
        assert r["staleness/mean"] == r["staleness/max"] == min(i, 1), (i, r)
        assert r["version_mismatch/tokens"] == 0  # the engine sampled with the scheduled one
        assert r["agreement/tokens"] == r["trained_tokens"] > 0  # every trained token checked
        assert r["agreement/max_abs"] < 1e-5, (i, r["agreement/max_abs"])
        deviation = max(r["ratio_max"] - 1, 1 - r["ratio_min"])  # max |ratio - 1|
        if i == 0:  # batch 0: sampled and trained by version 0
            assert deviation < 1e-4, (i, deviation)
        else:
            assert deviation > 1e-3, (i, deviation)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
@pytest.mark.parametrize("minibatch", ["groups", "rows"])
def test_experience_reuse_makes_e_updates_per_batch(tmp_path, minibatch):
    algo = AlgorithmConfig(epochs=2, mini_batches=2, minibatch=minibatch)
    rows = _run(small_config(steps=2, algorithm=algo), tmp_path)
    assert [r["updates"] for r in rows] == [4, 4]
    assert [r["optimizer_step"] for r in rows] == [4, 8]
    assert any(r["balance/zero_variance_groups"] < 1 for r in rows)  # some group has signal
    sums = [r["balance/advantage_sum_max"] for r in rows]
    if minibatch == "groups":  # every update holds whole groups: GRPO's zero sum holds
        assert max(sums) < 1e-4, sums
    else:  # rows of a group land in different updates
        assert max(sums) > 0.1, sums


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_replay_share_matches_the_setting(tmp_path):
    off = OffPolicyConfig(replay_ratio=0.5, replay_capacity=8)
    rows = _run(small_config(steps=3, offpolicy=off), tmp_path)
    assert rows[0]["replay/share"] == 0.0  # buffer still empty: replay slots masked out
    assert [r["replay/share"] for r in rows[1:]] == [0.5, 0.5]
    assert rows[2]["staleness/max"] >= 1  # replayed groups were generated by older versions


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_partial_rollouts_mix_policy_versions(tmp_path):
    off = OffPolicyConfig(partial_budget=3, partial_pool=6)
    cfg = small_config(steps=4, offpolicy=off)
    rows = _run(cfg, tmp_path, source=ToySource(answers=("parity",)))
    assert max(r["mixed_version_frac"] for r in rows) > 0
    assert max(r["staleness/max"] for r in rows) >= 1
    # 3-token rounds: a batch takes several. A step may take none when groups finished in the
    # previous step's last round (beyond its batch) fill it; it then generates nothing.
    assert max(r["rollout/rounds"] for r in rows) > 1
    for r in rows:
        assert r["rollout/rounds"] > 0 or r["rollout/generated_tokens"] == 0


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
@pytest.mark.parametrize("cap, status", [(4.0, 0), (0.0, 1)])
def test_dynamic_sampling_refills_or_stops_at_its_cap(tmp_path, cap, status):
    algo = AlgorithmConfig(dynamic_sampling=True, dynamic_sampling_max_extra=cap)
    rows = _run(small_config(steps=2, algorithm=algo), tmp_path)
    for r in rows:
        assert r["dynamic_sampling/capped"] == status
        assert r["dynamic_sampling/dropped_groups"] >= 1  # half the prompts are "always"
        if status == 0:
            assert r["dynamic_sampling/filler_groups"] == 0
            assert r["rollout/prompts_drawn"] > 4  # refilled beyond B
        else:
            assert r["dynamic_sampling/filler_groups"] >= 1
            assert r["rollout/prompts_drawn"] == 4


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_recomputed_ratio_base_logs_the_mismatch(tmp_path):
    algo = AlgorithmConfig(ratio_base="recomputed")
    rows = _run(small_config(steps=2, algorithm=algo), tmp_path)
    for r in rows:  # same weights, same numerics: engine and trainer agree
        assert r["mismatch/max_abs"] < 1e-4
        assert r["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)


def test_resume_refuses_changed_settings(tmp_path):
    _run(small_config(steps=2), tmp_path)
    changed = dataclasses.replace(small_config(steps=4), algorithm=AlgorithmConfig(epochs=2))
    with pytest.raises(ValueError, match="algorithm"):
        make_trainer(changed, tmp_path).run()


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
def test_logprob_agreement_covers_every_trained_token_of_every_version(tmp_path):
    """k = 1 with partial rollouts: responses mix versions. The teacher scores each round's
    tokens under the params of the version the trainer scheduled for it, so every trained
    token is checked and (one engine, one set of numerics) the gap is rounding only."""
    off = OffPolicyConfig(staleness=1, partial_budget=3, partial_pool=6)
    config = small_config(steps=4, offpolicy=off)
    config = dataclasses.replace(
        config, logging=dataclasses.replace(config.logging, logprob_agreement=True)
    )
    rows = _run(config, tmp_path, source=ToySource(answers=("parity",)))
    assert max(r["mixed_version_frac"] for r in rows) > 0
    for r in rows:
        assert r["agreement/tokens"] == r["trained_tokens"] > 0
        assert r["agreement/max_abs"] < 1e-5, r["agreement/max_abs"]
        assert r["version_mismatch/tokens"] == 0 and r["version_mismatch/share"] == 0


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
@pytest.mark.parametrize("k", [0, 1])
def test_rows_report_the_sync_and_the_generation_the_update_hid(tmp_path, k):
    """k = 0: every batch is generated before its update (nothing hidden). k = 1: batch i + 1
    is generated while batch i trains, so part of it runs inside the update's span."""
    rows = _run(small_config(steps=3, offpolicy=OffPolicyConfig(staleness=k)), tmp_path)
    for i, r in enumerate(rows):
        assert r["sync/engine_version"] == i + 1 and r["sync/attempts"] == 1
        assert r["time/sync_write"] == 0.0 and r["time/sync_load"] >= 0.0  # in process
        assert r["version_mismatch/tokens"] == 0  # checked even with the agreement off
        assert not any(k.startswith("agreement/") for k in r)
    generated = [r for r in rows if "overlap/generation_s" in r]
    if k == 0:
        assert len(generated) == 3
        assert all(r["overlap/hidden_s"] == 0 == r["overlap/hidden_share"] for r in generated)
    else:  # batches 0 and 1 before the first update, then one per iteration but the last
        assert [r["step"] for r in generated] == [0, 1]
        assert all(0 < r["overlap/hidden_share"] <= 1 for r in generated[1:])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["engine_at_start"] == {"version": 0} and summary["resumed_from"] == 0


def test_an_on_policy_batch_logs_the_engine_mismatch_of_its_first_update(tmp_path):
    """k = 0: the first update starts from the weights that sampled every token, so its
    |behaviour - trainer| log-prob is the engine mismatch (same numerics here: rounding); at
    k = 1 no update starts from the sampling weights and nothing is logged."""
    rows = _run(small_config(steps=2), tmp_path / "k0")
    for r in rows:
        assert 0 < r["mismatch/tokens"] <= r["trained_tokens"]
        assert r["mismatch/max_abs"] < 1e-4 and "behavior_gap_sum" not in r
    stale = _run(small_config(steps=2, offpolicy=OffPolicyConfig(staleness=1)), tmp_path / "k1")
    assert not any("mismatch/mean_abs" in r for r in stale[1:])
