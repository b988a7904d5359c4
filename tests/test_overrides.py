"""Command-line overrides and dict round trips over a frozen config tree built from project
configs (OptimizerConfig, BAPOConfig, StepConfig) and test-local sections."""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Literal

import pytest

from bapo_jax.algorithms.bapo import BAPOConfig
from bapo_jax.algorithms.losses import PPOClipConfig
from bapo_jax.overrides import (
    CLASS_KEY,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    parse_override,
)
from bapo_jax.train.optim import OptimizerConfig
from bapo_jax.train.step import StepConfig


@dataclasses.dataclass(frozen=True)
class RolloutSection:
    stop_token_ids: tuple[int, ...] = (2,)
    names: tuple[str, ...] = ()
    engine: Literal["embedded", "vllm"] = "embedded"
    max_tokens: int = 16
    label: str | None = None
    greedy: bool = False

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclasses.dataclass(frozen=True)
class AlgorithmSection:
    bapo: BAPOConfig = dataclasses.field(default_factory=BAPOConfig)


@dataclasses.dataclass(frozen=True)
class DataSection:
    path: str = "gsm8k"
    max_examples: int | None = 100


@dataclasses.dataclass(frozen=True)
class RunSection:
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    algorithm: AlgorithmSection = dataclasses.field(default_factory=AlgorithmSection)
    rollout: RolloutSection = dataclasses.field(default_factory=RolloutSection)
    data: DataSection = dataclasses.field(default_factory=DataSection)
    eval: DataSection | None = None
    step: StepConfig = dataclasses.field(default_factory=StepConfig)  # loss_config: Any

    def __post_init__(self):
        if self.eval is not None and self.eval.path == self.data.path:
            raise ValueError(f"eval.path must differ from data.path, got {self.eval.path!r}")


BASE = RunSection()


def test_spec_examples():
    config = apply_overrides(
        BASE,
        [
            "optimizer.learning_rate=1e-6",
            "algorithm.bapo.rho0=0.55",
            "rollout.stop_token_ids=[1,2]",
            "data.max_examples=none",
        ],
    )
    assert config.optimizer == dataclasses.replace(BASE.optimizer, learning_rate=1e-6)
    assert config.algorithm.bapo == BAPOConfig(rho0=0.55)
    assert config.rollout.stop_token_ids == (1, 2)
    assert config.data == DataSection(max_examples=None)
    assert (config.eval, config.step) == (BASE.eval, BASE.step)
    assert RunSection() == BASE  # the input is untouched
    assert apply_overrides(BASE, []) is BASE


@pytest.mark.parametrize(
    "override, get, want",
    [
        ("optimizer.warmup_steps=10", lambda c: c.optimizer.warmup_steps, 10),
        ("optimizer.learning_rate=3", lambda c: c.optimizer.learning_rate, 3.0),
        ("optimizer.max_grad_norm=None", lambda c: c.optimizer.max_grad_norm, None),
        ("rollout.greedy=TRUE", lambda c: c.rollout.greedy, True),
        ("rollout.greedy=0", lambda c: c.rollout.greedy, False),
        ("rollout.label=null", lambda c: c.rollout.label, None),
        ('rollout.label="none"', lambda c: c.rollout.label, "none"),
        ("rollout.label=a b=c", lambda c: c.rollout.label, "a b=c"),
        ("rollout.engine=vllm", lambda c: c.rollout.engine, "vllm"),
        ("rollout.stop_token_ids=1, 2,3", lambda c: c.rollout.stop_token_ids, (1, 2, 3)),
        ("rollout.stop_token_ids=[]", lambda c: c.rollout.stop_token_ids, ()),
        ("rollout.stop_token_ids=7", lambda c: c.rollout.stop_token_ids, (7,)),
        ('rollout.names=["a", "b,c"]', lambda c: c.rollout.names, ("a", "b,c")),
        ("rollout.names=[x, y]", lambda c: c.rollout.names, ("x", "y")),
        (
            "algorithm.bapo.weight_by_behavior_prob=1",
            lambda c: c.algorithm.bapo.weight_by_behavior_prob,
            True,
        ),
        ("algorithm.bapo.kl_coef=0.01", lambda c: c.algorithm.bapo.kl_coef, 0.01),  # kw-only base
        ("step.loss_config.rho0=0.7", lambda c: c.step.loss_config, BAPOConfig(rho0=0.7)),
    ],
)
def test_values_are_coerced_from_annotations(override, get, want):
    got = get(apply_overrides(BASE, [override]))
    assert got == want and type(got) is type(want)


def test_sections_from_json_and_through_none():
    config = apply_overrides(
        BASE,
        [
            'algorithm.bapo={"rho0": 0.6, "c_high_max": 2.0}',
            "algorithm.bapo.c_low_max=0.8",
            "eval.path=math",  # eval is None: built from DataSection's defaults
        ],
    )
    assert config.algorithm.bapo == BAPOConfig(rho0=0.6, c_high_max=2.0, c_low_max=0.8)
    assert config.eval == DataSection(path="math")
    assert apply_overrides(BASE, ['eval={"max_examples": 5, "path": "aime"}']).eval == DataSection(
        path="aime", max_examples=5
    )
    assert apply_overrides(config, ["eval=none"]).eval is None


def test_fields_that_must_change_together_apply_in_one_replace():
    """rho0=1.5 is invalid for target="fraction"; both orders work since the section is
    validated once with its final values."""
    pair = ["algorithm.bapo.target=pos_neg_ratio", "algorithm.bapo.rho0=1.5"]
    for overrides in (pair, pair[::-1]):
        bapo = apply_overrides(BASE, overrides).algorithm.bapo
        assert (bapo.target, bapo.rho0) == ("pos_neg_ratio", 1.5)
    later_wins = ["optimizer.warmup_steps=1", "optimizer.warmup_steps=2"]
    assert apply_overrides(BASE, later_wins).optimizer.warmup_steps == 2


def test_unknown_keys_list_the_valid_ones():
    message = (
        "unknown config key 'optimizer.lr'; valid keys under 'optimizer': learning_rate, "
        "warmup_steps, weight_decay, b1, b2, eps, max_grad_norm"
    )
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        apply_overrides(BASE, ["optimizer.lr=1e-6"])
    with pytest.raises(ValueError, match=r"^unknown config key 'optimizer.lr.x'; valid keys under"):
        apply_overrides(BASE, ["optimizer.lr.x=1"])
    with pytest.raises(
        ValueError,
        match=r"'nope'; valid keys at the top level: optimizer, algorithm, rollout, data, eval, st",
    ):
        apply_overrides(BASE, ["nope=1"])
    with pytest.raises(
        ValueError, match=r"'algorithm.bapo.rho'; valid keys under 'algorithm.bapo'"
    ):
        apply_overrides(BASE, ["algorithm.bapo.rho=0.4"])
    with pytest.raises(
        ValueError, match=r"'optimizer.learning_rate' is a float .*not a config sec"
    ):
        apply_overrides(BASE, ["optimizer.learning_rate.x=1"])
    with pytest.raises(
        ValueError, match=r"unknown config key 'eval.size'; valid keys under 'eval'"
    ):
        apply_overrides(BASE, ['eval={"size": 3}'])


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("optimizer.warmup_steps", "1.5", "int"),
        ("optimizer.learning_rate", "fast", "float"),
        ("rollout.greedy", "yes", "bool"),
        ("rollout.engine", "sglang", "one of 'embedded', 'vllm'"),
        ("data.max_examples", "many", "int | None"),
        ("data", "3", "DataSection"),
    ],
)
def test_bad_values_name_key_value_and_type(key, value, expected):
    message = f"bad value {value!r} for config key {key!r}: expected {expected}"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        apply_overrides(BASE, [f"{key}={value}"])
    element = "bad value 'x' for config key 'rollout.stop_token_ids[1]': expected int"
    with pytest.raises(ValueError, match=f"^{re.escape(element)}$"):
        apply_overrides(BASE, ["rollout.stop_token_ids=[1,x]"])
    assert apply_overrides(BASE, ["rollout.label="]).rollout.label == ""  # empty str is valid


@pytest.mark.parametrize(
    "override, message",
    [
        ("algorithm.bapo.rho0=1.5", "algorithm.bapo: rho0 must be in (0, 1], got 1.5"),
        ("optimizer.b1=1", "optimizer: OptimizerConfig.b1 must be in [0, 1), got 1.0"),
        ("rollout.max_tokens=0", "rollout: max_tokens must be >= 1, got 0"),
        ("step.loss_config.is_cap=-1", "step.loss_config: is_cap must be > 0, got -1.0"),
        ("eval.path=gsm8k", "RunSection: eval.path must differ from data.path, got 'gsm8k'"),
    ],
)
def test_section_validation_errors_carry_the_section_path(override, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        apply_overrides(BASE, [override])


@pytest.mark.parametrize("bad", ["optimizer.learning_rate", "=3", "a..b=1", ".a=1", "a.=1"])
def test_malformed_overrides_are_named(bad):
    with pytest.raises(ValueError, match=f"^malformed override {re.escape(repr(bad))}"):
        apply_overrides(BASE, [bad])
    assert parse_override("a.b= x=y ") == ("a.b", " x=y ")
    with pytest.raises(ValueError, match="must be a list of key=value strings"):
        apply_overrides(BASE, "optimizer.b1=0.5")


def test_any_field_switches_class_with_the_marker():
    name = f"{PPOClipConfig.__module__}:{PPOClipConfig.__qualname__}"
    config = apply_overrides(
        BASE,
        ["step.loss=ppo_clip", f'step.loss_config={{"{CLASS_KEY}": "{name}", "epsilon": 0.3}}'],
    )
    assert config.step.loss == "ppo_clip"
    assert config.step.loss_config == PPOClipConfig(epsilon=0.3)
    with pytest.raises(ValueError, match=r"^step: StepConfig.loss_config must be a PPOClipConfig"):
        apply_overrides(BASE, ["step.loss=ppo_clip"])


def test_dict_round_trip():
    config = apply_overrides(
        BASE,
        [
            "optimizer.learning_rate=2e-6",
            "optimizer.max_grad_norm=none",
            "algorithm.bapo.order=lower_first",
            "rollout.stop_token_ids=[151643,151645]",
            "rollout.names=a,b",
            "eval.path=aime",
            "step.loss_config.dual_clip=3.0",
            "step.num_micro_batches=4",
        ],
    )
    data = config_to_dict(config)
    assert data["rollout"]["stop_token_ids"] == [151643, 151645]
    assert data["step"]["loss_config"][CLASS_KEY] == "bapo_jax.algorithms.bapo:BAPOConfig"
    assert CLASS_KEY not in data["algorithm"]["bapo"]  # annotated exactly: no marker needed
    restored = config_from_dict(RunSection, json.loads(json.dumps(data)))
    assert restored == config
    assert config_from_dict(RunSection, {}) == BASE  # missing keys take defaults


def test_from_dict_is_strict():
    with pytest.raises(ValueError, match=r"^unknown config key 'optimizer.lr'; valid keys under"):
        config_from_dict(RunSection, {"optimizer": {"lr": 1.0}})
    with pytest.raises(ValueError, match=r"bad value '3' for config key 'optimizer.warmup_steps'"):
        config_from_dict(RunSection, {"optimizer": {"warmup_steps": "3"}})
    with pytest.raises(ValueError, match=r"^algorithm.bapo: rho0 must be in \(0, 1\], got 2.0$"):
        config_from_dict(RunSection, {"algorithm": {"bapo": {"rho0": 2.0}}})
    with pytest.raises(ValueError, match=r"cannot import __dataclass__ 'no.such:Thing'"):
        config_from_dict(RunSection, {"step": {"loss_config": {CLASS_KEY: "no.such:Thing"}}})
