"""`reductions.combine_updates`: the E updates' metrics of one iteration -> one value each, by the
reduction each metric declares (`registry.Reduction`; the step's own in `reductions.STEP_METRICS`).
Expected values are worked out by hand in the comments, not recomputed."""

import numpy as np
import pytest

from bapo_jax.algorithms import registry
from bapo_jax.train import reductions
from bapo_jax.train.reductions import combine_updates


def _updates(**columns):
    """Per-metric lists of per-update values -> one dict per update of 0-d numpy arrays (as
    `jax.device_get` returns the step's metrics)."""
    (n,) = {len(values) for values in columns.values()}
    return [{key: np.asarray(values[i]) for key, values in columns.items()} for i in range(n)]


def test_the_declared_reductions_this_file_relies_on():
    bapo, ppo = registry.get_loss("bapo"), registry.get_loss("ppo_clip")
    assert bapo.reduction("ratio_min") == "min"
    assert bapo.reduction("ratio_max") == "max"
    assert bapo.reduction("iterations") == "max"
    assert bapo.reduction("reached") == "all"
    assert bapo.reduction("entropy") == "mean"
    assert bapo.reduction("loss") == "sum"
    assert ppo.reduction("rho") == "balance"
    assert ppo.reduction("rho/pos") == ppo.reduction("rho/neg") == "sum"
    assert reductions.STEP_METRICS["grad_norm"] == "max"
    assert reductions.STEP_METRICS["num_tokens"] == "mean"


def test_each_reduction_over_three_updates_by_hand():
    stats = _updates(
        ratio_min=np.float32([0.75, 0.5, 0.875]),  # min -> 0.5 (their mean would be 0.7083)
        ratio_max=np.float32([1.25, 2.0, 1.5]),  # max -> 2.0
        iterations=np.int32([3, 7, 5]),  # max -> 7
        reached=[True, False, True],  # all -> False
        entropy=np.float32([1.0, 2.0, 4.5]),  # mean -> 7.5 / 3 = 2.5
        loss=np.float32([0.5, -1.0, 2.0]),  # sum (per update already) -> mean 1.5 / 3 = 0.5
        pg_loss=np.float32([-0.25, 0.25, 0.75]),  # sum -> 0.75 / 3 = 0.25
        grad_norm=np.float32([0.5, 3.0, 1.0]),  # the step's own, max -> 3.0
        num_tokens=np.float32([100, 200, 600]),  # the step's own, mean -> 300
    )
    out = combine_updates(stats, "bapo")
    assert out == {
        "ratio_min": 0.5,
        "ratio_max": 2.0,
        "iterations": 7.0,
        "reached": 0.0,
        "entropy": 2.5,
        "loss": 0.5,
        "pg_loss": 0.25,
        "grad_norm": 3.0,
        "num_tokens": 300.0,
    }
    assert list(out) == list(stats[0])  # the first update's keys, in its order
    assert all(type(value) is float for value in out.values())


def test_mean_is_over_updates_not_weighted_by_their_tokens():
    # Updates of 100, 200 and 600 tokens: entropy 1.0, 2.0, 4.5 -> (1 + 2 + 4.5) / 3 = 2.5; a
    # token-weighted mean would be (100 + 400 + 2700) / 900 = 3.556.
    stats = _updates(entropy=[1.0, 2.0, 4.5], num_tokens=[100.0, 200.0, 600.0])
    assert combine_updates(stats, "ppo_clip")["entropy"] == 2.5


def test_all_is_one_only_when_every_update_reached():
    assert combine_updates(_updates(reached=[True, True, True]), "bapo") == {"reached": 1.0}
    assert combine_updates(_updates(reached=[True, True, False]), "bapo") == {"reached": 0.0}


def test_balance_is_the_mean_of_the_updates_values_not_recomputed_from_the_parts():
    # Update 1: rho = 1 / (1 + 3) = 0.25; update 2: rho = 6 / (6 + 2) = 0.75. Over updates the
    # declared "balance" is their mean, 0.5 (not 7 / 12 = 0.583 from the summed parts); the
    # parts ("sum") are means too: pos (1 + 6) / 2 = 3.5, neg (3 + 2) / 2 = 2.5.
    stats = _updates(rho=[0.25, 0.75], **{"rho/pos": [1.0, 6.0], "rho/neg": [3.0, 2.0]})
    assert combine_updates(stats, "ppo_clip") == {"rho": 0.5, "rho/pos": 3.5, "rho/neg": 2.5}


def test_extrema_with_negative_and_equal_values():
    # min of -0.5, -2, -2 is -2; max of 0, 0, -1 is 0 (not a mean: -2/3 would be wrong).
    stats = _updates(ratio_min=[-0.5, -2.0, -2.0], ratio_max=[0.0, 0.0, -1.0])
    assert combine_updates(stats, "clip_higher") == {"ratio_min": -2.0, "ratio_max": 0.0}


def test_one_update_gives_its_own_values():
    stats = _updates(ratio_min=[0.625], grad_norm=[1.5], reached=[True], loss=[-0.25])
    assert combine_updates(stats, "bapo") == {
        "ratio_min": 0.625,
        "grad_norm": 1.5,
        "reached": 1.0,
        "loss": -0.25,
    }


def test_a_key_missing_from_a_later_update_raises():
    # The first update's keys are the metrics; every update must have them (the jitted step
    # returns the same keys each time), so a missing one is an error, not a shorter mean.
    stats = [{"entropy": 1.0, "ratio_min": 0.5}, {"entropy": 2.0}]
    with pytest.raises(KeyError, match="ratio_min"):
        combine_updates(stats, "bapo")


def test_a_metric_without_a_declared_reduction_raises():
    with pytest.raises(KeyError, match="loss 'bapo' returns metric 'made_up' without a declared"):
        combine_updates(_updates(made_up=[1.0, 2.0]), "bapo")
    with pytest.raises(ValueError, match="loss must be one of"):
        combine_updates(_updates(entropy=[1.0]), "no_such_loss")
