"""Token lags and the version-gap policy (`train.staleness`), by hand on small rows, and in the
loop with partial rollouts (slow)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from bapo_jax.train import staleness
from bapo_jax.train.assemble import RowArrays
from bapo_jax.train.config import AlgorithmConfig, OffPolicyConfig

# Three responses of 4 tokens after a 1-token prompt; the trainer trains version 5.
VERSIONS = np.array(
    [
        [-1, 5, 5, 5, 5],  # fresh
        [-1, 3, 3, 4, 4],  # a partial rollout: lags 2, 2, 1, 1
        [-1, 1, 1, 1, -1],  # replayed: lag 4, 3 tokens
    ]
)


def _rows(loss=None) -> RowArrays:
    n, t = VERSIONS.shape
    response = VERSIONS >= 0
    mask = response.astype(np.float32) if loss is None else loss
    zeros = np.zeros((n, t), np.float32)
    return RowArrays(
        input_ids=np.ones((n, t), np.int32),
        attention_mask=np.ones((n, t), np.int32),
        loss_mask=mask,
        advantages=zeros,
        behavior_logp=np.where(response, -1.0, 0.0).astype(np.float32),
        versions=VERSIONS,
        scheduled_versions=VERSIONS,
        trainer_logp=np.full((n, t), np.nan, np.float32),
        rewards=np.zeros(n, np.float32),
        response_lengths=response.sum(1).astype(np.int32),
        overlong=np.zeros(n, bool),
        replayed=np.array([False, False, True]),
        active=np.ones(n, bool),
    )


def test_the_lag_distribution_by_hand():
    out = staleness.lag_metrics(_rows(), version=5)
    # 11 trained tokens: 4 at lag 0, 2 at lag 1, 2 at lag 2, 3 at lag 4 (bucket "3plus")
    assert out["staleness/lag0_share"] == pytest.approx(4 / 11)
    assert out["staleness/lag1_share"] == pytest.approx(2 / 11)
    assert out["staleness/lag2_share"] == pytest.approx(2 / 11)
    assert out["staleness/lag3plus_share"] == pytest.approx(3 / 11)
    assert out["masked/overlong_share"] == 0.0


def test_the_mean_lag_by_advantage_sign():
    rows = _rows()
    advantages = np.zeros(VERSIONS.shape, np.float32)
    advantages[0], advantages[1], advantages[2] = 1.0, -1.0, -0.5
    out = staleness.lag_metrics(dataclasses.replace(rows, advantages=advantages), version=5)
    assert out["staleness/mean_pos"] == 0.0  # response 0: fresh
    assert out["staleness/mean_neg"] == pytest.approx((2 + 2 + 1 + 1 + 4 * 3) / 7)
    assert "staleness/mean_pos" not in staleness.lag_metrics(rows, 5)  # no advantage of a sign


def test_the_overlong_share_counts_the_filtered_responses():
    rows = _rows()
    loss = rows.loss_mask.copy()
    loss[0] = 0.0  # response 0 hit the cap and the overlong filter took it out
    rows = dataclasses.replace(rows, loss_mask=loss, overlong=np.array([True, False, False]))
    assert staleness.lag_metrics(rows, 5)["masked/overlong_share"] == pytest.approx(4 / 11)


@pytest.mark.parametrize(
    "policy, gap, kept, masked, dropped",
    [
        ("mask", 1, [[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0]], 5, None),
        ("wait", 1, [[1, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0]], 5, None),
        ("drop", 1, [[1, 1, 1, 1], [0, 0, 0, 0], [0, 0, 0]], 7, 2),
        ("mask", 2, [[1, 1, 1, 1], [1, 1, 1, 1], [0, 0, 0]], 3, None),
        ("drop", 4, [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1]], 0, 0),
    ],
)
def test_the_gap_policy_by_hand(policy, gap, kept, masked, dropped):
    rows, out = staleness.apply_gap(_rows(), 5, gap, policy)
    got = [list(rows.loss_mask[i][VERSIONS[i] >= 0].astype(int)) for i in range(3)]
    assert got == kept
    assert out["gap/masked_tokens"] == masked
    assert out["gap/masked_share"] == pytest.approx(masked / 11)
    assert out.get("gap/dropped_responses") == dropped
    np.testing.assert_array_equal(rows.advantages, _rows().advantages)  # only the mask moves


def test_no_gap_no_change_no_metric():
    rows = _rows()
    same, out = staleness.apply_gap(rows, 5, None, "mask")
    assert same is rows and out == {}


def test_already_untrained_tokens_are_not_counted():
    loss = (VERSIONS >= 0).astype(np.float32)
    loss[2] = 0.0  # the replayed group is inactive (buffer warming up)
    _, out = staleness.apply_gap(_rows(loss), 5, 1, "mask")
    assert out["gap/masked_tokens"] == 2 and out["gap/masked_share"] == pytest.approx(2 / 8)


def test_is_ratio_quantiles_and_the_gap_by_lag_against_numpy():
    rng = np.random.default_rng(0)
    rows = _rows()
    old = np.where(VERSIONS >= 0, -1.0 + rng.normal(0, 0.1, VERSIONS.shape), 0.0)
    out = staleness.ratio_metrics(rows, 5, old)
    trained = VERSIONS >= 0
    w = np.exp(old[trained] - rows.behavior_logp[trained])
    for name, q in (("min", 0.0), ("p01", 0.01), ("p50", 0.5), ("p99", 0.99), ("max", 1.0)):
        assert out[f"is_ratio/{name}"] == pytest.approx(np.quantile(w, q))
    gap = np.abs(old - rows.behavior_logp)
    assert out["mismatch/lag0/mean_abs"] == pytest.approx(gap[0, 1:].mean())
    assert out["mismatch/lag1/mean_abs"] == pytest.approx(gap[1, 3:].mean())
    assert out["mismatch/lag2/mean_abs"] == pytest.approx(gap[1, 1:3].mean())
    assert out["mismatch/lag3plus/mean_abs"] == pytest.approx(gap[2, 1:4].mean())
    assert staleness.ratio_metrics(_rows(np.zeros(VERSIONS.shape, np.float32)), 5, old) == {}


def test_a_gap_below_the_staleness_is_only_taken_with_wait_or_in_flight():
    assert OffPolicyConfig(staleness=2, max_version_gap=1, gap_policy="wait").max_version_gap == 1
    assert OffPolicyConfig(staleness=2, max_version_gap=1, inflight=True).inflight
    assert OffPolicyConfig(staleness=2, max_version_gap=2, gap_policy="drop").staleness == 2


def test_wait_bounds_how_far_generation_runs_ahead():
    assert staleness.submit_depth(2, None, "mask") == 2
    assert staleness.submit_depth(2, 1, "mask") == 2
    assert staleness.submit_depth(2, 1, "wait") == 1
    assert staleness.submit_depth(1, 3, "wait") == 1


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_version_gap": -1}, "max_version_gap must be None or an int >= 0, got -1"),
        ({"max_version_gap": 1, "gap_policy": "skip"}, "gap_policy must be one of"),
        ({"gap_policy": "drop"}, "gap_policy must be 'mask' .* unless max_version_gap is set"),
        (
            {"staleness": 2, "max_version_gap": 1},
            r"max_version_gap must be >= staleness \(2\) with gap_policy 'mask'",
        ),
    ],
)
def test_inconsistent_gap_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        OffPolicyConfig(**kwargs)


@pytest.mark.slow  # long: in `make test-slow` (CI runs it)
@pytest.mark.parametrize("policy, gap", [("mask", 1), ("drop", 1), ("wait", 0)])
def test_the_loop_applies_the_gap_to_partial_rollouts(tmp_path, policy, gap):
    """k = 1 with 3-token rounds: responses mix versions, a partial rollout's early tokens lag 2
    and more. None older than the gap is trained; under wait with G = 0 the loop submits no
    batch ahead (what lags is a partial rollout's early tokens)."""
    from tests.train.loop_fixtures import ToySource, small_config
    from tests.train.test_loop import _run

    off = OffPolicyConfig(
        staleness=1, partial_budget=3, partial_pool=6, max_version_gap=gap, gap_policy=policy
    )
    algo = AlgorithmConfig(ratio_base="recomputed")
    rows = _run(
        small_config(steps=4, offpolicy=off, algorithm=algo),
        tmp_path,
        source=ToySource(answers=("parity",)),
    )
    assert max(r["mixed_version_frac"] for r in rows) > 0
    older = [sum(r[f"staleness/{b}_share"] for b in staleness.LAG_BUCKETS[gap + 1 :]) for r in rows]
    assert max(older) > 0  # tokens older than the gap existed...
    for r, old in zip(rows, older, strict=True):
        shares = [r[f"staleness/{b}_share"] for b in staleness.LAG_BUCKETS]
        assert sum(shares) == pytest.approx(1.0) or r["trained_tokens"] == 0
        assert r["staleness/max"] <= gap  # ...and none of them was trained
        assert (r["gap/masked_tokens"] > 0) == (old > 0)
        if policy == "drop":
            assert r["gap/dropped_responses"] >= (r["gap/masked_tokens"] > 0)
        if r["trained_tokens"]:
            assert r["is_ratio/min"] <= r["is_ratio/p50"] <= r["is_ratio/max"]
            assert f"mismatch/{staleness.LAG_BUCKETS[gap + 1]}/mean_abs" not in r
