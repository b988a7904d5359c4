"""BAPOConfig: defaults of the paper, validation naming the field and the value."""

import dataclasses
import math

import numpy as np
import pytest

from bapo_jax.algorithms import bapo, registry


def test_defaults_are_the_papers():
    config = bapo.BAPOConfig()
    expected = {
        "rho0": 0.4,
        "c_low_start": 0.6,
        "c_low_max": 0.9,
        "c_low_step": 0.02,
        "c_high_start": 1.2,
        "c_high_max": 3.0,
        "c_high_step": 0.05,
        "order": "upper_first",
        "target": "fraction",
        "statistic": "value",
        "weight_by_behavior_prob": False,
        "dual_clip": None,
        "scope": "update",
        "aggregation": "token_mean",
        "kl_coef": 0.0,
        "entropy_coef": 0.0,
    }
    for name, value in expected.items():
        assert getattr(config, name) == value, name
    assert config.low_grid.shape == (16,) and config.high_grid.shape == (37,)
    np.testing.assert_allclose(config.high_grid[[0, 1, -1]], [1.2, 1.25, 3.0], rtol=1e-12)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rho0 = 0.5  # type: ignore[misc]
    # Hashable, so it can be a static jit argument.
    assert hash(config) == hash(bapo.BAPOConfig())


def test_positional_fields_follow_the_issue_order():
    config = bapo.BAPOConfig(0.5, 0.7, 0.8, 0.05)
    assert (config.rho0, config.c_low_start, config.c_low_max, config.c_low_step) == (
        0.5,
        0.7,
        0.8,
        0.05,
    )


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"rho0": 1.5}, "rho0 must be in (0, 1], got 1.5"),
        ({"rho0": 0.0}, "rho0 must be in (0, 1], got 0.0"),
        ({"rho0": math.nan}, "rho0 must be in (0, 1], got nan"),
        ({"rho0": -1.0, "target": "pos_neg_ratio"}, "rho0 must be > 0 and finite, got -1.0"),
        ({"c_low_step": 0.0}, "c_low_step must be > 0, got 0.0"),
        ({"c_high_step": -0.05}, "c_high_step must be > 0, got -0.05"),
        ({"c_low_start": 0.95}, "c_low_max must be >= c_low_start (0.95), got 0.9"),
        ({"c_high_max": 1.1}, "c_high_max must be >= c_high_start (1.2), got 1.1"),
        ({"c_low_start": 0.0, "c_low_max": 0.5}, "c_low_start must be in (0, 1], got 0.0"),
        ({"c_low_start": 1.05, "c_low_max": 1.1}, "c_low_start must be in (0, 1], got 1.05"),
        ({"c_high_start": 0.95}, "c_high_start must be >= 1, got 0.95"),
        ({"c_low_max": 1.3}, "c_low_max must be <= c_high_start (1.2)"),
        ({"c_high_step": 1e-7}, "c_high_step must be >= c_high_max / 1e+06"),
        ({"order": "sideways"}, "order must be one of ('upper_first', 'lower_first'), got"),
        ({"target": "ratio"}, "target must be one of ('fraction', 'pos_neg_ratio'), got"),
        ({"statistic": "grad"}, "statistic must be one of ('value', 'gradient'), got 'grad'"),
        ({"scope": "device"}, "scope must be one of ('update', 'micro_batch'), got 'device'"),
        ({"weight_by_behavior_prob": 1}, "weight_by_behavior_prob must be a bool, got 1"),
        ({"dual_clip": 0.8}, "dual_clip must be > 1.0, got 0.8"),
        ({"aggregation": "sum"}, "aggregation must be one of"),
        ({"kl_coef": -0.1}, "kl_coef must be >= 0, got -0.1"),
        ({"kl_estimator": "k2"}, "kl_estimator must be one of ('k1', 'k3'), got 'k2'"),
        ({"is_cap": 0.0}, "is_cap must be > 0, got 0.0"),
    ],
)
def test_bad_fields_raise_naming_the_field(fields, message):
    with pytest.raises(ValueError) as error:
        bapo.BAPOConfig(**fields)
    assert message in str(error.value)


def test_valid_variants_construct():
    bapo.BAPOConfig(target="pos_neg_ratio", rho0=2.0)
    bapo.BAPOConfig(rho0=1.0)
    bapo.BAPOConfig(c_low_start=0.6, c_low_max=0.6)  # c_low pinned
    bapo.BAPOConfig(c_low_start=1.0, c_low_max=1.0, c_high_start=1.0)  # both at 1
    bapo.BAPOConfig(dual_clip=3.0, order="lower_first", statistic="gradient", scope="micro_batch")


def test_registry_chooses_losses_by_name():
    assert set(registry.loss_names()) >= {"bapo", "ppo_clip", "clip_higher"}
    spec = registry.get_loss("bapo")
    assert spec.fn is bapo.policy_loss and spec.config_cls is bapo.BAPOConfig
    # BAPO's update-wide search is its hook; micro_batch scope and the baselines have none.
    assert spec.update_statistic_for(bapo.BAPOConfig()) is bapo.UPDATE_WIDE_SEARCH
    assert spec.update_statistic_for(bapo.BAPOConfig(scope="micro_batch")) is None
    baseline = registry.get_loss("ppo_clip")
    assert baseline.update_statistic_for(baseline.config_cls()) is None
    assert spec.logged_config(bapo.BAPOConfig(rho0=0.5)) == {"rho0": 0.5}
    assert baseline.logged_config(baseline.config_cls()) == {}
    assert registry.make_loss_config("bapo", rho0=0.5) == bapo.BAPOConfig(rho0=0.5)
    assert registry.make_loss_config("clip_higher").eps_high == 0.28
    with pytest.raises(ValueError, match="loss must be one of"):
        registry.get_loss("grpo_plus")
